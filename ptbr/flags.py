"""Command-line flags made from the settings dataclasses: one flag per field, with the field's help,
default and choices. No torch here: `ptbr --help` stays fast.

Flags default to "not given" (argparse.SUPPRESS), so that the dataclass stays the one place a
default lives and a --config file can fill what the command line leaves out.
"""

from __future__ import annotations

import argparse

from ptbr.config import MODES, FinetuneConfig, PretrainConfig, base_type, settings_fields


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_settings_flags(parser: argparse.ArgumentParser, cls: type, skip: set[str] = frozenset(),
                       prefix_help: str = "") -> None:
    """One flag per field of the settings dataclass `cls` (except `skip`), then --config."""
    for f, annotation in settings_fields(cls):
        if f.name in skip:
            continue
        help_text = prefix_help + setting_help(f)
        kwargs = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        kind = base_type(annotation)
        if kind is bool:
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        choices = f.metadata.get("choices")
        if choices:  # argparse then shows {a,b,c} and refuses anything else
            kwargs["choices"] = choices
        else:
            kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag_name(f.name), type=kind, **kwargs)
    if "config" not in skip:
        parser.add_argument("--config", help="JSON or YAML file with the same settings in snake_case; flags override it")


def setting_help(f) -> str:
    """A settings field's help text with its default, as `--help` shows it."""
    help_text = f.metadata.get("help", "")
    return help_text if f.default is None else f"{help_text} (default: {f.default})"


def setting_default(cls: type, name: str):
    """The default of one settings field, for a command that shares it without taking every flag."""
    return next(f.default for f, _ in settings_fields(cls) if f.name == name)


def add_preflight_flags(parser: argparse.ArgumentParser) -> None:
    """`ptbr preflight`: --mode, --load-test, and every flag of train and finetune (each name once)."""
    parser.add_argument("--mode", choices=tuple(MODES), default="pretrain",
                        help="plan a pretraining (ptbr train) or a fine-tuning (ptbr finetune) run (default: pretrain)")
    parser.add_argument("--load-test", action="store_true",
                        help="finetune: also load the base model's weights, as the run will (slow for large models)")
    parser.add_argument("--for", dest="plan_for", choices=("here", "kaggle"), default="here",
                        help="here: plan for this machine; kaggle: for the Kaggle kernel `ptbr kaggle bundle` makes "
                             "(two T4s), whose recommended_config.json the bundle's --config takes as is "
                             "(default: here)")
    add_settings_flags(parser, PretrainConfig)  # also --config, and --output: where the reports go
    pretrain = {f.name: f for f, _ in settings_fields(PretrainConfig)}
    finetune = {f.name: f for f, _ in settings_fields(FinetuneConfig)}
    for action in parser._actions:  # a flag both have, meaning or defaulting otherwise per mode: say both
        if action.dest in finetune and setting_help(pretrain[action.dest]) != setting_help(finetune[action.dest]):
            action.help = (f"(pretrain) {setting_help(pretrain[action.dest])} "
                           f"(finetune) {setting_help(finetune[action.dest])}").replace("%", "%%")
    add_settings_flags(parser, FinetuneConfig, skip=set(pretrain) | {"config"}, prefix_help="(finetune) ")
