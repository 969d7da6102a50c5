"""The seam between ptbr's runs and an array library: torch (CUDA, CPU, MPS) or MLX (Apple Silicon,
and mlx[cpu] on Linux).

A run (ptbr/runs) asks `create_backend` for one backend and never imports torch or mlx itself. The
backend owns everything that differs between them: placing and seeding, building the pretraining
model or loading a base with its LoRA adapter, the training step the loop drives (train_step,
eval_loss, state I/O, memory), saving the final model and adapters, recognising an out-of-memory,
and the package versions a run records. Everything else (the loop, schedule, batches, loss masks,
checkpoint directories, resume checks, metrics) is shared.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ptbr.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from ptbr.backends.world import World
    from ptbr.train.loop import TrainingStep

NAMES = ("torch", "mlx")


class Adapted(Protocol):
    """A base model with a LoRA adapter, loaded once per run."""

    target_modules: list[str]
    trainable_parameters: int
    total_parameters: int

    def reset(self) -> None:
        """The adapter back to its seeded initialisation (--auto-fit's tries, a retry after an out-of-memory)."""


class Backend(Protocol):
    name: str  # torch | mlx
    device: str  # where it trains, as the library names it (cuda:0, cpu, gpu)
    precision: str  # fp32 | fp16 | bf16
    reason: str  # why this device and precision, for the log
    world: World  # this run's processes: SingleProcess, or a rank of torch's data-parallel run

    def keep_freed_memory(self) -> str:
        """Have the host's allocator keep what a step frees (a CPU's speed lever, which holds more memory
        than the memory model predicts); what was set, for the log ("": nothing)."""

    def seed(self, seed: int) -> None:
        """Seed the library's global generator (LoRA dropout draws from it) at the start of a run."""

    def versions(self) -> dict[str, str | None]: ...

    def pretrain_step(self, preset, vocab_size: int, eos_id: int, pad_id: int | None, settings) -> TrainingStep:
        """A freshly initialised preset model (seeded by settings.seed) with its optimizer."""

    def parameter_count(self, step: TrainingStep) -> int: ...

    def gather_model(self, step: TrainingStep) -> None:
        """Every rank, before the main rank writes the model: a sharded model's weights gathered
        (FSDP; a collective), where the last checkpoint did not gather them already."""

    def write_model(self, step: TrainingStep, directory: Path) -> None:
        """The trained model's weights and config.json, as a Hugging Face folder (the run adds the tokenizer)."""

    def load_adapted(self, settings) -> Adapted:
        """The fine-tuning base (quantized per settings.quant) with a fresh LoRA adapter."""

    def finetune_step(self, adapted: Adapted, settings) -> TrainingStep:
        """A training step over the adapter's weights with a fresh optimizer."""

    def write_adapter(self, adapted: Adapted, directory: Path) -> None:
        """The adapter's weights and config in the library's own format (PEFT or mlx-lm)."""

    def describe_loss(self, step: TrainingStep, tokens: int) -> str | None:
        """A start-up line on how the step computes its loss for micro-batches of up to `tokens`
        tokens, or None when there is nothing to say."""

    def describe_compile(self, step: TrainingStep, micro_batches: int, tokens: int) -> str | None:
        """A start-up line on --compile for steps of `micro_batches` micro-batches of `tokens`
        tokens each, or None where the backend has none."""

    def is_out_of_memory(self, exc: BaseException) -> bool: ...

    def release_memory(self) -> None: ...

    def memory_report(self) -> str:
        """The memory in use right now, in words (for hang reports)."""


def on_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def resolve_name(requested: str) -> str:
    """auto: mlx on Apple Silicon when mlx is installed, torch elsewhere."""
    if requested == "auto":
        return "mlx" if on_apple_silicon() and importlib.util.find_spec("mlx") is not None else "torch"
    if requested not in NAMES:
        raise ConfigError(f"unknown backend {requested!r}", "--backend", f"use one of: auto, {', '.join(NAMES)}")
    return requested


def create_backend(requested: str, device: str = "auto", precision: str = "auto", pretraining: bool = False) -> Any:
    """The backend for --backend/--device/--precision, with its device probed for real.
    `pretraining`: --precision auto may pick bf16 on a CPU that computes it natively (torch; see
    ptbr.precision)."""
    name = resolve_name(requested)
    library = "mlx" if name == "mlx" else "torch"
    if importlib.util.find_spec(library) is None:
        install = ("pip install 'ptbr[mlx]' (Apple Silicon) or 'mlx[cpu]' (Linux)" if name == "mlx" else
                   "pip install torch (on CPU-only Linux its CPU build: pip install torch==2.13.0 "
                   "--index-url https://download.pytorch.org/whl/cpu)")
        raise DeviceError(f"--backend {name} needs {library}, which is not installed", "--backend",
                          f"{install}, or choose the other --backend")
    if name == "mlx":
        from ptbr.backends.mlx import MlxBackend

        return MlxBackend.create(device, precision)
    from ptbr.backends.torch import TorchBackend

    return TorchBackend.create(device, precision, pretraining)
