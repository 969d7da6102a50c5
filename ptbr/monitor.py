"""Where a run stands, read from its directory by another process: `ptbr monitor` shows it and
`ptbr report` summarises it. Nothing here writes to the run directory or takes its lock.

A run directory says everything that is needed: run_config.json (settings, predicted peak memory),
metrics.jsonl (one row per step), train.log, checkpoints/, training_summary.json once it finished,
and OUTPUT/.ptbr.lock, which names the process (pid= and host=) while the run lives and is emptied
when it exits cleanly. The lock file is read as a plain file: its flock is never taken.
"""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ptbr.errors import ConfigError
from ptbr.files import written_aside
from ptbr.lock import LOCK_FILE
from ptbr.train.checkpoint import checkpoints_dir, complete_checkpoints, read_state
from ptbr.train.loop import MAX_BAD_STEPS_IN_A_ROW
from ptbr.train.metrics import read_metrics
from ptbr.train.progress import format_eta

# A run is called stalled when nothing of it (a metrics row, a log line, a checkpoint file being
# written) has changed for longer than the largest of: STALL_FACTOR x its median step time,
# STALL_LONGEST_FACTOR x its longest step so far (an evaluation step is longer than the others, and
# a resumed session's first step includes the start-up), and STALL_FLOOR_S.
STALL_FACTOR = 5.0
STALL_LONGEST_FACTOR = 2.0
STALL_FLOOR_S = 60.0
# The loss trend: an exponential moving average (TensorBoard's smoothing 0.9, debiased), compared
# with its value TREND_WINDOW steps earlier.
EMA_WEIGHT = 0.9
TREND_WINDOW = 50
# What the loop writes to train.log when it stops a diverging run (ptbr.train.loop._check_finite).
DIVERGED_TEXT = "loss or gradients not finite for"
# What a run leaves when it hangs (one per rank in a data-parallel run) or crashes.
REPORTS = ("hang_report*.txt", "crash_report.txt")
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (.*)$")
_RESUMED = re.compile(r"^resuming from (.+) \(step (\d+)\)$")
# Lines that begin a new run in a directory that held another (train.log keeps every session).
_STARTED_OVER = ("starting over", "previous run was moved to")


@dataclass
class Owner:
    """The process the lock file names, read without taking the lock."""

    pid: int
    host: str
    since: float  # when it took the lock (the lock file's modification time)

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool | None:
        """Whether the process still runs; None when it runs on another host (or in a container
        with its own hostname), where this machine cannot see it."""
        if not self.here:
            return None
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            # a PID reused by a process that started after the lock was taken is not the run
            return process.create_time() <= self.since + 1.0
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # exists, owned by another user


@dataclass
class LogLine:
    time: str  # "YYYY-MM-DD HH:MM:SS" as train.log wrote it
    message: str


@dataclass
class Checkpoint:
    step: int
    path: Path
    written: float  # modification time of its trainer_state.json


@dataclass
class Run:
    """Everything a run directory holds that monitor and report read, taken at one moment."""

    run_dir: Path
    config: dict  # run_config.json ({} before the run writes it, at the end of model building)
    summary: dict | None  # training_summary.json, once a session finished
    rows: list[dict]  # metrics.jsonl
    log: list[LogLine]  # train.log since the run last started over
    owner: Owner | None  # None: the lock file is missing or empty (no run holds it)
    checkpoint: Checkpoint | None  # the newest complete one
    saving: str | None  # a checkpoint or final directory being written right now
    last_activity: float | None  # newest modification time of metrics, log and a checkpoint being written
    metrics_written: float | None  # modification time of metrics.jsonl
    summary_written: float | None  # modification time of training_summary.json
    reports: dict[str, float] = field(default_factory=dict)  # hang/crash report -> modification time
    problems: list[str] = field(default_factory=list)  # files that exist but cannot be read

    @property
    def settings(self) -> dict:
        settings = self.config.get("settings")
        return settings if isinstance(settings, dict) else {}

    @property
    def total_steps(self) -> int | None:
        value = self.settings.get("max_steps")
        return value if isinstance(value, int) else None

    @property
    def step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    @property
    def predicted_peak(self) -> int | None:
        value = self.config.get("predicted_peak_bytes")
        return value if isinstance(value, int) else None

    @property
    def summary_is_current(self) -> bool:
        """training_summary.json describes the rows there now (a resumed session that has not
        finished yet leaves the previous session's summary in place)."""
        if self.summary is None or self.summary.get("steps") != self.step:
            return False
        return self.owner is None or (self.summary_written or 0) >= self.owner.since

    def resumes(self) -> list[tuple[str, int, str]]:
        """(time, step, checkpoint) of every session that continued from a checkpoint."""
        found = [(line.time, int(m.group(2)), m.group(1)) for line in self.log
                 if (m := _RESUMED.match(line.message))]
        if not found and self.config.get("resumed_from"):
            found = [("", -1, str(self.config["resumed_from"]))]
        return found

    def skipped_steps(self) -> list[int]:
        """Steps whose loss or gradients were not finite (written with a null loss)."""
        return [row["step"] for row in self.rows if row.get("loss") is None]


def read_run(run_dir: str | Path) -> Run:
    """Read a run directory (never writing to it). Raises ConfigError when it holds no run."""
    run_dir = Path(run_dir).expanduser()
    markers = ("run_config.json", "metrics.jsonl", "train.log", LOCK_FILE)
    if not run_dir.is_dir() or not any((run_dir / name).exists() for name in markers):
        what = ("no such directory" if not run_dir.exists() else "a file, not a run directory" if not run_dir.is_dir()
                else "not a ptbr run directory (no train.log, metrics.jsonl or run_config.json)")
        raise ConfigError(what, str(run_dir), "give the --output directory of a `ptbr train` or `ptbr finetune` run "
                          "(by default runs/ptbr and runs/finetune; a run makes it within seconds of starting)")
    problems: list[str] = []
    config = _read_json(run_dir / "run_config.json", problems) or {}
    summary = _read_json(run_dir / "training_summary.json", problems)
    saving, saving_time = _in_progress(run_dir)
    metrics_written = _mtime(run_dir / "metrics.jsonl")
    times = [t for t in (metrics_written, _mtime(run_dir / "train.log"), saving_time) if t]
    reports = {path.name: t for pattern in REPORTS for path in sorted(run_dir.glob(pattern)) if (t := _mtime(path))}
    unreadable: list[int] = []
    rows = read_metrics(run_dir / "metrics.jsonl", unreadable)
    if unreadable:
        problems.append(f"metrics.jsonl: line {', '.join(map(str, unreadable[:5]))} "
                        f"{'is' if len(unreadable) == 1 else 'are'} not a metrics row (left out)")
    return Run(run_dir, config if isinstance(config, dict) else {}, summary if isinstance(summary, dict) else None,
               rows, _read_log(run_dir / "train.log"), _read_owner(run_dir),
               _newest_checkpoint(run_dir), saving, max(times) if times else None, metrics_written,
               _mtime(run_dir / "training_summary.json"), reports, problems)


def _read_json(path: Path, problems: list[str]):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"{path.name} cannot be read ({exc.__class__.__name__})")
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _read_owner(run_dir: Path) -> Owner | None:
    path = run_dir / LOCK_FILE
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        since = path.stat().st_mtime
    except OSError:
        return None
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if not fields.get("pid", "").isdigit():
        return None  # emptied by a clean exit
    return Owner(int(fields["pid"]), fields.get("host", "?"), since)


def _read_log(path: Path) -> list[LogLine]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    lines = []
    for raw in text.splitlines():
        match = _LOG_LINE.match(raw)
        if match is None:
            continue
        line = LogLine(raw[:19], match.group(1))
        if any(marker in line.message for marker in _STARTED_OVER):
            lines = []  # what came before belongs to a run whose files were moved to previous/
        lines.append(line)
    return lines


def _newest_checkpoint(run_dir: Path) -> Checkpoint | None:
    complete = complete_checkpoints(run_dir, quiet=True)  # by step number, complete ones only
    state = read_state(complete[-1]) if complete else None
    if state is None:  # none, or it changed since it was looked at
        return None
    return Checkpoint(state["step"], complete[-1], _mtime(complete[-1] / "trainer_state.json") or 0.0)


def _in_progress(run_dir: Path) -> tuple[str | None, float | None]:
    """A checkpoint (or final/, adapters/) being written: ptbr.files writes it beside its place
    first. Returns what it is and the newest modification time inside it."""
    newest, what = None, None
    for folder in (checkpoints_dir(run_dir), run_dir):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            name = written_aside(path.name)
            if name is None or not path.is_dir():
                continue
            times = [t for t in [_mtime(path)] + [_mtime(p) for p in path.iterdir()] if t]
            if times and (newest is None or max(times) > newest):
                newest, what = max(times), name
    return what, newest


# --------------------------------------------------------------------------------------------
# Numbers from the metrics
# --------------------------------------------------------------------------------------------


def step_times(rows: list[dict]) -> list[float]:
    """Seconds per step, from the elapsed_s of consecutive rows (the wall clock between them:
    evaluation and checkpoints included)."""
    times = []
    for before, after in zip(rows, rows[1:], strict=False):
        a, b = before.get("elapsed_s"), after.get("elapsed_s")
        if after["step"] == before["step"] + 1 and isinstance(a, (int, float)) and isinstance(b, (int, float)) \
                and b >= a:
            times.append(b - a)
    return times


def stall_threshold(rows: list[dict]) -> float:
    """Seconds without any sign of life after which a live run is called stalled (see STALL_FACTOR)."""
    times = step_times(rows)
    if not times:
        return STALL_FLOOR_S
    return max(STALL_FACTOR * statistics.median(times), STALL_LONGEST_FACTOR * max(times), STALL_FLOOR_S)


def smoothed(values: list[float], weight: float = EMA_WEIGHT) -> list[float]:
    """Exponential moving average, debiased so that the first values are not pulled towards 0."""
    out, average = [], 0.0
    for count, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**count))
    return out


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def seconds_per_step(rows: list[dict], last: int = 50) -> float | None:
    """Mean over the last `last` steps (evaluations included, as they will be in the rest of the run)."""
    times = step_times(rows[-(last + 1):])
    return sum(times) / len(times) if times else None


def peak_memory(rows: list[dict]) -> tuple[int, int] | None:
    """The run's measured peak memory and the first step whose row shows it, or None.

    Each row's mem_bytes is the peak its process has reached so far, not the memory in use when
    the row was written (torch: the allocator's peak on a GPU, the process's peak resident set on
    the CPU; MLX: its allocator's peak since the training step was built), so the largest is the
    run's peak: a resumed run's sessions each start from their own process's."""
    memory = [(r["step"], r["mem_bytes"]) for r in rows if isinstance(r.get("mem_bytes"), int)]
    if not memory:
        return None
    top = max(m for _, m in memory)
    return next(step for step, m in memory if m == top), top


def format_bytes(value: float) -> str:
    if value >= 1024**3:
        return f"{value / 1024**3:.2f} GiB"
    return f"{value / 1024**2:.1f} MiB"


def share_of(measured: float, predicted: float, scale: float = 100, decimals: int = 0) -> str:
    """scale x measured / predicted, with `decimals` decimals, or up to 3 more where fewer would
    round an overrun down to the prediction: 100.4(%), never a 100 that hides it."""
    share = scale * measured / predicted
    more = 0
    while measured > predicted and float(f"{share:.{decimals + more}f}") <= scale and more < 3:
        more += 1
    return f"{share:.{decimals + more}f}"


def format_time(timestamp: float) -> str:
    """A moment in UTC, for what is read later (report.md): 2026-11-28 00:19:02 UTC."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))


def _when(timestamp: float, now: float, absolute: bool) -> str:
    """`12 s ago` on the screen; `at 2026-11-28 00:19:02 UTC` where `absolute` (a file read later)."""
    return f"at {format_time(timestamp)}" if absolute else f"{format_age(now - timestamp)} ago"


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


# --------------------------------------------------------------------------------------------
# The run's state
# --------------------------------------------------------------------------------------------

ENDED = ("finished", "stopped", "diverged", "dead")  # a monitor that refreshes stops at these


@dataclass
class Status:
    state: str  # starting | running | stalled | finished | stopped | diverged | dead | unknown
    headline: str
    warnings: list[str] = field(default_factory=list)


def assess(run: Run, now: float | None = None, stall_after: float | None = None, absolute: bool = False) -> Status:
    """The run's state from its lock, log, metrics and summary; `stall_after` overrides the
    stall threshold (seconds). The headline gives moments as ages (`written 12 s ago`), or as
    times in UTC where `absolute` (report.md, read later: an age there goes stale)."""
    now = time.time() if now is None else now
    owner = run.owner
    alive = owner.alive() if owner else None
    warnings = list(run.problems)
    last_error = _last_error(run)
    threshold = stall_after if stall_after is not None else stall_threshold(run.rows)
    quiet_for = now - run.last_activity if run.last_activity is not None else None

    if run.summary_is_current:
        status = Status("finished", f"finished: {run.step} steps (training_summary.json)")
        if owner is not None and alive:
            status.headline += f"; its process (PID {owner.pid}) is still writing the results"
    elif owner is not None and alive:
        status = _live(run, owner, now, threshold, absolute)
    elif owner is not None and alive is None:
        status = Status("unknown", f"unknown: cannot be checked from this machine, the lock names PID {owner.pid} on "
                                   f"{owner.host} (a run elsewhere, or a directory copied from a container or Kaggle)")
        if quiet_for is not None and quiet_for > threshold:
            status.warnings.append(f"no new metrics for {format_age(quiet_for)}, at step {run.step}: if the run still "
                                   f"lives on {owner.host}, it looks stalled; if not, it ended without a final summary")
    elif owner is not None:
        status = Status("dead", f"dead: the run's process (PID {owner.pid} on {owner.host}) is gone without a "
                                f"final summary; "
                                f"last step {run.step}" + (f" of {run.total_steps}" if run.total_steps else "")
                        + (f", written {_when(run.metrics_written, now, absolute)}" if run.metrics_written else ""))
        if last_error is not None:  # the hang watchdog's line, or an error that a killed run logged
            status.warnings.append(f"train.log ends with: {last_error.message}")
        status.warnings.append(_resume_hint(run))
    elif last_error is not None:
        state = "diverged" if DIVERGED_TEXT in last_error.message else "stopped"
        status = Status(state, f"{state} at {last_error.time}: {last_error.message}")
        if state == "stopped":
            status.warnings.append(_resume_hint(run))
    else:
        status = Status("unknown", "unknown: no process holds the lock and there is no final summary: the run ended "
                                   "without one, or runs elsewhere (this directory has no lock owner to tell)")

    skipped = _skipped_in_a_row(run.rows)
    if skipped and status.state != "diverged":
        status.warnings.append(f"diverging? the last {skipped} step(s) were skipped: loss or gradients not finite "
                               f"(the run stops after {MAX_BAD_STEPS_IN_A_ROW} in a row)")
    if status.state == "diverged" and "no update was ever applied" not in last_error.message:
        status.warnings.append("start over (--resume never) with a lower --learning-rate, or with --precision bf16 "
                               "(or fp32) if it ran in fp16: a resume keeps the run's learning rate")
    status.warnings += _report_notes(run, owner)
    status.warnings = warnings + status.warnings
    return status


def _live(run: Run, owner: Owner, now: float, threshold: float, absolute: bool) -> Status:
    where = f"PID {owner.pid} on {owner.host}"
    if not run.rows or (run.metrics_written or 0) < owner.since:
        # building the model, loading data: the loop has not opened metrics.jsonl in this session yet
        return Status("starting", f"starting ({where}): {run.log[-1].message if run.log else 'no log line yet'}")
    doing = f"writing {run.saving}" if run.saving else "training"
    last = run.last_activity if run.last_activity is not None else now
    quiet_for = now - last
    status = Status("running", f"running ({where}), {doing}; last activity {_when(last, now, absolute)}")
    if quiet_for > threshold:
        since = f"since {format_time(last)}" if absolute else f"for {format_age(quiet_for)}"
        status = Status("stalled", f"stalled ({where}): no progress {since}, at step {run.step}")
        times = step_times(run.rows)
        typical = f"; a step usually takes {statistics.median(times):.2f} s" if times else ""
        status.warnings.append(
            f"stalled: no new metrics, log line or checkpoint file for {format_age(quiet_for)} at step {run.step} "
            f"(threshold {format_age(threshold)}{typical}): the process lives but makes no progress; the hang "
            "watchdog ends it with hang_report.txt (--hang-timeout), or stop it and resume")
    return status


def _last_error(run: Run) -> LogLine | None:
    """The error line that ended the last session, if it ended with one (it is its last line)."""
    if run.log and run.log[-1].message.startswith("error:"):
        return run.log[-1]
    return None


def _skipped_in_a_row(rows: list[dict]) -> int:
    count = 0
    for row in reversed(rows):
        if row.get("loss") is not None:
            break
        count += 1
    return count


def _resume_hint(run: Run) -> str:
    if run.checkpoint is None:
        return "no checkpoint was saved: running the same command starts the run again"
    return f"running the same command resumes from {run.checkpoint.path.name} (step {run.checkpoint.step})"


def _report_notes(run: Run, owner: Owner | None) -> list[str]:
    """The hang and crash reports, and whether the run went on after them (resumed, or --hang-action warn)."""
    notes = []
    for name, written in run.reports.items():
        path = run.run_dir / name
        later = (owner is not None and owner.since > written) or (run.metrics_written or 0) > written
        notes.append(f"{path} predates the last step: the run went on after it" if later else f"see {path}")
    return notes


# --------------------------------------------------------------------------------------------
# The screen
# --------------------------------------------------------------------------------------------


def describe(run: Run) -> str:
    """What was trained, in one line: `train: tiny, torch on cpu, fp32`."""
    settings = run.settings
    what = settings.get("model_size") or Path(str(settings.get("base") or "?")).name
    parts = [f"{run.config.get('command', '?')}: {what}"]
    if run.config.get("backend"):
        parts.append(f"{run.config['backend']} on {run.config.get('device', '?')}, {run.config.get('precision', '?')}")
    return ", ".join(parts)


def screen(run: Run, status: Status, now: float | None = None) -> list[str]:
    """The monitor's lines: plain text, for a terminal or a log window."""
    now = time.time() if now is None else now
    rows = run.rows
    lines = [f"ptbr monitor  {run.run_dir}  ({describe(run)})" if run.config else f"ptbr monitor  {run.run_dir}",
             f"status      {status.headline}"]
    total = run.total_steps
    if total:
        lines.append(f"step        {run.step} / {total} ({100 * run.step / total:.1f}%)")
    else:
        lines.append(f"step        {run.step}")
    losses = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    if losses:
        trend = smoothed([loss for _, loss in losses])
        line = f"loss        {losses[-1][1]:.4f}; smoothed {trend[-1]:.4f}"
        if len(trend) > TREND_WINDOW // 5:
            back = max(0, len(trend) - 1 - TREND_WINDOW)
            change = trend[-1] - trend[back]
            word = "flat" if abs(change) < 0.01 * abs(trend[back]) else ("falling" if change < 0 else "rising")
            line += f", {word} (was {trend[back]:.4f} at step {losses[back][0]})"
        lines.append(line)
    evals = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if evals:
        step, val = evals[-1]
        best_step, best = min(evals, key=lambda e: e[1])
        lines.append(f"val_loss    {val:.4f} at step {step}, perplexity {perplexity(val):.2f} "
                     f"(best {best:.4f} at step {best_step})")
    if rows and rows[-1].get("lr") is not None:
        lines.append(f"lr          {rows[-1]['lr']:.2e}")
    speeds = [r["tokens_per_s"] for r in rows[-20:] if r.get("tokens_per_s")]
    per_step = seconds_per_step(rows)
    if speeds:
        lines.append(f"throughput  {statistics.median(speeds):,.0f} tokens/s (median of the last {len(speeds)} steps)"
                     + (f"; {per_step:.2f} s/step with evaluations and saves" if per_step else ""))
    peak = peak_memory(rows)
    if peak is not None:
        line = f"memory      peak {format_bytes(peak[1])}, reached by step {peak[0]}"
        if run.predicted_peak:
            line += (f"; predicted peak {format_bytes(run.predicted_peak)} "
                     f"({share_of(peak[1], run.predicted_peak)}%)")
        lines.append(line)
    if run.checkpoint is not None:
        lines.append(f"checkpoint  {run.checkpoint.path.name}, written {format_age(now - run.checkpoint.written)} ago")
    else:
        lines.append("checkpoint  none yet")
    skipped = run.skipped_steps()
    if skipped:
        lines.append(f"skipped     {len(skipped)} step(s) with non-finite loss: {_steps_list(skipped)}")
    if rows and isinstance(rows[-1].get("elapsed_s"), (int, float)):
        line = f"time        {format_eta(rows[-1]['elapsed_s'])} of training"
        if total and status.state in ("running", "stalled", "starting") and per_step:
            line += f"; ETA {format_eta((total - run.step) * per_step)} ({total - run.step} steps at {per_step:.2f} s)"
        lines.append(line)
    lines += [f"warning: {w}" for w in status.warnings]
    return lines


def _steps_list(steps: list[int], shown: int = 10) -> str:
    text = ", ".join(map(str, steps[:shown]))
    return text + (f" and {len(steps) - shown} more" if len(steps) > shown else "")
