"""fit(): the one training loop for pretraining and fine-tuning, on any backend.

The loop owns everything but the step: the schedule, which batches make each optimizer step,
evaluation, metrics, checkpoints, progress, and graceful stops. A backend's training step (torch's
TorchStep, MLX's MlxStep) only turns a list of micro-batches and a learning rate into an update.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ptbr.backends.world import SingleProcess, World
from ptbr.data.batch import IGNORE_INDEX, Batch, StepResult
from ptbr.errors import Interrupted, TrainingDiverged
from ptbr.log import log
from ptbr.train.checkpoint import save_checkpoint
from ptbr.train.metrics import MetricsLog
from ptbr.train.progress import Progress
from ptbr.train.schedule import Schedule

# Non-finite steps in a row before the run is stopped (each one is skipped, not applied).
MAX_BAD_STEPS_IN_A_ROW = 5


@dataclass
class LoopState:
    """Where a run stands; saved in every checkpoint's trainer_state.json."""

    step: int = 0  # optimizer steps completed; also the batch source's position
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # wall-clock seconds of the loop up to the last step's metrics row
    best_val_loss: float | None = None
    best_step: int | None = None
    skipped_steps: int = 0
    bad_in_a_row: int = 0

    @classmethod
    def from_dict(cls, data: dict) -> LoopState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})



class BatchSource(Protocol):
    def cycle(self, step: int) -> list[Batch]:
        """The micro-batches of optimizer step `step` (a pure function of the step)."""

    def describe(self, step: int) -> str:
        """Where step `step`'s data comes from (file, offsets or lines), for diagnostics."""


class TrainingStep(Protocol):
    """What the loop drives (a backend's step: torch's TorchStep, MLX's MlxStep)."""

    precision: str  # fp32 | fp16 | bf16, for diagnostics

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult: ...

    def eval_loss(self, batches: list[Batch]) -> float: ...

    def save_state(self, directory: Path) -> None: ...

    def load_state(self, directory: Path) -> None: ...

    def memory_bytes(self) -> int: ...


class Callbacks:
    """Two extension points; fine-tuning uses on_eval to keep the best adapter."""

    def on_eval(self, state: LoopState, val_loss: float, is_best: bool) -> None: ...

    def on_checkpoint(self, state: LoopState, path: Path) -> None: ...


class GracefulStop:
    """SIGTERM/SIGINT set a flag that the loop reads at the step boundary; a second Ctrl-C
    interrupts at once.

    The signal named in the stop is the first one: a launcher that passes one on must not rename
    it. A worker of torch's launcher (torchrun, accelerate, --num-processes) runs in a session of
    its own, so a Ctrl-C in the terminal reaches it only through the launcher, which passes the
    first signal on as it came and the second, whatever it was, as SIGTERM: there a SIGTERM after
    a SIGINT is that second Ctrl-C, and stops at once too. A process in its launcher's (or the
    terminal's) session gets the terminal's Ctrl-C itself, and a launcher's SIGTERM a moment
    later may be that same Ctrl-C passed on: there only a second SIGINT stops at once."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            log(f"{name} received: saving a checkpoint at the end of this step, then stopping")
            signal.signal(signal.SIGINT, signal.default_int_handler)
        elif self.signal_name == "SIGINT" and _in_a_session_of_its_own():
            raise KeyboardInterrupt(name)  # the second Ctrl-C, passed on by a launcher
        else:
            log(f"{name} received: already stopping at the end of this step")

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _in_a_session_of_its_own() -> bool:
    """True in a worker of torch's elastic launcher (torchrun, accelerate, `--num-processes`: it sets
    TORCHELASTIC_RUN_ID) that leads a session (the launcher starts every worker with setsid): no
    terminal signal reaches it but through its launcher. Not any session leader: `ptbr train` as a
    container's PID 1, a systemd service or a Slurm task may get a SIGINT (Slurm's --signal=INT@60:
    save before the time limit) then a SIGTERM that must not cut the checkpoint short."""
    try:
        return "TORCHELASTIC_RUN_ID" in os.environ and os.getsid(0) == os.getpid()
    except (AttributeError, OSError):  # no sessions (Windows)
        return False


def describe_batch(batch: Batch) -> str:
    ids = np.asarray(batch["input_ids"])
    labels = np.asarray(batch["labels"])
    return (f"first batch: input_ids {tuple(ids.shape)} {ids.dtype}, ids {int(ids.min())}..{int(ids.max())}, "
            f"{int((labels != IGNORE_INDEX).sum())} target tokens")


def fit(backend: TrainingStep, source: BatchSource, eval_batches: list[Batch] | None, settings, run_dir: Path,
        state: LoopState, schedule: Schedule | None = None, record: dict | None = None,
        callbacks: Callbacks | None = None, watchdog=None, world: World | None = None) -> LoopState:
    """Train until settings.max_steps, with the learning rate of `schedule` (default: the one the
    settings describe); returns the final state. Every checkpoint also records `record` (the run's
    identity, compared on resume). Raises Interrupted after a graceful stop and TrainingDiverged
    after MAX_BAD_STEPS_IN_A_ROW non-finite steps. A watchdog, if given, is told of every step,
    evaluation and checkpoint.

    In a data-parallel run (`world` of several ranks) every rank runs this loop in step: the
    decisions come out the same on each (the step's loss and gradient norm are the global ones,
    evaluation and saving follow the step number, and a stop signal seen by any rank stops all of
    them at the same step boundary); only the main rank writes metrics, checkpoints and progress,
    and calls the callbacks."""
    callbacks = callbacks or Callbacks()
    schedule = schedule or Schedule.from_settings(settings)
    record = record or {}
    world = world or SingleProcess()
    beat = watchdog.beat if watchdog is not None else (lambda phase: None)
    metrics = MetricsLog(run_dir, state.step, settings.tensorboard) if world.is_main else None
    progress = Progress(settings.max_steps, state.step, settings.log_every, enabled=world.is_main)
    start_step = state.step
    started = time.monotonic()
    # elapsed_s runs on the wall clock from one step's metrics row to the next: the step, evaluation
    # and everything the loop does around them (the previous row's writing and checkpoint included)
    clock = started
    try:
        with GracefulStop() as stop:
            while state.step < settings.max_steps:
                step_started = time.monotonic()
                lr = schedule.lr(state.step)
                micro_batches = source.cycle(state.step)
                if state.step == start_step:
                    log(describe_batch(micro_batches[0]) + f"; {len(micro_batches)} micro-batch(es) per step")
                result = backend.train_step(micro_batches, lr)
                step_time = time.monotonic() - step_started
                state.step += 1
                state.tokens_seen += result.input_tokens
                beat(f"training after step {state.step}")
                if state.step == start_step + 1:
                    log(f"first step done: loss {result.loss:.4f} in {time.monotonic() - started:.1f} s")
                    if watchdog is not None:
                        watchdog.first_step_done(time.monotonic() - started)
                _check_finite(result, state, lr, backend.precision, source)

                val_loss = None
                if eval_batches and (_due(state.step, settings.eval_every) or state.step == settings.max_steps):
                    beat(f"evaluating at step {state.step}")
                    val_loss = backend.eval_loss(eval_batches)
                    is_best = math.isfinite(val_loss) and (state.best_val_loss is None or val_loss < state.best_val_loss)
                    if is_best:
                        state.best_val_loss, state.best_step = val_loss, state.step
                    log(f"eval at step {state.step}: val_loss {val_loss:.4f}, perplexity {_perplexity(val_loss):.2f}")
                    if world.is_main:
                        callbacks.on_eval(state, val_loss, is_best)

                now = time.monotonic()
                state.elapsed_s, clock = state.elapsed_s + (now - clock), now
                tokens_per_s = result.input_tokens / step_time if step_time > 0 else 0.0
                if metrics is not None:
                    metrics.write({
                        "step": state.step, "loss": result.loss, "val_loss": val_loss, "lr": lr,
                        "grad_norm": result.grad_norm, "tokens_per_s": round(tokens_per_s, 1),
                        "mem_bytes": backend.memory_bytes(), "elapsed_s": round(state.elapsed_s, 6),
                    })
                progress.update(state.step, result.loss, lr, tokens_per_s, val_loss)
                beat(f"training after step {state.step}")

                stopping = world.any(stop.signal_name is not None) if world.size > 1 else bool(stop.signal_name)
                last = state.step == settings.max_steps
                if _due(state.step, settings.save_every) or last or stopping:
                    beat(f"saving the checkpoint of step {state.step}")
                    saving = f"saving the checkpoint of step {state.step}"
                    path = save_checkpoint(run_dir, state.step, backend,
                                           record | _trainer_state(state, settings, schedule, lr), settings.keep_last,
                                           write=world.is_main, progress=lambda what, saving=saving: beat(f"{saving}: {what}"))
                    if world.is_main:
                        callbacks.on_checkpoint(state, path)
                    if not stopping and not last:  # a signal during the save: this checkpoint is the stop's
                        stopping = world.any(stop.signal_name is not None) if world.size > 1 else bool(stop.signal_name)
                    if stopping:
                        # every rank waits for the checkpoint to be written: when one rank exits, the
                        # launcher stops the others, and a rank still writing would be stopped with it
                        world.barrier()
                        raise Interrupted(f"stopped by {stop.signal_name or 'a stop signal to another rank'} at step "
                                          f"{state.step}", f"checkpoint {path}", "run the same command again to resume")
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    return state


OPTIMIZER_SETTINGS = ("weight_decay", "beta1", "beta2")


def _trainer_state(state: LoopState, settings, schedule: Schedule, lr: float) -> dict:
    """What a checkpoint records besides the backend's states. The schedule and the batch source
    are pure functions of the step, so the step and the schedule's shape are their whole state."""
    return {
        "loop": dataclasses.asdict(state),
        "scheduler": {"kind": "linear warmup, cosine decay", "step": state.step, "last_lr": lr,
                      **schedule.as_dict(), "max_steps": settings.max_steps},
        "sampler": {"position": state.step, "seed": settings.seed, "batch_size": settings.batch_size,
                    "grad_accum": settings.grad_accum},
        # AdamW's settings: torch's optimizer state brings its own back on resume, MLX's does not
        "optimizer": {name: getattr(settings, name) for name in OPTIMIZER_SETTINGS},
    }


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")


def _check_finite(result: StepResult, state: LoopState, lr: float, precision: str, source: BatchSource) -> None:
    if not result.skipped:
        state.bad_in_a_row = 0
        return
    state.skipped_steps += 1
    state.bad_in_a_row += 1
    log(f"warning: step {state.step} skipped: loss {result.loss:.4g}, grad_norm {result.grad_norm:.4g} "
        f"({state.bad_in_a_row} in a row)")
    if state.bad_in_a_row >= MAX_BAD_STEPS_IN_A_ROW:
        location = source.describe(state.step - 1)
        fp16 = ", or with --precision bf16 (or fp32): fp16 overflows where they do not" if precision == "fp16" else ""
        if state.bad_in_a_row >= state.step:  # every step since the first: no update was ever applied
            fix = ("no update was ever applied, so the learning rate is not the cause: check the weights the run "
                   "starts from (a NaN or infinity in the base model's files; `ptbr generate --model BASE` says "
                   "whether its output is finite)" + fp16)
        else:
            fix = ("start over (--resume never, or another --output) with a lower --learning-rate" + fp16
                   + " (a resume keeps the run's learning rate)")
        raise TrainingDiverged(
            f"loss or gradients not finite for {state.bad_in_a_row} steps in a row (last: step {state.step}, "
            f"lr {lr:.3e}, precision {precision}, batch {location})", "training", fix)
