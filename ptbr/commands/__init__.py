"""One module per CLI command; each exposes main(args) -> exit code."""

from __future__ import annotations

import argparse

from ptbr.config import build_settings, read_config_file, settings_fields


def settings_from_args(cls: type, args: argparse.Namespace):
    """Settings from defaults < --config file < flags given on the command line."""
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    names = [f.name for f, _ in settings_fields(cls)]
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return build_settings(cls, file_values, overrides, source=args.config or "flags")


def quiet_transformers() -> None:
    """transformers' own progress bars (e.g. 'Writing model shards') would interleave with ours."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
