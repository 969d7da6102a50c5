"""The processes of one run: a single process, or the ranks of a data-parallel run.

What the loop and the runs need to agree on across ranks, and nothing else: which rank writes
(logs, metrics, checkpoints, final/), whether any rank asked to stop, and one decision taken by
the main rank and shared with the others (an error included, so that no rank waits forever for
one that has already failed). A single process is the trivial world; torch's process group is
the other (ptbr/backends/torch/distributed.py). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ptbr.errors import PtbrError

T = TypeVar("T")


class World(Protocol):
    rank: int  # 0 .. size - 1
    size: int
    local_rank: int  # the rank on this machine (which GPU)

    @property
    def is_main(self) -> bool:
        """This rank writes the run's files (rank 0)."""

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any of them (one collective)."""

    def decide(self, decision: Callable[[], T]) -> T:
        """Run `decision` on the main rank only and return its result on every rank; if it raises,
        every rank raises the same error."""

    def barrier(self) -> None: ...

    def close(self) -> None:
        """The run's collectives are over (called when a run ends well): torch's process group is
        destroyed, or its backend's threads can abort the process as it exits."""

    def stopped_by_another(self, exc: BaseException, command: str) -> PtbrError | None:
        """The error to report where `exc` ended this rank because another rank's process went away
        (not this rank's crash); None for anything else."""


class SingleProcess:
    """A run of one process: every question answers itself."""

    rank, size, local_rank = 0, 1, 0

    @property
    def is_main(self) -> bool:
        return True

    def any(self, flag: bool) -> bool:
        return flag

    def decide(self, decision: Callable[[], T]) -> T:
        return decision()

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stopped_by_another(self, exc: BaseException, command: str) -> PtbrError | None:
        return None

    def describe(self) -> str:
        return "1 process"


def shared(decision: Callable[[], T]) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, the exception): what the main rank sends the others."""
    try:
        return decision(), None
    except Exception as exc:  # noqa: BLE001 - passed on to every rank, raised there
        return None, exc
