"""Checkpoints: checkpoints/step_NNNNNN/, written to a temporary directory, fsynced, then renamed.

trainer_state.json records the run the checkpoint belongs to (mode and identity, compared on
resume), the loop's state, the schedule, and the size and sha256 of every file. A checkpoint is
complete when every listed file has its size (a cheap check, done for every checkpoint) and
intact when every file also has its hash (checked for the one a run resumes from); anything else
is passed over with a message and the previous checkpoint is used.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ptbr.files import aside, file_sha256, write_directory
from ptbr.log import log

STATE_FILE = "trainer_state.json"
FORMAT = 2  # 2: files carry sha256 and the state records the run's identity


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, training_step, record: dict, keep_last: int = 0,
                    write: bool = True, progress=None) -> Path:
    """Write a complete checkpoint atomically (the training step's state files plus
    trainer_state.json with `record`); on failure the previous ones are untouched. In a
    data-parallel run every rank calls it (the states may be gathered) and one rank writes.
    `progress(what)` is told of each part done (the hang watchdog: a large checkpoint on a slow
    disk is progress, file by file, not one silence)."""
    progress = progress or (lambda what: None)
    if not write:
        training_step.save_state(None)
        return checkpoint_path(run_dir, step)

    def fill(directory: Path) -> None:
        training_step.save_state(directory)
        progress("its files written")
        files = {}
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            files[path.name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
            progress(f"{path.name} hashed")
        state = dict(record, format=FORMAT, step=step, files=files)
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")

    final = write_directory(checkpoint_path(run_dir, step), fill, f"the checkpoint of step {step}",
                            fix=f"free space (older checkpoints in {checkpoints_dir(run_dir)} can go: a run resumes "
                                "from its newest), or keep fewer with a lower --keep-last (they are removed after "
                                "each save, so N holds N + 1 for a moment)")
    if keep_last > 0:
        for old in complete_checkpoints(run_dir, quiet=True)[:-keep_last]:
            # renamed first: a delete cut short leaves a leftover the next start removes, never a
            # half-deleted step_N that every later run warns about
            doomed = aside(old, "old")
            try:
                old.rename(doomed)
            except OSError:
                doomed = old
            shutil.rmtree(doomed, ignore_errors=True)
    return final


def read_state(path: Path) -> dict | None:
    """The checkpoint's trainer state if it is complete (a well-formed trainer_state.json, every
    file it lists there at its size), else None (why_incomplete says why)."""
    state, _ = _checked_state(path)
    return state


def why_incomplete(path: Path) -> str:
    """Why read_state(path) found no complete checkpoint, in words that name the file."""
    return _checked_state(path)[1] or "it changed while it was read"


def _checked_state(path: Path) -> tuple[dict | None, str | None]:
    """(the trainer state, None) for a complete checkpoint, else (None, what is wrong)."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except OSError as exc:
        return None, f"{STATE_FILE} cannot be read ({exc.strerror or exc})"
    except ValueError:
        return None, f"{STATE_FILE} is not valid JSON"
    if not _well_formed(state):
        return None, f"{STATE_FILE} is malformed"
    for name, entry in state["files"].items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            return None, f"{name} is missing"
        if size != _size(entry):
            return None, f"{name} holds {size:,} bytes, {STATE_FILE} lists {_size(entry):,}"
    return state, None


def _size(entry) -> int:
    return entry["size"] if isinstance(entry, dict) else entry


def _well_formed(state) -> bool:
    """The shape the loop and the resume check read, so that no hand-edited or foreign file crashes them."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    def number(value) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    if not isinstance(state, dict) or not whole(state.get("step")):
        return False
    files, loop, scheduler = state.get("files"), state.get("loop"), state.get("scheduler")
    if not isinstance(files, dict) or not files or not isinstance(loop, dict) or not isinstance(scheduler, dict):
        return False
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else entry
        if "/" in name or name.startswith(".") or not whole(size):
            return False
    if loop.get("step") != state["step"] or not all(whole(loop.get(k, 0)) for k in
                                                      ("tokens_seen", "skipped_steps", "bad_in_a_row")):
        return False
    if not number(loop.get("elapsed_s", 0)) or not all(v is None or number(v) for v in
                                                         (loop.get("best_val_loss"), loop.get("best_step"))):
        return False
    return (number(scheduler.get("peak_lr")) and whole(scheduler.get("warmup_steps"))
            and whole(scheduler.get("horizon", scheduler.get("max_steps"))) and number(scheduler.get("min_lr_ratio")))


def corruption(path: Path, state: dict) -> str | None:
    """Why the checkpoint's files do not match the hashes it recorded, or None when they all do."""
    for name, entry in state["files"].items():
        expected = entry.get("sha256") if isinstance(entry, dict) else None
        if expected is None:
            continue  # written before checkpoints recorded hashes: the size check is all there is
        try:
            if file_sha256(path / name) != expected:
                return f"{name} does not match the sha256 recorded when it was saved"
        except OSError as exc:
            return f"{name} cannot be read: {exc.strerror or exc}"
    return None


def complete_checkpoints(run_dir: Path, quiet: bool = False) -> list[Path]:
    """Complete checkpoints, oldest first (by step number: step_1000000 comes after step_999999,
    which a sort by name would put first); incomplete ones are reported and passed over."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    numbered = [(int(match.group(1)), path) for path in folder.glob("step_*")
                if (match := re.fullmatch(r"step_(\d+)", path.name)) and path.is_dir()]
    found = []
    for _, path in sorted(numbered):
        state, why = _checked_state(path)
        if state is not None:
            found.append(path)
        elif not quiet:
            log(f"warning: skipping incomplete or corrupt checkpoint {path}: {why}")
    return found


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None
