"""One ptbr command per output directory (a run, a dataset): OUTPUT/.ptbr.lock, held with flock for
the life of the process.

The kernel releases an flock when its process dies (even by SIGKILL), so a lock left behind by a
dead run is taken over; the PID written inside names the owner in messages.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ptbr.errors import OutputError
from ptbr.files import unwritable_fix
from ptbr.log import log

LOCK_FILE = ".ptbr.lock"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        gone = OutputError("the output directory was removed as this run started (another run, starting at the "
                           "same moment, gave up on it)", str(self.path.parent), "run the same command again")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            raise gone from None
        except OSError as exc:  # no permission, a read-only file system
            raise OutputError(f"cannot write in the output directory: {exc.strerror or exc}", str(self.path.parent),
                              unwritable_fix(exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _read_owner(fd)
            os.close(fd)
            raise _in_use(self.path.parent, owner) from None
        try:  # the lock is the file at this path still, not one a removal unlinked in between
            same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise gone
        previous = _read_owner(fd)
        if previous.get("pid") and previous.get("pid") != str(os.getpid()):
            log(f"taking over a stale lock from PID {previous['pid']} (no longer running) in {self.path.parent}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\nhost={socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a clean exit leaves no owner behind
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def held_if_free(run_dir: Path) -> Iterator[bool]:
    """True, holding run_dir's lock for the block, where no run holds it now (or there is no lock
    file); False where one does."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        yield True
        return
    except OSError:  # no such directory (a path under a file), no permission: nothing of ours to touch
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # (closing releases the lock)


def refuse_if_in_use(run_dir: Path) -> None:
    """Raise the refusal RunLock.acquire gives where another process holds run_dir's lock now; else
    nothing (no lock file, or one nobody holds). A --num-processes launcher asks before it starts
    any worker: its rank 0 takes the lock only after every worker has imported torch and joined the
    group, and the launch would have written its workers' logs into the other run's directory.
    flock has no test: a shared lock is taken for an instant, which a run holding the lock refuses."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file, no directory: nothing holds it (what cannot be written, the run reports)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        raise _in_use(run_dir, _read_owner(fd)) from None
    finally:
        os.close(fd)  # (closing releases the shared lock)


def _in_use(run_dir: Path, owner: dict[str, str]) -> OutputError:
    return OutputError(f"another ptbr run (PID {owner.get('pid', '?')} on {owner.get('host', '?')}) is using this "
                       "output directory", str(run_dir), "wait for it to finish, stop it, or choose another --output")


def _read_owner(fd: int) -> dict[str, str]:
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
