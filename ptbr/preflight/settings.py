"""The settings preflight plans for: `ptbr train`'s PretrainConfig or `ptbr finetune`'s FinetuneConfig.

Light on purpose (no torch): cli.py imports it to build the `ptbr preflight` flags. Both modes'
flags come from the settings dataclasses, so `ptbr preflight` accepts exactly what `ptbr train`
and `ptbr finetune` accept, and recommended_config.json holds exactly their keys.
"""

from __future__ import annotations

import argparse
import dataclasses

from ptbr.config import (
    FinetuneConfig,
    PretrainConfig,
    build_settings,
    read_config_file,
    settings_fields,
)
from ptbr.errors import ConfigError

MODES = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}


def add_preflight_flags(parser: argparse.ArgumentParser) -> None:
    """--mode, --load-test, and every flag of train and finetune (each name once)."""
    from ptbr.cli import add_settings_flags, setting_help

    parser.add_argument("--mode", choices=tuple(MODES), default="pretrain",
                        help="plan a pretraining (ptbr train) or a fine-tuning (ptbr finetune) run (default: pretrain)")
    parser.add_argument("--load-test", action="store_true",
                        help="finetune: also load the base model's weights, as the run will (slow for large models)")
    add_settings_flags(parser, PretrainConfig)  # also --config, and --output: where the reports go
    pretrain = {f.name: f for f, _ in settings_fields(PretrainConfig)}
    finetune = {f.name: f for f, _ in settings_fields(FinetuneConfig)}
    for action in parser._actions:  # a flag both have, meaning or defaulting otherwise per mode: say both
        if action.dest in finetune and setting_help(pretrain[action.dest]) != setting_help(finetune[action.dest]):
            action.help = (f"(pretrain) {setting_help(pretrain[action.dest])} "
                           f"(finetune) {setting_help(finetune[action.dest])}").replace("%", "%%")
    taken = set(pretrain)
    finetune_only = argparse.ArgumentParser(add_help=False)
    add_settings_flags(finetune_only, FinetuneConfig)
    for action in finetune_only._actions:  # FinetuneConfig's flags that train does not have
        if action.dest not in taken and action.dest != "config":
            action.help = f"(finetune) {action.help}"
            parser._add_action(action)


def requested_settings(mode: str, args: argparse.Namespace) -> tuple[dict, set[str]]:
    """The run's settings as a plain dict, exactly as `ptbr train`/`ptbr finetune` would resolve
    them (defaults < --config file < flags, validated), and the names the user gave. A flag of
    the other mode is an error."""
    cls = MODES[mode]
    names = [f.name for f, _ in settings_fields(cls)]
    everything = {f.name for c in MODES.values() for f, _ in settings_fields(c)}
    foreign = sorted(name for name in everything - set(names) if hasattr(args, name))
    if foreign:
        flags = ", ".join("--" + n.replace("_", "-") for n in foreign)
        raise ConfigError(f"{flags} not used by --mode {mode}", "ptbr preflight", "drop them, or change --mode")
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    settings = build_settings(cls, file_values, overrides, source=getattr(args, "config", None) or "flags")
    given = {key.replace("-", "_") for key in file_values} | set(overrides)
    return dataclasses.asdict(settings), given & set(names)
