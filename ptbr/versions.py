"""Versions of Python and the packages a run used (for run_config.json and reports)."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("ptbr", "torch", "transformers", "accelerate", "tokenizers", "safetensors", "numpy", "peft",
            "bitsandbytes", "mlx", "mlx-lm")


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
