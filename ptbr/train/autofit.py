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
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptbr.errors import DeviceError
from ptbr.log import log

# Two steps: the first allocates AdamW's state, the second runs forward and backward with it
# alive, which is the steady-state peak of every later step.
DRY_RUN_STEPS = 2
MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory",
                "failed to allocate")


@dataclass
class FitChoice:
    batch_size: int
    grad_accum: int
    tried: list[dict] = field(default_factory=list)  # every try: batch_size, grad_accum, result

    def describe(self) -> str:
        steps = "; ".join(f"{t['batch_size']} x {t['grad_accum']}: {t['result']}" for t in self.tried)
        return f"auto-fit chose batch_size {self.batch_size} x grad_accum {self.grad_accum} ({steps})"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or an allocation failure on CPU/MPS (a RuntimeError)."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in MEMORY_WORDS)


def halve(batch_size: int, grad_accum: int) -> tuple[int, int] | None:
    """The next smaller micro-batch with the same effective batch: half, or the largest divisor of
    the effective batch below half when half does not divide it. None at micro-batch 1."""
    effective = batch_size * grad_accum
    smaller = next((d for d in range(batch_size // 2, 0, -1) if effective % d == 0), None)
    return None if smaller is None else (smaller, effective // smaller)


def release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def auto_fit(make_backend: Callable[[int], Any], longest_batch: Callable[[int], dict], batch_size: int,
             grad_accum: int, too_big: Callable[[int], str | None] | None = None) -> FitChoice:
    """The largest micro-batch from `batch_size` down that survives DRY_RUN_STEPS real steps.

    make_backend(batch_size): a fresh backend (model + optimizer), thrown away after the try.
    longest_batch(batch_size): one micro-batch of the longest sequences the run will see.
    too_big(batch_size): a reason to skip a size without running it (on CPU an out-of-memory is
    the kernel killing the process, not an exception), or None.
    """
    choice = FitChoice(batch_size, grad_accum)
    while True:
        result = _try(make_backend, longest_batch, batch_size, too_big)
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


def _try(make_backend, longest_batch, batch_size: int, too_big) -> str:
    reason = too_big(batch_size) if too_big else None
    if reason:
        return f"skipped, {reason}"
    backend = None
    try:
        backend = make_backend(batch_size)
        batch = longest_batch(batch_size)
        for _ in range(DRY_RUN_STEPS):
            backend.train_step([batch], 0.0)
        return "fits"
    except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled; anything else re-raised
        if not is_out_of_memory(exc):
            raise
        return "out of memory: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    finally:
        del backend  # the exception (and its frames holding activations) is gone by now too
        release_memory()


def resume_smaller_on_oom(run: Callable[[Any], Any], settings, run_dir: Path):
    """run(settings); on an out-of-memory mid-run, halve batch_size (doubling grad_accum) and run
    again from the newest checkpoint this run wrote, until it finishes or micro-batch 1 fails too."""
    from ptbr.train.checkpoint import latest_checkpoint

    before = latest_checkpoint(run_dir)
    while True:
        try:
            return run(settings)
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled
            if not is_out_of_memory(exc):
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        release_memory()
        smaller = halve(settings.batch_size, settings.grad_accum)
        if smaller is None:
            raise DeviceError(f"out of memory during the run at micro-batch 1 ({reason})", "--auto-fit",
                              "turn on --gradient-checkpointing or lower --seq-len; the last checkpoint is intact")
        newest = latest_checkpoint(run_dir)
        # only a checkpoint this run wrote: with --resume never, older ones stay ignored
        resume = str(newest) if newest is not None and newest != before else settings.resume
        log(f"out of memory during the run ({reason}): again from --resume {resume} with batch_size "
            f"{smaller[0]} x grad_accum {smaller[1]} (was {settings.batch_size} x {settings.grad_accum})")
        settings = dataclasses.replace(settings, batch_size=smaller[0], grad_accum=smaller[1], resume=resume)


def auto_fit_pretrain(settings, dataset, preset, placement, build_backend: Callable) -> Any:
    """--auto-fit for `ptbr train`: every window is seq_len long, so any batch is the longest.
    Returns the settings with the batch_size and grad_accum that fit."""
    from ptbr.data.tokens import RandomWindows
    from ptbr.train.step import windows_to_batch

    def make_backend(batch_size: int):
        return build_backend(dataclasses.replace(settings, batch_size=batch_size), dataset, preset, placement)

    def longest_batch(batch_size: int) -> dict:
        windows = RandomWindows(dataset.train, dataset.train_path, batch_size, settings.seq_len, dataset.vocab_size,
                                settings.seed)
        return windows_to_batch(windows.batch(0))

    too_big = None
    if placement.device.type == "cpu":
        too_big = _ram_guard(preset, dataset.vocab_size, settings, placement.precision)
    choice = auto_fit(make_backend, longest_batch, settings.batch_size, settings.grad_accum, too_big)
    return dataclasses.replace(settings, batch_size=choice.batch_size, grad_accum=choice.grad_accum)


def auto_fit_finetune(settings, adapted, examples: list, pad_id: int, placement) -> Any:
    """--auto-fit for `ptbr finetune`: the dry run pads its micro-batch to the longest examples,
    as the worst micro-batch of the run will be. The base is loaded once; each try starts the
    adapter from its seeded initialisation (AdaptedModel.reset) with a fresh optimizer, and the
    run starts from there too. Returns the settings with the batch_size and grad_accum that fit."""
    from ptbr.finetune.batches import collate
    from ptbr.train.step import TorchStep, build_optimizer

    longest_first = sorted(examples, key=lambda e: len(e.ids), reverse=True)

    def make_backend(batch_size: int):
        adapted.reset()
        model = adapted.model
        return TorchStep(model, build_optimizer(model, settings, placement.device), placement, settings.max_grad_norm)

    def longest_batch(batch_size: int) -> dict:
        return collate(longest_first[:batch_size], pad_id)

    too_big = None
    if placement.device.type == "cpu":
        too_big = _lora_ram_guard(adapted.model, settings, len(longest_first[0].ids) - 1, placement.precision)
    try:
        choice = auto_fit(make_backend, longest_batch, settings.batch_size, settings.grad_accum, too_big)
    finally:
        adapted.reset()
    return dataclasses.replace(settings, batch_size=choice.batch_size, grad_accum=choice.grad_accum)


def _ram_guard(preset, vocab_size: int, settings, precision: str) -> Callable[[int], str | None]:
    """On CPU, running out of memory means the kernel kills the process: ask the memory model first."""
    from ptbr.memory import Architecture, estimate_training_memory

    arch = Architecture.from_preset(preset, vocab_size)
    return _guard(lambda b: estimate_training_memory(arch, b, settings.seq_len, precision,
                                                     settings.gradient_checkpointing).total)


def _lora_ram_guard(model, settings, seq_len: int, precision: str) -> Callable[[int], str | None] | None:
    """The same for fine-tuning, where the base is already loaded: only what a step adds must fit."""
    from ptbr.memory import Architecture
    from ptbr.preflight.recommend import estimate

    try:
        arch = Architecture.from_hf_config(model.config.to_dict())
    except (KeyError, TypeError, ValueError):
        log("auto-fit: the memory model does not know this architecture; every size is tried for real")
        return None
    requested = dataclasses.asdict(settings)

    def step_bytes(batch_size: int) -> int:
        predicted = estimate("finetune", arch, requested, "cpu", batch_size, seq_len, precision,
                             settings.gradient_checkpointing)
        return predicted.total - predicted.weights - predicted.overhead  # those are in RAM already

    return _guard(step_bytes)


def _guard(needed_bytes: Callable[[int], int]) -> Callable[[int], str | None]:
    import psutil

    from ptbr.memory import GIB

    def too_big(batch_size: int) -> str | None:
        needed = needed_bytes(batch_size)
        available = psutil.virtual_memory().available
        if needed > available:
            return f"the memory model predicts {needed / GIB:.1f} GiB, {available / GIB:.1f} GiB of RAM is available"
        return None

    return too_big
