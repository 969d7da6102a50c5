"""--auto-fit: find the micro-batch that really fits, by running real steps on the longest batch.

On an out-of-memory the micro-batch is halved and grad_accum doubled, so the effective batch (and
with it the learning-rate schedule and the data each step sees) stays the same. Each try builds a
fresh model and optimizer and throws them away: nothing from the dry run reaches the real run,
which starts from the same seeded initialisation as it would without --auto-fit (fine-tuning
keeps its base loaded and resets only the adapter). An out-of-memory later in the run is handled
the same way, resuming from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptbr.errors import DeviceError
from ptbr.log import log
from ptbr.train.checkpoint import latest_checkpoint

# Two steps: the first allocates AdamW's state, the second runs forward and backward with it
# alive, which is the steady-state peak of every later step.
DRY_RUN_STEPS = 2
# Micro-batches per dry-run step where the try accumulates: from the second on, the gradients of
# the earlier ones are alive during the forward and backward pass (pretraining: 4 bytes a parameter
# more at the peak; LoRA: the adapters'); a third adds nothing to that.
DRY_RUN_MICRO_BATCHES = 2


@dataclass
class FitChoice:
    batch_size: int
    grad_accum: int
    tried: list[dict] = field(default_factory=list)  # every try: batch_size, grad_accum, result

    def describe(self) -> str:
        steps = "; ".join(f"{t['batch_size']} x {t['grad_accum']}: {t['result']}" for t in self.tried)
        return f"auto-fit chose batch_size {self.batch_size} x grad_accum {self.grad_accum} ({steps})"


def halve(batch_size: int, grad_accum: int) -> tuple[int, int] | None:
    """The next smaller micro-batch with the same effective batch: half, or the largest divisor of
    the effective batch below half when half does not divide it. None at micro-batch 1."""
    effective = batch_size * grad_accum
    smaller = next((d for d in range(batch_size // 2, 0, -1) if effective % d == 0), None)
    return None if smaller is None else (smaller, effective // smaller)


def auto_fit(backend, make_step: Callable[[int], Any], longest_batch: Callable[[int], dict], batch_size: int,
             grad_accum: int, too_big: Callable[[int], str | None] | None = None) -> FitChoice:
    """The largest micro-batch from `batch_size` down that survives DRY_RUN_STEPS real steps.

    backend: recognises an out-of-memory and releases memory between tries.
    make_step(batch_size): a fresh training step (model + optimizer), thrown away after the try.
    longest_batch(batch_size): one micro-batch of the longest sequences the run will see.
    too_big(batch_size): a reason to skip a size without running it (on CPU an out-of-memory is
    the kernel killing the process, not an exception), or None.
    """
    choice = FitChoice(batch_size, grad_accum)
    while True:
        result = _try(backend, make_step, longest_batch, batch_size, min(grad_accum, DRY_RUN_MICRO_BATCHES), too_big)
        choice.tried.append({"batch_size": batch_size, "grad_accum": grad_accum, "result": result})
        if result == "fits":
            choice.batch_size, choice.grad_accum = batch_size, grad_accum
            log(choice.describe())
            return choice
        log(f"auto-fit: micro-batch {batch_size} x grad_accum {grad_accum}: {result}")
        smaller = halve(batch_size, grad_accum)
        if smaller is None:
            raise DeviceError(f"out of memory even at micro-batch 1 ({result})", "--auto-fit",
                              "turn on --gradient-checkpointing, lower --seq-len (or --max-seq-len), use a smaller "
                              "model or --quant 4bit, or run `ptbr preflight` for a config that fits")
        batch_size, grad_accum = smaller


def _try(backend, make_step, longest_batch, batch_size: int, micro_batches: int, too_big) -> str:
    reason = too_big(batch_size) if too_big else None
    if reason:
        return f"skipped, {reason}"
    step = None
    try:
        step = make_step(batch_size)
        batch = longest_batch(batch_size)
        for _ in range(DRY_RUN_STEPS):
            step.train_step([batch] * micro_batches, 0.0)
        return "fits"
    except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled; anything else re-raised
        if not backend.is_out_of_memory(exc):
            raise
        return "out of memory: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    finally:
        del step  # the exception (and its frames holding activations) is gone by now too
        backend.release_memory()


def resume_smaller_on_oom(backend, run: Callable[[Any], Any], settings, run_dir: Path):
    """run(settings); on an out-of-memory mid-run, halve batch_size (doubling grad_accum) and run
    again from the newest checkpoint this run wrote, until it finishes or micro-batch 1 fails too."""
    before = latest_checkpoint(run_dir)
    while True:
        try:
            return run(settings)
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled
            if not backend.is_out_of_memory(exc):
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        backend.release_memory()
        smaller = halve(settings.batch_size, settings.grad_accum)
        if smaller is None:
            raise DeviceError(f"out of memory during the run at micro-batch 1 ({reason})", "--auto-fit",
                              "turn on --gradient-checkpointing or lower --seq-len; a resume continues from the last "
                              "checkpoint where one was written")
        newest = latest_checkpoint(run_dir)
        # only a checkpoint this run wrote: with --resume never, older ones stay ignored
        resume = str(newest) if newest is not None and newest != before else settings.resume
        log(f"out of memory during the run ({reason}): again from --resume {resume} with batch_size "
            f"{smaller[0]} x grad_accum {smaller[1]} (was {settings.batch_size} x {settings.grad_accum})")
        settings = dataclasses.replace(settings, batch_size=smaller[0], grad_accum=smaller[1], resume=resume)


def ram_guard(needed_bytes: Callable[[int], int]) -> Callable[[int], str | None]:
    """too_big for auto_fit on CPU, where running out of memory means the kernel kills the process:
    a size the memory model says does not fit in the share of the available RAM that preflight
    plans with (USABLE_FRACTION) is skipped without running."""
    from ptbr.memory import GIB, USABLE_FRACTION
    from ptbr.ram import ram

    def too_big(batch_size: int) -> str | None:
        needed = needed_bytes(batch_size)
        memory = ram()
        usable = USABLE_FRACTION["cpu"] * memory.available
        if needed > usable:
            return (f"the memory model predicts {needed / GIB:.1f} GiB, more than the {usable / GIB:.1f} GiB planned "
                    f"for ({USABLE_FRACTION['cpu']:.0%} of the {memory.available / GIB:.1f} GiB of "
                    f"{memory.where()} available)")
        return None

    return too_big
