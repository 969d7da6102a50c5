"""The source checkout ptbr runs from: a bundle's ptbr wheel is built from it, its wheels come from
its locks/kaggle.txt through docker/build.py (the images' own wheelhouse code), and its kernel
script and metadata templates from its kaggle/ folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ptbr.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ("pyproject.toml", "docker/build.py", "locks/kaggle.txt", "kaggle/kernel.py",
          "kaggle/dataset-metadata.json", "kaggle/kernel-metadata.json")


def checkout_root() -> Path:
    missing = [name for name in NEEDED if not (ROOT / name).is_file()]
    if missing:
        raise ConfigError(f"`ptbr kaggle bundle` builds the bundle from ptbr's source checkout, and this ptbr has "
                          f"none ({', '.join(missing)} missing)", str(ROOT),
                          "run it from a clone of the repository (`pip install -e .` there, or `nox -s kaggle -- "
                          "bundle ...`)")
    return ROOT


def load_build_script(root: Path) -> ModuleType:
    """docker/build.py as a module (standard library only; loaded as noxfile.py loads it)."""
    name = "ptbr_build_for_kaggle"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, root / "docker" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
