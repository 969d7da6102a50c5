"""The run directory: creating it, finding where to resume from, run_config.json, the summary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ptbr.errors import ConfigError, OutputError
from ptbr.log import attach_run_log, detach, log
from ptbr.train.atomic import remove_leftovers
from ptbr.train.checkpoint import latest_checkpoint, read_state
from ptbr.train.lock import RunLock


def create_run_dir(output: str) -> Path:
    run_dir = Path(output)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot create or write the output directory: {exc.strerror or exc}", str(run_dir),
                          "choose a path you can write to with --output") from exc
    return run_dir


@contextmanager
def open_run(output: str) -> Iterator[Path]:
    """The run directory, created, locked against a second run, and logged to train.log while
    the `with` block runs."""
    run_dir = create_run_dir(output)
    with RunLock(run_dir):
        handler = attach_run_log(run_dir)
        try:
            yield run_dir
        finally:
            detach(handler)


def resume_point(run_dir: Path, resume: str) -> tuple[Path | None, dict | None]:
    """(checkpoint, its trainer state) to continue from, per --resume auto|never|PATH."""
    remove_leftovers(run_dir)  # saves cut short by a crash (the caller holds the run lock)
    remove_leftovers(run_dir / "checkpoints")
    if resume == "never":
        return None, None
    if resume == "auto":
        path = latest_checkpoint(run_dir)
        if path is None:
            return None, None
    else:
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"checkpoint not found: {path}", "--resume", "give a checkpoints/step_NNNNNN directory, auto or never")
    state = read_state(path)
    if state is None:
        raise ConfigError(f"checkpoint is incomplete or corrupt: {path}", "--resume", "use --resume auto to pick the newest complete one")
    log(f"resuming from {path} (step {state['step']})")
    return path, state


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
