"""Progress display from the loop's own numbers: a bar on a terminal, plain lines elsewhere.

The display only formats numbers the loop already has; it never syncs a device or takes a lock
the step needs (the old tools blamed a progress bar for a hang that an unevaluated lazy graph caused).
"""

from __future__ import annotations

import os
import sys
import time

from ptbr.log import log


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


UNSIZED_COLUMNS, UNSIZED_ROWS = 100, 24


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class Progress:
    def __init__(self, total_steps: int, start_step: int, log_every: int, tty: bool | None = None,
                 enabled: bool = True):
        """enabled=False: shows nothing (the other ranks of a data-parallel run)."""
        self.total, self.start_step, self.log_every = total_steps, start_step, log_every
        self.enabled = enabled
        self.stream = sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.started = time.monotonic()
        self.bar = None
        if self.tty and enabled:
            from tqdm import tqdm

            # a terminal that reports no size (a pty nobody sized: `script`, some CI and container
            # consoles) gets no bar at all from tqdm (zero columns, zero rows): a fixed size there
            sized = _columns(self.stream) > 0
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=self.stream,
                            dynamic_ncols=sized, ncols=None if sized else UNSIZED_COLUMNS,
                            nrows=None if sized else UNSIZED_ROWS, mininterval=0.5)

    def eta(self, step: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return (time.monotonic() - self.started) / done * (self.total - step)

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, val_loss: float | None = None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s", refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if step % self.log_every == 0 or step == self.total or val_loss is not None:
            eta = self.eta(step)
            line = (f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"
                    f" | eta {format_eta(eta) if eta == eta else '?'}")
            if val_loss is not None:
                line += f" | val_loss {val_loss:.4f}"
            log(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
