"""The torch backend: CUDA GPUs (fp16 with GradScaler or bf16), CPUs and Apple's MPS; models from
transformers, LoRA/QLoRA from PEFT and bitsandbytes."""

from __future__ import annotations

import gc
from pathlib import Path

from ptbr.backends.torch.device import Placement, resolve_device, resolve_precision
from ptbr.backends.torch.step import TorchStep, build_optimizer
from ptbr.versions import package_versions

# What an out-of-memory looks like where torch does not raise torch.OutOfMemoryError (CPU, MPS).
MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory",
                "failed to allocate")
TORCH_PACKAGES = ("ptbr", "torch", "transformers", "accelerate", "tokenizers", "safetensors", "numpy", "peft",
                  "bitsandbytes")


class TorchBackend:
    name = "torch"

    def __init__(self, placement: Placement):
        self.placement = placement
        self.device = str(placement.device)
        self.precision = placement.precision
        self.reason = placement.reason

    @classmethod
    def create(cls, device: str = "auto", precision: str = "auto") -> TorchBackend:
        return cls(resolve_precision(resolve_device(device), precision))

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def versions(self) -> dict[str, str | None]:
        return package_versions(TORCH_PACKAGES)

    # ---- pretraining ------------------------------------------------------------------------

    def pretrain_step(self, preset, vocab_size: int, eos_id: int, pad_id: int | None, settings) -> TorchStep:
        from ptbr.backends.torch.models import build_model

        model = build_model(preset, vocab_size, eos_id, settings.seed, pad_id).to(self.placement.device)
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        optimizer = build_optimizer(model, settings, self.placement.device)
        return TorchStep(model, optimizer, self.placement, settings.max_grad_norm)

    def parameter_count(self, step: TorchStep) -> int:
        from ptbr.backends.torch.models import count_parameters

        return count_parameters(step.model)

    def write_model(self, step: TorchStep, directory: Path) -> None:
        step.model.save_pretrained(str(directory), safe_serialization=True)

    # ---- fine-tuning ------------------------------------------------------------------------

    def load_adapted(self, settings):
        from ptbr.backends.torch.lora import load_model

        return load_model(settings, self.placement)

    def finetune_step(self, adapted, settings) -> TorchStep:
        model = adapted.model
        return TorchStep(model, build_optimizer(model, settings, self.placement.device), self.placement,
                         settings.max_grad_norm)

    def write_adapter(self, adapted, directory: Path) -> None:
        """PEFT's adapter_model.safetensors and adapter_config.json."""
        adapted.model.save_pretrained(str(directory), safe_serialization=True)

    # ---- memory -----------------------------------------------------------------------------

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """torch's OutOfMemoryError (CUDA), or an allocation failure on CPU/MPS (a RuntimeError)."""
        import torch

        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return True
        return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in MEMORY_WORDS)

    def memory_report(self) -> str:
        import torch

        device = self.placement.device
        if device.type == "cuda":
            return (f"allocated {torch.cuda.memory_allocated(device):,} B, "
                    f"peak {torch.cuda.max_memory_allocated(device):,} B")
        import psutil

        return f"process RSS {psutil.Process().memory_info().rss:,} B"

    def release_memory(self) -> None:
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
