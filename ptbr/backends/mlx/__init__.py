"""The MLX backend: Apple Silicon's Metal GPU (and mlx[cpu] on Linux, where CI runs it); models
from mlx-lm, LoRA on bases quantized with MLX's own 4/8-bit format.

Nothing here imports torch, directly or through ptbr: with torch absent, `--backend mlx`
pretrains, fine-tunes, generates and exports.

Devices: --device auto is the Metal GPU when MLX sees one, else the CPU; mps is the Metal GPU;
cpu is the CPU; cuda belongs to torch and is an error here. Precision: auto is bf16 on Metal
(the frozen base in bf16; trainable weights, adapters and AdamW state in fp32) and fp32 on the CPU.
"""

from __future__ import annotations

import gc
from pathlib import Path

from ptbr.backends.mlx.device import (
    MlxPlacement,
    configure_memory,
    memory_report,
    resolve_device,
    resolve_precision,
)
from ptbr.backends.mlx.step import MlxStep, build_optimizer
from ptbr.backends.world import SingleProcess
from ptbr.errors import ConfigError
from ptbr.log import log
from ptbr.versions import package_versions

# How MLX reports a failed allocation: Metal's allocator ("[metal::malloc] Unable to allocate ...",
# "... greater than the maximum allowed buffer size"), a command buffer out of memory
# ("Insufficient Memory (kIOGPUCommandBufferCallbackErrorOutOfMemory)"), the CPU's (std::bad_alloc).
MEMORY_WORDS = ("out of memory", "outofmemory", "insufficient memory", "unable to allocate", "failed to allocate",
                "maximum allowed buffer size", "bad_alloc", "cannot allocate memory", "can't allocate memory")
MLX_PACKAGES = ("ptbr", "mlx", "mlx-metal", "mlx-cpu", "mlx-lm", "transformers", "tokenizers", "safetensors",
                "numpy", "huggingface-hub")


class MlxBackend:
    name = "mlx"

    def __init__(self, placement: MlxPlacement):
        self.placement = placement
        self.device = placement.device
        self.precision = placement.precision
        self.reason = placement.reason
        self.world = SingleProcess()  # MLX trains in one process (data parallelism is torch's)

    def check_compile(self) -> None:
        """--compile is torch's (the CLI refuses it before this backend is made)."""
        raise ConfigError("--compile: a torch backend option (the MLX backend always compiles its step)",
                          "--backend mlx", "leave --compile out with --backend mlx, or use --backend torch")

    @classmethod
    def create(cls, device: str = "auto", precision: str = "auto") -> MlxBackend:
        placement = resolve_precision(resolve_device(device), precision)
        log(f"MLX memory: {configure_memory(placement.device)}")
        return cls(placement)

    def keep_freed_memory(self) -> str:
        return ""  # nothing to set: MLX caches its own buffers

    def seed(self, seed: int) -> None:
        import mlx.core as mx

        mx.random.seed(seed)

    def versions(self) -> dict[str, str | None]:
        return package_versions(MLX_PACKAGES)

    # ---- pretraining ------------------------------------------------------------------------

    def pretrain_step(self, preset, vocab_size: int, eos_id: int, pad_id: int | None, settings) -> MlxStep:
        from ptbr.backends.mlx.models import build_model, checkpoint_layers, hf_config

        model = build_model(preset, vocab_size, settings.seed, pad_id)
        if settings.gradient_checkpointing:
            checkpoint_layers(model)
        model.train()
        # 16-bit precisions compute with 16-bit casts of fp32 master weights, as torch's autocast
        compute = self.placement.dtype if self.precision != "fp32" else None
        return MlxStep(model, build_optimizer(model, settings), self.precision, settings.max_grad_norm,
                       settings.batch_size, settings.seq_len, "model", hf_config(preset, vocab_size, eos_id, pad_id),
                       compute)

    def parameter_count(self, step: MlxStep) -> int:
        from ptbr.backends.mlx.models import count_parameters

        return count_parameters(step.model)

    def gather_model(self, step: MlxStep) -> None:
        """One process holds the whole model."""

    def write_model(self, step: MlxStep, directory: Path) -> None:
        """A Hugging Face folder (fp32 model.safetensors, config.json for LlamaForCausalLM)."""
        from ptbr.backends.mlx.models import write_hf_model

        write_hf_model(step.model, step.config, directory)

    # ---- fine-tuning ------------------------------------------------------------------------

    def load_adapted(self, settings):
        from ptbr.backends.mlx.lora import load_adapted

        return load_adapted(settings, self.placement.dtype)

    def finetune_step(self, adapted, settings) -> MlxStep:
        return MlxStep(adapted.model, build_optimizer(adapted.model, settings), self.precision,
                       settings.max_grad_norm, settings.batch_size, settings.max_seq_len, "adapter",
                       adapted.adapter_config())

    def write_adapter(self, adapted, directory: Path) -> None:
        """mlx-lm's adapters.safetensors and adapter_config.json."""
        from ptbr.backends.mlx.lora import write_adapter

        write_adapter(adapted, directory)

    def describe_loss(self, step: MlxStep, tokens: int) -> str | None:
        """MLX computes its own loss over the whole logits: --chunked-loss is the torch backend's."""
        return None

    def describe_compile(self, step: MlxStep, micro_batches: int, tokens: int) -> str | None:
        """--compile is the torch backend's (refused with MLX, whose step is always compiled)."""
        return None

    # ---- memory -----------------------------------------------------------------------------

    def is_out_of_memory(self, exc: BaseException) -> bool:
        if isinstance(exc, MemoryError):
            return True
        return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in MEMORY_WORDS)

    def memory_report(self) -> str:
        return memory_report()

    def release_memory(self) -> None:
        import mlx.core as mx

        gc.collect()
        mx.clear_cache()

