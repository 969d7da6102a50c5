"""The hang watchdog: when no step completes in time, report where every thread is and exit.

The old tools froze at step 0% forever. Here a background thread watches a heartbeat that the loop
touches at each step, evaluation and checkpoint; it also covers model building and the first step.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ptbr.errors import HangDetected
from ptbr.log import log, shout

EXIT_HANG = HangDetected.exit_code
BEFORE_FIRST_STEP_S = 1800.0  # model download/build, data checks, first CUDA kernels
AFTER_FIRST_STEP_FACTOR = 20.0
AFTER_FIRST_STEP_MIN_S = 300.0


class Watchdog:
    def __init__(self, run_dir: Path, timeout_s: float | None, action: str = "exit",
                 memory_report: Callable[[], str] | None = None, rank: int = 0, ranks: int = 1):
        """memory_report: the backend's description of the memory in use, for the hang report.
        rank, ranks: in a data-parallel run, each rank watches itself and writes hang_report.rankN.txt."""
        self.run_dir, self.configured, self.action = run_dir, timeout_s, action
        self.memory_report = memory_report
        self.rank, self.ranks = rank, ranks
        self.limit = timeout_s if timeout_s is not None else BEFORE_FIRST_STEP_S
        self.last_beat = time.monotonic()
        self.phase = "starting (before the first step)"
        self.reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ptbr-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self, phase: str) -> None:
        self.last_beat = time.monotonic()
        self.phase = phase
        self.reported = False

    def first_step_done(self, seconds: float) -> None:
        if self.configured is None:
            self.limit = max(AFTER_FIRST_STEP_MIN_S, AFTER_FIRST_STEP_FACTOR * seconds)
            log(f"hang watchdog: {format_seconds(self.limit)} without progress is a hang (--hang-timeout to change)")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 10)):
            waited = time.monotonic() - self.last_beat
            if waited > self.limit and not self.reported:
                self.reported = True
                self._report(waited)
                if self.action == "exit":
                    if self.ranks > 1:
                        # The stuck rank and the ones waiting for it in a collective lost their last
                        # step together, so their watchdogs fire within moments of each other; the
                        # launcher kills every rank once one exits, so wait for the others' reports.
                        time.sleep(peer_grace(self.limit))
                    os._exit(EXIT_HANG)  # the main thread is stuck: only the process can end it

    def _report(self, waited: float) -> None:
        path = self.run_dir / ("hang_report.txt" if self.rank == 0 else f"hang_report.rank{self.rank}.txt")
        who = f"rank {self.rank}: " if self.rank else ""
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"ptbr hang report: {who}no progress for {format_seconds(waited)} (limit "
                    f"{format_seconds(self.limit)}) while {self.phase}\n\n")
            f.write(f"device memory: {self._memory()}\n\nlast log lines:\n")
            f.writelines(_tail(self.run_dir / "train.log", 20))
            f.write("\nstacks of every thread (most recent call first):\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        what = (f"{who}no progress for {format_seconds(waited)} while {self.phase} (hang report in {path}); "
                "fix: read the stacks there (in a data-parallel run each rank writes its own report: the one "
                "that stopped, and the others waiting for it); raise --hang-timeout if the step is just slow")
        if self.action == "warn":
            shout(f"warning: {what}; --hang-action warn: still waiting")
        else:
            shout(f"error: {what}")

    def _memory(self) -> str:
        try:
            if self.memory_report is not None:
                return self.memory_report()
            import psutil

            return f"process RSS {psutil.Process().memory_info().rss:,} B"
        except Exception as exc:  # noqa: BLE001 - a report must not fail for want of a number
            return f"unknown ({exc})"


def peer_grace(limit: float) -> float:
    """How long a rank whose watchdog fired waits before exiting, so that the other ranks' watchdogs
    write their reports too."""
    return max(5.0, min(60.0, limit / 4))


def format_seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return list(deque(f, maxlen=lines))
    except OSError:
        return ["(no train.log)\n"]
