"""The torch backend: CUDA GPUs (fp16 with GradScaler or bf16), CPUs and Apple's MPS; models from
transformers, LoRA/QLoRA from PEFT and bitsandbytes."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

from ptbr.backends.torch.allocator import (
    give_back_freed_memory,
    keep_freed_memory,
    return_freed_memory,
)
from ptbr.backends.torch.device import (
    Placement,
    fit_threads_to_cpus,
    reset_peak_memory,
    resolve_device,
    resolve_precision,
)
from ptbr.backends.torch.distributed import world_from_env
from ptbr.backends.torch.step import TorchStep, build_optimizer
from ptbr.backends.world import SingleProcess
from ptbr.errors import ConfigError
from ptbr.log import log
from ptbr.versions import package_versions

# What an out-of-memory looks like where torch does not raise torch.OutOfMemoryError (CPU, MPS).
MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory",
                "failed to allocate")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or an allocation failure on CPU/MPS (a RuntimeError)."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in MEMORY_WORDS)


TORCH_PACKAGES = ("ptbr", "torch", "transformers", "accelerate", "tokenizers", "safetensors", "numpy", "peft",
                  "bitsandbytes")


class TorchBackend:
    name = "torch"

    def __init__(self, placement: Placement, world=None):
        self.placement = placement
        self.device = str(placement.device)
        self.precision = placement.precision
        self.reason = placement.reason
        self.world = world or SingleProcess()

    @classmethod
    def create(cls, device: str = "auto", precision: str = "auto", pretraining: bool = False) -> TorchBackend:
        """The device and precision; under torchrun or `accelerate launch`, also this process's rank
        (its own GPU) in the run's process group. `pretraining`: see resolve_precision."""
        world = world_from_env()
        resolved = resolve_device(device)
        if world is not None:
            if resolved.type == "cuda":
                import torch

                resolved = torch.device("cuda", world.local_rank)
                torch.cuda.set_device(resolved)
            world.start(resolved)
            if not world.is_main:  # one rank speaks for the run; the others say only what goes wrong
                logging.getLogger("ptbr").setLevel(logging.WARNING)
        if resolved.type == "cpu":
            return_freed_memory()  # peaks as the memory model predicts, until a run keeps freed memory
            said = fit_threads_to_cpus()
            if said:
                log(said)
        return cls(resolve_precision(resolved, precision, pretraining), world)

    def keep_freed_memory(self) -> str:
        """On a CPU: glibc's malloc keeps what a step frees (allocator.py); what was set, for the log."""
        if self.placement.device.type == "cpu" and keep_freed_memory():
            return ("glibc's malloc keeps what a step frees for the next (blocks under 32 MiB, no trimming), so "
                    "steps do not fault their buffers back in")
        return ""

    def check_compile(self) -> None:
        """--compile: refused where torch.compile cannot run here (before the run directory is made)."""
        from ptbr.backends.torch.compiled import check_compile

        check_compile(self.placement.device, self.world.size)

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed + self.world.rank)  # each rank its own stream (LoRA dropout masks)

    def parallel(self, model):
        """The model wrapped for data parallelism (DDP), or None in a single process."""
        if self.world.size == 1:
            return None
        from torch.nn.parallel import DistributedDataParallel

        device = self.placement.device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def versions(self) -> dict[str, str | None]:
        return package_versions(TORCH_PACKAGES)

    # ---- pretraining ------------------------------------------------------------------------

    def pretrain_step(self, preset, vocab_size: int, eos_id: int, pad_id: int | None, settings) -> TorchStep:
        from ptbr.backends.torch.models import build_model

        model = build_model(preset, vocab_size, eos_id, settings.seed, pad_id).to(self.placement.device)
        # the run's peak from here: not what the process held before (a notebook's earlier work)
        reset_peak_memory(self.placement.device)
        if settings.gradient_checkpointing:
            # non-reentrant: the recomputation that DDP's gradient hooks and PEFT support
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if settings.fsdp and self.world.size > 1:
            shard(model)
            optimizer = build_optimizer(model, settings, self.placement.device, fused=False)
            return TorchStep(model, optimizer, self.placement, settings.max_grad_norm, self.world, sharded=True,
                             chunked_loss=settings.chunked_loss)
        optimizer = build_optimizer(model, settings, self.placement.device)
        return TorchStep(model, optimizer, self.placement, settings.max_grad_norm, self.world, self.parallel(model),
                         compile=settings.compile, chunked_loss=settings.chunked_loss, cuda_graphs=settings.cuda_graphs,
                         gradient_checkpointing=settings.gradient_checkpointing)

    def parameter_count(self, step: TorchStep) -> int:
        from ptbr.backends.torch.models import count_parameters

        return count_parameters(step.model)

    def gather_model(self, step: TorchStep) -> None:
        step.gather_whole()

    def write_model(self, step: TorchStep, directory: Path) -> None:
        # sharded (FSDP): the whole weights gathered for the checkpoint of the last step
        weights = dict(step.exported) if step.exported is not None else None
        step.model.save_pretrained(str(directory), safe_serialization=True, state_dict=weights)

    # ---- fine-tuning ------------------------------------------------------------------------

    def load_adapted(self, settings):
        from ptbr.backends.torch.lora import load_model

        return load_model(settings, self.placement)

    def finetune_step(self, adapted, settings) -> TorchStep:
        if settings.fsdp and self.world.size > 1:
            raise ConfigError("--fsdp is for pretraining: a fine-tuning run copies its (4-bit) base to every GPU "
                              "and trains the small adapter data-parallel", "--fsdp", "leave --fsdp out")
        model = adapted.model
        reset_peak_memory(self.placement.device)  # the run's peak from here: not the base's loading
        step = TorchStep(model, build_optimizer(model, settings, self.placement.device), self.placement,
                         settings.max_grad_norm, self.world, self.parallel(model),
                         chunked_loss=settings.chunked_loss, right_padded=True)
        log("padded micro-batches: " + (
            f"with their attention mask ({step.padding_mask_why})" if step.keeps_padding_mask else
            "without their attention mask (a causal decoder: the pads come after every token the loss covers)"))
        return step

    # ---- the loss ---------------------------------------------------------------------------

    def describe_loss(self, step: TorchStep, tokens: int) -> str | None:
        """The start-up line on --chunked-loss (ptbr/backends/torch/loss.py): the chunk size, and
        whether the run's largest micro-batch (`tokens` tokens) is chunked, one chunk, or too small
        for the chunked loss to save memory. None when the run asked for the whole logits."""
        if not step.chunked_loss:
            return None
        if step.head is None:
            return f"chunked loss: not with this model ({step.whole_logits_why}): the whole logits"
        chunk, fewest = step.loss_chunk(), step.chunked_from()
        if tokens >= fewest and step.compiles_whole_logits(tokens):
            return (f"chunked loss: not under --compile here: micro-batches of {tokens} tokens take the whole "
                    f"16-bit logits (vocabulary {step.head.out_features:,}), compiled with the forward pass "
                    "(faster on a GPU; inductor never makes their fp32 copy)")
        line = (f"chunked loss: {chunk} tokens per chunk at vocabulary {step.head.out_features:,}; "
                f"micro-batches of {tokens} tokens ")
        if tokens > chunk:
            return line + "are chunked"
        if tokens >= fewest:
            return line + "take one chunk"
        return line + (f"take the whole logits (fewer than {fewest}: below that the output layer's gradient, "
                       "which the chunked loss makes in the forward pass, outweighs the logits it saves)")

    def describe_compile(self, step: TorchStep, micro_batches: int, tokens: int) -> str:
        """The start-up line on --compile: what compiles when, and whether steps of `micro_batches`
        micro-batches of `tokens` tokens replay as CUDA graphs."""
        line = ("--compile: the first step compiles the forward pass (with the loss where it takes the whole logits) "
                "with torch.compile (tens of seconds on a CPU; a later run of the same shapes reuses the compiled code)")
        graphs = step.cuda_graphs_line(micro_batches, tokens)
        return f"{line}; {graphs}" if graphs else line

    def write_adapter(self, adapted, directory: Path) -> None:
        """PEFT's adapter_model.safetensors and adapter_config.json."""
        adapted.model.save_pretrained(str(directory), safe_serialization=True)

    # ---- memory -----------------------------------------------------------------------------

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return is_out_of_memory(exc)

    def memory_report(self) -> str:
        import torch

        device = self.placement.device
        if device.type == "cuda":
            return (f"allocated {torch.cuda.memory_allocated(device):,} B, "
                    f"peak {torch.cuda.max_memory_allocated(device):,} B")
        import psutil

        return f"process RSS {psutil.Process().memory_info().rss:,} B"

    def release_memory(self) -> None:
        """What a failed step (or a probe) held, back to the device: for a compiled run also the
        compiled code and its CUDA graphs, whose private memory pool outlives the step (the next
        try, at another batch size, compiles anew anyway)."""
        import torch

        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.placement.device.type == "cpu":
            give_back_freed_memory(always=True)
        reset_peak_memory(self.placement.device)  # a try's peak is not the run's


def shard(model) -> None:
    """FSDP2: each decoder layer its own unit (its weights gathered just before it runs), the
    embeddings, the final norm and the (tied) output layer in the root unit."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
