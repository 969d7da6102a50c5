"""metrics.jsonl and metrics.csv in the run directory: one row per optimizer step; with
--tensorboard, the same numbers as TensorBoard event files in OUTPUT/tensorboard."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import time
from pathlib import Path

from ptbr.errors import ConfigError
from ptbr.files import append_lines, write_text, writing
from ptbr.log import log
from ptbr.versions import install_extra

# mem_bytes: the peak memory the run's process has reached by that step (backend.memory_bytes():
# torch's allocator peak on a GPU, the process's peak resident set on the CPU, MLX's allocator peak),
# not the memory in use when the row is written; ptbr.monitor.peak_memory reads the run's peak from it
COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_bytes", "elapsed_s")
TENSORBOARD_DIR = "tensorboard"
SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_bytes")  # per step, under these tags


class MetricsLog:
    """Appends rows; on resume it first drops rows past the checkpoint so no step appears twice."""

    def __init__(self, run_dir: Path, resume_step: int = 0, tensorboard: bool = False):
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"
        unreadable: list[int] = []
        kept = [row for row in read_metrics(self.jsonl, unreadable) if row["step"] <= resume_step] if resume_step else []
        if unreadable:
            log(f"warning: {self.jsonl}: {len(unreadable)} line(s) that are not metrics rows left out on resume "
                f"(line {', '.join(map(str, unreadable[:5]))}{', ...' if len(unreadable) > 5 else ''}); "
                f"the other rows are kept")
        write_text(self.jsonl, "".join(json.dumps(row) + "\n" for row in kept), "metrics.jsonl")
        write_text(self.csv, _csv_lines([COLUMNS] + [_csv_row(row) for row in kept]), "metrics.csv")
        self.last: dict | None = kept[-1] if kept else None
        self.events = TensorBoardEvents(run_dir / TENSORBOARD_DIR, resume_step + 1) if tensorboard else None

    def write(self, row: dict) -> None:
        row = {name: _clean(row.get(name)) for name in COLUMNS}
        append_lines(self.jsonl, [json.dumps(row) + "\n"], "metrics.jsonl")
        append_lines(self.csv, [_csv_lines([_csv_row(row)])], "metrics.csv")
        if self.events is not None:
            self.events.write(row)
        self.last = row

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


def require_tensorboard() -> None:
    """--tensorboard needs the `tensorboard` extra; checked when a run starts, before any model is built."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("--tensorboard needs tensorboardX, which is not installed", "--tensorboard",
                          install_extra("tensorboard", "leave out --tensorboard (metrics.jsonl holds the same "
                                        "numbers; ptbr monitor and ptbr report read it)", ", or leave out --tensorboard"))


class TensorBoardEvents:
    """The metrics rows as TensorBoard scalars (tags: SCALARS), one event per row, in an event file
    of OUTPUT/tensorboard that `tensorboard --logdir OUTPUT/tensorboard` reads.

    Written in the loop's own thread, as metrics.jsonl is: a row is a few hundred bytes, far less
    than a step costs, and a full disk is the same OutputError (exit 6) as for every other file.
    tensorboardX's SummaryWriter would hand each value to a background thread through a bounded
    queue, where a failed write goes unseen and a full queue blocks the step. The file is flushed
    every FLUSH_S seconds, so a running TensorBoard sees the run as it goes.
    TensorBoard keeps scalars as 32-bit floats: metrics.jsonl has the exact values.
    """

    FLUSH_S = 10.0

    def __init__(self, folder: Path, first_step: int = 1):
        require_tensorboard()
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self.folder, self._event, self._summary = folder, Event, Summary
        with writing("the TensorBoard events", folder):
            folder.mkdir(parents=True, exist_ok=True)
            # several files in one folder are one run for TensorBoard: each session (a resume, a
            # retry after an out-of-memory) opens its own, named uniquely within the second
            self.writer = EventsWriter(str(folder / "events"), f".{time.time_ns()}")
            if first_step > 1:
                # a resumed run: TensorBoard drops the earlier sessions' events from first_step on,
                # as MetricsLog drops their rows past the checkpoint
                self.writer.write_event(Event(wall_time=time.time(), step=first_step,
                                              session_log=SessionLog(status=SessionLog.START)))
        self.flushed = time.monotonic()

    def write(self, row: dict) -> None:
        values = [self._summary.Value(tag=name, simple_value=float(row[name]))
                  for name in SCALARS if row.get(name) is not None]
        with writing("the TensorBoard events", self.folder):
            self.writer.write_event(self._event(wall_time=time.time(), step=row["step"],
                                                summary=self._summary(value=values)))
            if time.monotonic() - self.flushed > self.FLUSH_S:
                self.writer.flush()
                self.flushed = time.monotonic()

    def close(self) -> None:
        with writing("the TensorBoard events", self.folder):
            self.writer.close()


def read_metrics(path: Path, unreadable: list[int] | None = None) -> list[dict]:
    """The rows of a metrics.jsonl. A line that is not a row (edited, damaged) is skipped, never the
    rows after it, and its number goes into `unreadable` where one is given; so is an unfinished
    last line (cut by a crash, or being written), but silently."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        elif line.strip() and unreadable is not None and (number < len(lines) or text.endswith("\n")):
            unreadable.append(number)
    return rows


def loss_summary(run_dir: Path) -> dict:
    """First and last training and validation losses of a run, for training_summary.json."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    val_losses = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return {
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "first_val_loss": val_losses[0] if val_losses else None,
        "final_val_loss": val_losses[-1] if val_losses else None,
    }


def _clean(value):
    # JSON has no NaN; a skipped step's loss is written as null
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _csv_lines(rows: list) -> str:
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    return buffer.getvalue()


def _csv_row(row: dict) -> list:
    return ["" if row.get(name) is None else row.get(name) for name in COLUMNS]
