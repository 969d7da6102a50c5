"""The settings preflight plans for: `ptbr train`'s PretrainConfig or `ptbr finetune`'s FinetuneConfig,
resolved from `ptbr preflight`'s flags (ptbr/flags.py makes them from the same dataclasses, so
preflight accepts exactly what train and finetune accept)."""

from __future__ import annotations

import argparse

from ptbr.config import MODES, LoopSettings, build_settings, read_config_file, settings_fields
from ptbr.errors import ConfigError


def requested_settings(mode: str, args: argparse.Namespace) -> tuple[LoopSettings, set[str]]:
    """The run's settings, exactly as `ptbr train`/`ptbr finetune` would resolve them (defaults <
    --config file < flags, validated), and the names the user gave. A flag of the other mode is an
    error."""
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
    given = {str(key).replace("-", "_") for key in file_values} | set(overrides)
    return settings, given & set(names)
