"""metrics.jsonl and metrics.csv in the run directory: one row per optimizer step."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from ptbr.files import append_lines, write_text

COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_bytes", "elapsed_s")


class MetricsLog:
    """Appends rows; on resume it first drops rows past the checkpoint so no step appears twice."""

    def __init__(self, run_dir: Path, resume_step: int = 0):
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"
        kept = [row for row in read_metrics(self.jsonl) if row["step"] <= resume_step] if resume_step else []
        write_text(self.jsonl, "".join(json.dumps(row) + "\n" for row in kept), "metrics.jsonl")
        write_text(self.csv, _csv_lines([COLUMNS] + [_csv_row(row) for row in kept]), "metrics.csv")
        self.last: dict | None = kept[-1] if kept else None

    def write(self, row: dict) -> None:
        row = {name: _clean(row.get(name)) for name in COLUMNS}
        append_lines(self.jsonl, [json.dumps(row) + "\n"], "metrics.jsonl")
        append_lines(self.csv, [_csv_lines([_csv_row(row)])], "metrics.csv")
        self.last = row


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by a crash ends the readable part
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            break
        rows.append(row)
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
