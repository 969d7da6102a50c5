"""Checkpoints: checkpoints/step_NNNNNN/, written to a temporary directory, fsynced, then renamed.

A checkpoint is complete when its trainer_state.json exists and every file it lists has the
size it records; anything else (a crash mid-write) is skipped with a message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ptbr.log import log
from ptbr.train.atomic import write_directory

STATE_FILE = "trainer_state.json"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, backend, loop_state: dict, keep_last: int = 0) -> Path:
    """Write a complete checkpoint atomically; on failure the previous ones are untouched."""

    def fill(directory: Path) -> None:
        backend.save_state(directory)
        files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
        state = dict(loop_state, step=step, files=files)
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")

    final = write_directory(checkpoint_path(run_dir, step), fill, "a checkpoint",
                            fix="free space or lower --keep-last")
    if keep_last > 0:
        for old in complete_checkpoints(run_dir, quiet=True)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict | None:
    """The checkpoint's trainer state if it is complete, else None."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        for name, size in state["files"].items():
            if (path / name).stat().st_size != size:
                return None
        return state
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def complete_checkpoints(run_dir: Path, quiet: bool = False) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are reported and passed over."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("step_*")):
        if read_state(path) is not None:
            found.append(path)
        elif not quiet:
            log(f"skipping incomplete or corrupt checkpoint {path}")
    return found


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None
