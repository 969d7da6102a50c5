"""`ptbr report OUTPUT [RUN2 ...] [--output DIR]`: plots and report.md of one run, or several overlaid."""

from __future__ import annotations

from ptbr.report import write_report


def main(args) -> int:
    path = write_report(args.runs, args.output)
    print(f"report: {path}")
    print(f"plots:  {path.parent / 'plots'}")
    return 0
