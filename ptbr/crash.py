"""crash_report.txt: what an unexpected exception leaves in the run directory."""

from __future__ import annotations

import traceback
from datetime import datetime, timezone
from pathlib import Path

from ptbr.versions import package_versions


def write_crash_report(args, exc: BaseException) -> Path | None:
    """Traceback, command line settings, versions and the last metrics; None if there is no run dir."""
    output = getattr(args, "output", None)
    if not output or not Path(output).is_dir():
        return None
    path = Path(output) / "crash_report.txt"
    try:
        from ptbr.train.metrics import read_metrics

        last = read_metrics(Path(output) / "metrics.jsonl")[-3:]
        lines = [
            f"ptbr crash report, {datetime.now(timezone.utc).isoformat()}",
            "",
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            f"arguments: {vars(args)}",
            f"versions: {package_versions()}",
            f"last metrics: {last}",
        ]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path
    except OSError:
        return None
