"""What a bundle is made of: its folders and file names, the rules Kaggle sets for ids and titles,
and reading a bundle back (push, status and output work from the bundle alone)."""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from ptbr.errors import ConfigError, OutputError

# BUNDLE/dataset is uploaded as the Kaggle dataset OWNER/SLUG; BUNDLE/kernel is pushed as the
# kernel OWNER/SLUG.
DATASET = "dataset"
KERNEL = "kernel"
DATASET_METADATA = "dataset-metadata.json"
KERNEL_METADATA = "kernel-metadata.json"
KERNEL_FILE = "ptbr_kernel.py"
# Inside the dataset. The first three names are also in kaggle/kernel.py (a test keeps them in step).
BUNDLE_MARKER = "ptbr-bundle.json"  # how the kernel finds the bundle; lists every file with size and sha256
RUN_MARKER = "ptbr-kaggle-run.json"  # what the kernel leaves in /kaggle/working beside the run
RUN_DIR = "run"
SETTINGS_FILE = "train-config.json"  # the run's settings: `--config` of ptbr train/finetune on Kaggle
WHEELS, DATA, BASE = "wheels", "data", "base"

# Kaggle's image today: CPython 3.12 (docker/build.py's KAGGLE_PYTHON: a test keeps the two equal).
KAGGLE_PYTHON = "3.12"
# GPU sessions end after 12 hours; stopping on our own half an hour before leaves a large model's
# checkpoint and Kaggle's saving of /kaggle/working time to finish.
STOP_AFTER_HOURS = 11.5
# How often push and status ask Kaggle about a dataset being processed or a kernel running.
POLL_SECONDS = 30.0
# Settings a bundle gives the run when its config leaves them out: both T4s, and fewer
# checkpoints, since Kaggle keeps about 20 GB of /kaggle/working.
KAGGLE_RUN_DEFAULTS = {"num_processes": "auto", "keep_last": 2}

# Kaggle's rules for ids and titles, as its client checks them (tests/test_kaggle.py calls the
# client's own checks on what a bundle writes).
SLUG = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
OWNER = re.compile(r"^[a-z0-9]+(?:[_-][a-z0-9]+)*$")
SLUG_LENGTH = (6, 50)  # datasets; kernels need at least 5
TITLE_LENGTH = (6, 50)
# kaggle:OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION], a model hosted on Kaggle
KAGGLE_MODEL = re.compile(r"^kaggle:([^/\s]+)/([^/\s]+)/([^/\s]+)/([^/\s]+)(?:/(\d+))?$")


def id_problems(owner: str, slug: str, title: str | None) -> list[str]:
    """Kaggle's rules for the ids and the title (None: the slug is the title)."""
    problems = []
    if not OWNER.match(owner or ""):
        problems.append(f"--owner {owner!r} is not a Kaggle username (lowercase letters, digits, - and _)")
    low, high = SLUG_LENGTH
    if not SLUG.match(slug or "") or not low <= len(slug) <= high:
        problems.append(f"--slug {slug!r} must be {low}-{high} lowercase letters, digits and single hyphens "
                        "(Kaggle's rule for dataset ids)")
    low, high = TITLE_LENGTH
    # without --title the slug is the title, and the slug's own rule already bounds its length
    if title is not None and not low <= len(title) <= high:
        problems.append(f"--title {title!r} must be {low}-{high} characters (Kaggle's rule for dataset titles)")
    return problems


def slugify(text: str) -> str | None:
    """The id Kaggle derives from a kernel's title, as its client computes it (python-slugify, which
    the kaggle package requires: "2°" is "2deg", "1,5" is "15"). Without that package: the id where
    the title holds only ASCII letters and digits, letters with accents, spaces and hyphens (every
    rule gives the same id for those), else None."""
    try:
        from slugify import slugify as clients_slugify  # lazily: only the kaggle extra brings it
    except ImportError:
        plain = all(char.isascii() and (char.isalnum() or char in " -") or
                    (char.isalpha() and unicodedata.normalize("NFKD", char)[0].isascii())
                    for char in text)
        if not plain:
            return None
        ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
        return re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return clients_slugify(text)


def kernel_title(title: str, slug: str) -> str:
    """Kaggle names a kernel after its title: the title when it leads to the slug, else the slug."""
    return title if slugify(title) == slug else slug


@dataclass(frozen=True)
class Bundle:
    """A bundle on disk, as `ptbr kaggle bundle` wrote it."""

    path: Path
    info: dict  # the marker: id, mode, ptbr version, folders, every file with its size and sha256
    dataset_metadata: dict
    kernel_metadata: dict

    @property
    def dataset(self) -> Path:
        return self.path / DATASET

    @property
    def kernel(self) -> Path:
        return self.path / KERNEL

    @property
    def dataset_id(self) -> str:
        return self.dataset_metadata["id"]

    @property
    def kernel_id(self) -> str:
        return self.kernel_metadata["id"]


def read_bundle(path: str | Path) -> Bundle:
    """The bundle at `path`; anything else is a ConfigError that says what is missing."""
    if str(path) == "":
        raise ConfigError("BUNDLE must be a path, got an empty one", "ptbr kaggle",
                          "give the folder `ptbr kaggle bundle --output` wrote")
    path = Path(path)
    files = {name: path / folder / name for folder, name in
             ((DATASET, BUNDLE_MARKER), (DATASET, DATASET_METADATA), (KERNEL, KERNEL_METADATA))}
    missing = [f"{DATASET if key != KERNEL_METADATA else KERNEL}/{key}" for key, file in files.items()
               if not file.is_file()]
    if missing:
        raise ConfigError(f"not a ptbr Kaggle bundle: {', '.join(missing)} missing", str(path),
                          "give the folder `ptbr kaggle bundle --output` wrote")
    loaded = {}
    for key, file in files.items():
        try:
            loaded[key] = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {file.name}: {exc}", str(file), "make the bundle again") from exc
    return Bundle(path, loaded[BUNDLE_MARKER], loaded[DATASET_METADATA], loaded[KERNEL_METADATA])


def is_bundle(path: Path) -> bool:
    return (path / DATASET / BUNDLE_MARKER).is_file()


def resolved_path(value: str | Path, flag: str) -> Path:
    """A folder that ptbr replaces whole (a bundle, a download), made absolute: `.` has no name
    to write beside. The current directory, or a folder holding it, is refused: replacing it
    moves it aside and removes it, which would leave the shell it was given from in a removed
    folder."""
    path = Path(value).expanduser().resolve()
    if Path.cwd().resolve().is_relative_to(path):
        raise OutputError(f"{flag} is the current directory or holds it, and the folder is replaced whole: this "
                          "shell would be left in a removed folder", str(path),
                          f"give a folder inside it, e.g. {flag} {'kaggle-out' if flag == '--path' else 'bundle'}")
    return path
