"""Checkpoints: checkpoints/step_NNNNNN/, written to a temporary directory, fsynced, then renamed.

A checkpoint is complete when its trainer_state.json exists and every file it lists has the
size it records; anything else (a crash mid-write) is skipped with a message.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from ptbr.errors import OutputError
from ptbr.log import log

STATE_FILE = "trainer_state.json"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, backend, loop_state: dict, keep_last: int = 0) -> Path:
    """Write a complete checkpoint atomically; on failure the previous ones are untouched."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        backend.save_state(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        state = dict(loop_state, step=step, files=files)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(final.parent)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(exc):
            raise OutputError(f"the disk filled up (or a file size limit was hit) while saving a checkpoint: "
                              f"{_first_line(exc)}", str(final),
                              "free space or lower --keep-last; the previous checkpoint is intact") from exc
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write checkpoint: {exc.strerror or exc}", str(final),
                              "check permissions and free space of the output directory") from exc
        raise
    if keep_last > 0:
        for old in complete_checkpoints(run_dir, quiet=True)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _out_of_space(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    # torch.save's C++ writer turns a short write into a RuntimeError without the errno
    return isinstance(exc, RuntimeError) and ("unexpected pos" in str(exc) or "PytorchStreamWriter" in str(exc))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
