"""The recommended config: a pure function of (hardware, mode, requested settings, architecture).

It keeps the requested effective batch (batch_size x grad_accum) and sequence length, and picks the
largest micro-batch that the memory model says fits in about 90% of the free memory (80% of the
RAM on CPU); gradient checkpointing only where the micro-batch would otherwise be too small, and
a shorter sequence only where even one sequence does not fit. Precision: bf16 where the GPU has it natively, fp16 on
T4-class GPUs, fp32 on CPU and Apple's MPS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptbr.errors import ConfigError
from ptbr.memory import (
    GIB,
    RUNTIME_BYTES,
    Architecture,
    MemoryEstimate,
    estimate_lora_memory,
    estimate_mlx_memory,
    estimate_training_memory,
)
from ptbr.preflight.hardware import Hardware

# Share of the free memory a run may plan to use: the rest absorbs allocator overhead and model
# error. On CPU, glibc keeps freed blocks resident: peak RSS measured 10-20% above the tensors for
# the 85m and 400m presets (benchmarks/memory_accuracy.py, README), hence less there.
USABLE_FRACTION = {"cuda": 0.9, "mps": 0.9, "mlx": 0.9, "cpu": 0.8}
# Metal lets a process use about this share of unified memory when mlx cannot tell us the real limit
METAL_SHARE = 2 / 3
# A micro-batch of this many tokens keeps a GPU's matmuls busy: below it, gradient checkpointing
# (about a third more compute) is worth a larger micro-batch; CPUs and Apple GPUs gain nothing.
BUSY_TOKENS = {"cuda": 2048}
SHORTEST_SEQ = 64

QUANT_ALIASES = {"4bit": "nf4", "nf4": "nf4", "qlora": "nf4", "8bit": "int8", "int8": "int8",
                 "none": None, "lora": None, "": None}


# What recommended_config.json always holds (with the settings the user gave)
RECOMMENDED_KEYS = {
    "pretrain": ("output", "model_size", "batch_size", "grad_accum", "seq_len", "learning_rate", "precision",
                 "gradient_checkpointing", "max_steps"),
    "finetune": ("output", "base", "data", "quant", "lora_r", "batch_size", "grad_accum", "max_seq_len",
                 "learning_rate", "precision", "gradient_checkpointing", "epochs", "max_steps"),
}


@dataclass
class Recommendation:
    settings: dict  # the requested settings with the recommended values in place
    fits: bool
    target: str  # cuda | cpu | mps | mlx
    budget: int  # bytes the run may use
    estimate: MemoryEstimate  # of the recommended settings
    requested_estimate: MemoryEstimate  # of the settings as requested (on the same target)
    reasons: list[str] = field(default_factory=list)
    planned_seq: int = 0  # the sequence length the requested estimate is for

    @property
    def requested_fits(self) -> bool:
        return self.requested_estimate.total <= self.budget

    def config_file(self, given: set[str] | None = None) -> dict:
        """recommended_config.json, as `ptbr train/finetune --config` reads it: the settings the
        user gave and the ones recommended (None: all). Defaults derived from other settings (the
        warmup from max_steps) are left out, so that they follow a later --max-steps."""
        if given is None:
            given = set(self.settings)
        mode = "pretrain" if "seq_len" in self.settings else "finetune"
        keep = given | {k for k in RECOMMENDED_KEYS[mode] if self.settings.get(k) is not None}
        return {k: v for k, v in self.settings.items() if k in keep} | {"reasons": list(self.reasons)}


def seq_key(mode: str) -> str:
    return "seq_len" if mode == "pretrain" else "max_seq_len"


def quantization(requested: dict, target: str) -> str | None:
    """The memory model's name for the requested quantization of a fine-tuning base."""
    raw = requested.get("quant")
    name = "none" if raw is None else str(raw).lower()
    if name not in QUANT_ALIASES:
        raise ConfigError(f"unknown quant {raw!r}", "quant", "use 4bit (QLoRA), 8bit or none (LoRA)")
    quant = QUANT_ALIASES[name]
    if quant and target == "mlx":
        return "mlx4"  # MLX quantizes with its own 4-bit affine format
    return quant


def choose_target(hardware: Hardware, mode: str, device: str, backend: str = "auto") -> str:
    """On Apple Silicon both modes plan for the MLX backend (what --backend auto runs there), unless
    --backend torch asks for MPS."""
    if device == "cuda" or (device == "auto" and hardware.gpus):
        return "cuda"
    if device == "mps" or (device == "auto" and hardware.apple_silicon):
        return "mps" if backend == "torch" else "mlx"
    return "cpu"


def choose_precision(hardware: Hardware, target: str, requested: str, reasons: list[str]) -> str:
    if target == "cuda" and hardware.gpus:
        gpu = hardware.gpus[0]
        native = "bf16" if gpu.real_bf16 else "fp16"
        if requested in ("auto", native, "fp32"):
            if requested == "auto" and native == "fp16":
                reasons.append(f"precision fp16 with GradScaler: the {gpu.name} (compute {gpu.compute_capability}) "
                               "has no native bf16")
            elif requested == "auto":
                reasons.append(f"precision bf16: the {gpu.name} computes bf16 natively")
            return native if requested == "auto" else requested
        reasons.append(f"precision {native} instead of {requested}: the {gpu.name} "
                       f"{'has no native bf16' if native == 'fp16' else 'trains better in bf16'}")
        return native
    if target == "mlx":
        return "bf16" if requested == "auto" else requested
    if requested in ("auto", "fp32") or (requested == "bf16" and target == "cpu"):
        return "fp32" if requested == "auto" else requested
    reasons.append(f"precision fp32 instead of {requested}: {requested} needs a CUDA GPU")
    return "fp32"


def memory_budget(hardware: Hardware, target: str, reasons: list[str]) -> int:
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    if target == "cuda" and hardware.gpus:
        gpu = hardware.gpus[0]
        budget = int(USABLE_FRACTION["cuda"] * gpu.memory_free)
        reasons.append(f"GPU 0 {gpu.name}: {gib(gpu.memory_free)} of {gib(gpu.memory_total)} free, "
                       f"planning for {gib(budget)} ({USABLE_FRACTION['cuda']:.0%})")
        if len(hardware.gpus) > 1:
            reasons.append(f"{len(hardware.gpus)} GPUs found: a run trains on one, GPU 0; start a second run "
                           "on another with CUDA_VISIBLE_DEVICES=1")
        return budget
    fraction = USABLE_FRACTION.get(target, USABLE_FRACTION["cpu"])
    budget = int(fraction * hardware.ram_available)
    if target in ("mps", "mlx"):
        limit = hardware.metal_working_set or int(METAL_SHARE * (hardware.unified_memory or hardware.ram_total))
        if limit < budget:
            reasons.append(f"Apple Silicon: Metal's working-set limit {gib(limit)} is below {fraction:.0%} of the "
                           f"{gib(hardware.ram_available)} available")
            budget = limit
        else:
            reasons.append(f"Apple Silicon, {gib(hardware.ram_available)} of {gib(hardware.ram_total)} unified "
                           f"memory available, planning for {gib(budget)}")
    else:
        reasons.append(f"no GPU: {gib(hardware.ram_available)} of {gib(hardware.ram_total)} RAM available, "
                       f"planning for {gib(budget)} ({fraction:.0%})")
    return budget


LORA_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}


def lora_targets(requested: dict) -> tuple[str, ...]:
    """The memory model's names for --target-modules (default: every projection)."""
    names = [n.strip() for n in (requested.get("target_modules") or "").split(",") if n.strip()]
    known = tuple(LORA_TARGETS[n] for n in names if n in LORA_TARGETS)
    return known or tuple(LORA_TARGETS.values())


def estimate(mode: str, arch: Architecture, requested: dict, target: str, batch_size: int, seq_len: int,
             precision: str, checkpointing: bool) -> MemoryEstimate:
    """The memory model for one candidate, the runtime outside the model's tensors included."""
    overhead = RUNTIME_BYTES.get(target, RUNTIME_BYTES["cpu"])
    if target == "mlx":  # the MLX backend's own estimate (MLX's 4/8-bit format, its activations)
        lora = mode == "finetune"
        quant = str(requested.get("quant") or "none").lower()
        return estimate_mlx_memory(arch, batch_size, seq_len, precision, int(requested.get("lora_r", 16)) if lora else None,
                                   {"nf4": 4, "int8": 8}.get(QUANT_ALIASES.get(quant)) if lora else None, checkpointing,
                                   lora_dropout=lora and float(requested.get("lora_dropout") or 0) > 0,
                                   overhead=overhead, targets=lora_targets(requested))
    if mode == "pretrain":
        return estimate_training_memory(arch, batch_size, seq_len, precision, checkpointing, overhead)
    return estimate_lora_memory(arch, batch_size, seq_len, int(requested.get("lora_r", 16)),
                                quantization(requested, target), precision, checkpointing,
                                lora_dropout=float(requested.get("lora_dropout") or 0) > 0, overhead=overhead,
                                targets=lora_targets(requested), device=target)


def recommend(hardware: Hardware, mode: str, requested: dict, arch: Architecture, *,
              max_positions: int | None = None, examples: int | None = None,
              longest: int | None = None) -> Recommendation:
    """The settings to run with on this hardware, and why. Fine-tuning: `examples` gives the
    steps per epoch; `longest` (tokens of the longest example) the length to plan memory for,
    since a micro-batch is padded to its longest example, never beyond it."""
    reasons: list[str] = []
    key = seq_key(mode)
    target = choose_target(hardware, mode, requested.get("device", "auto"), requested.get("backend", "auto"))
    precision = choose_precision(hardware, target, requested.get("precision", "auto"), reasons)
    budget = memory_budget(hardware, target, reasons)
    effective = requested["batch_size"] * requested["grad_accum"]
    wants_checkpointing = bool(requested.get("gradient_checkpointing"))
    cap = requested[key]
    if max_positions and cap > max_positions:
        cap = max_positions
        reasons.append(f"{key} {cap}: the model has {max_positions} positions")
    planned = cap
    if longest and longest < cap:
        planned = longest
        reasons.append(f"memory planned for the longest example, {longest} tokens ({key} {cap} is only a cap)")

    def fits(batch: int, length: int, checkpointing: bool) -> bool:
        return estimate(mode, arch, requested, target, batch, length, precision, checkpointing).total <= budget

    def largest(length: int, checkpointing: bool) -> int | None:
        return next((b for b in _divisors_descending(effective) if fits(b, length, checkpointing)), None)

    # the longest sequence first; shorter (halved) only when not even one sequence fits
    choice, length = None, planned
    while choice is None and length >= min(SHORTEST_SEQ, planned):
        plain = None if wants_checkpointing else largest(length, False)
        if plain is not None and plain * length >= min(effective * length, BUSY_TOKENS.get(target, 1)):
            choice = (plain, length, False)
            break
        with_checkpointing = largest(length, True)
        if with_checkpointing is not None and (plain is None or with_checkpointing > plain):
            choice = (with_checkpointing, length, True)
            if not wants_checkpointing:
                reasons.append(f"gradient checkpointing on: it fits micro-batch {with_checkpointing} instead of "
                               f"{plain or 'not even 1'}")
        elif plain is not None:
            choice = (plain, length, False)
        else:
            length //= 2
    fits_at_all = choice is not None
    batch, length, checkpointing = choice or (1, min(planned, SHORTEST_SEQ), True)

    chosen = estimate(mode, arch, requested, target, batch, length, precision, checkpointing)
    asked = estimate(mode, arch, requested, target, requested["batch_size"], planned, precision, wants_checkpointing)
    settings = dict(requested)
    settings.update({"batch_size": batch, "grad_accum": effective // batch, key: length if length < planned else cap,
                     "precision": precision, "gradient_checkpointing": checkpointing})
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    if not fits_at_all:
        reasons.append(f"does not fit: micro-batch 1 of {length} tokens with gradient checkpointing needs "
                       f"{gib(chosen.total)}, {gib(budget)} usable")
    else:
        reasons.append(f"micro-batch {batch} x grad_accum {effective // batch} keeps the requested effective batch "
                       f"of {effective} sequences; predicted peak {gib(chosen.total)} of {gib(budget)} usable")
        if length < planned:
            reasons.append(f"{key} lowered from {planned} to {length}: one sequence of {planned} tokens does not fit "
                           "even with gradient checkpointing")
        if not asked.total <= budget:
            reasons.append(f"the requested micro-batch {requested['batch_size']} x {planned} tokens would need "
                           f"{gib(asked.total)}")
        reasons.append(f"learning_rate {requested['learning_rate']:g} unchanged: the effective batch is unchanged")
    if mode == "finetune" and examples:
        steps, epochs = -(-examples // effective), int(requested.get("epochs") or 1)
        reasons.append(f"{examples} training examples / {effective} per step = {steps} steps per epoch, "
                       f"{steps * epochs} for {epochs} epoch{'s' if epochs != 1 else ''}")
    if target == "cpu" and mode == "pretrain" and arch.parameters > 50_000_000:
        reasons.append("training on the CPU: expect hours per thousand steps; a GPU is 10-100x faster")
    return Recommendation(settings, fits_at_all, target, budget, chosen, asked, reasons, planned)


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]
