"""Versions of Python and the packages a run used (for run_config.json and reports)."""

from __future__ import annotations

import os
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


def install_extra(extra: str, in_image: str, then: str = "") -> str:
    """How to get one of ptbr's optional extras: `pip install 'ptbr[EXTRA]'` and `then`. ptbr's
    images hold what their lock pins and nothing else, installed as root without network: pip cannot
    add it there, so `in_image` says what to do instead (e.g. run the command on the host)."""
    variant = image_variant()
    if variant:
        return f"the ptbr-{variant} image leaves out the {extra} extra: {in_image}"
    return f"pip install 'ptbr[{extra}]'{then}"


def image_variant() -> str | None:
    """"cpu" or "cuda" inside ptbr's images (their Dockerfile sets PTBR_IMAGE_VARIANT), else None."""
    return os.environ.get("PTBR_IMAGE_VARIANT") or None
