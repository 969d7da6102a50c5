"""ptbr's log: one line per event on stderr (bar-safe) and, during a run, in OUTPUT/train.log."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

logger = logging.getLogger("ptbr")


class _ConsoleHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)  # keeps a progress bar intact
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


def setup_console(level: int = logging.INFO) -> None:
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        handler = _ConsoleHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class _RunLogHandler(logging.FileHandler):
    """train.log. A full disk must not take the run down through its log (the write that matters,
    a checkpoint, reports it): a failed write is noted once on the console, not as a traceback."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not self.failed:
            self.failed = True
            print(f"warning: cannot write {self.baseFilename} (disk full?); the log goes on here only",
                  file=sys.stderr, flush=True)


def attach_run_log(run_dir: Path) -> logging.Handler:
    """Also write the log to run_dir/train.log (appending across sessions)."""
    handler = _RunLogHandler(run_dir / "train.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return handler


def to_file_only(handler: logging.Handler, message: str) -> None:
    """A line for train.log alone: the error that ends a run, which the CLI prints to the console."""
    handler.handle(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, None, None))


def detach(handler: logging.Handler) -> None:
    logger.removeHandler(handler)
    handler.close()


def log(message: str) -> None:
    if not logger.handlers:
        setup_console()
    logger.info(message)


def shout(message: str) -> None:
    """A line every process prints, even the quiet ranks of a data-parallel run (warnings, errors)."""
    if not logger.handlers:
        setup_console()
    logger.warning(message)
