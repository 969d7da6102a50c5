"""Writing a whole directory atomically: filled aside, fsynced, then swapped in.

Checkpoints, the final model, the best adapter and a merged model are all written this way, so a
crash or a full disk at any moment leaves the previous version in place, never a half-written one.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ptbr.errors import OutputError

# prefixes of the directories a write in progress uses beside its target; a crash can leave them
LEFTOVER_PREFIXES = (".tmp-", ".old-")


def write_directory(final: Path, fill: Callable[[Path], None], what: str,
                    fix: str = "free space in the output directory") -> Path:
    """Call fill(tmp) on an empty directory beside `final`, then make it `final`."""
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                _fsync(path)
        _fsync(tmp)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        _fsync(final.parent)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)  # the swap itself failed: put the previous version back
        if out_of_space(exc):
            raise OutputError(f"the disk filled up (or a file size limit was hit) while saving {what}: "
                              f"{_first_line(exc)}", str(final), f"{fix}; the previous {what} is intact") from exc
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {what}: {exc.strerror or exc}", str(final),
                              "check permissions and free space of the output directory") from exc
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def remove_leftovers(folder: Path) -> None:
    """Delete what writes cut short by a crash left in `folder` (call it holding the run lock)."""
    for prefix in LEFTOVER_PREFIXES:
        for leftover in folder.glob(f"{prefix}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def out_of_space(exc: BaseException) -> bool:
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
