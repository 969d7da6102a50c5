"""The recommended config: a pure function of (hardware, mode, requested settings, architecture).

It keeps the requested effective batch (batch_size x grad_accum) and sequence length, and picks the
largest micro-batch that the memory model says fits in about 90% of the free memory (80% of the
RAM on CPU); gradient checkpointing only where the micro-batch would otherwise be too small, and
a shorter sequence only where even one sequence does not fit. Precision: bf16 where the GPU has it natively, fp16 on
T4-class GPUs, fp32 on CPU and Apple's MPS, except pretraining on a CPU that computes bf16 natively
(bf16 autocast).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ptbr.config import FinetuneConfig, LoopSettings
from ptbr.memory import (
    GIB,
    USABLE_FRACTION,
    Architecture,
    MemoryEstimate,
    estimate_run,
    padded_length,
)
from ptbr.precision import auto_precision
from ptbr.preflight.hardware import Hardware

# Share of the free memory a run may plan to use: the rest absorbs allocator overhead and model
# error. On CPU, glibc keeps freed blocks resident: peak RSS measured 10-20% above the tensors for
# the 85m and 400m presets (benchmarks/memory_accuracy.py, README), hence less there.
# Metal lets a process use about this share of unified memory when mlx cannot tell us the real limit
METAL_SHARE = 2 / 3
# A micro-batch of this many tokens keeps a GPU's matmuls busy: below it, gradient checkpointing
# (about a third more compute) is worth a larger micro-batch; CPUs and Apple GPUs gain nothing.
BUSY_TOKENS = {"cuda": 2048}
SHORTEST_SEQ = 64


# What recommended_config.json always holds (with the settings the user gave)
RECOMMENDED_KEYS = {
    "pretrain": ("output", "model_size", "batch_size", "grad_accum", "seq_len", "learning_rate", "precision",
                 "gradient_checkpointing", "max_steps", "num_processes", "fsdp"),
    "finetune": ("output", "base", "data", "quant", "lora_r", "batch_size", "grad_accum", "max_seq_len",
                 "learning_rate", "precision", "gradient_checkpointing", "epochs", "max_steps", "num_processes"),
}


DOES_NOT_FIT = "does not fit: "  # how the reason that says so starts


@dataclass
class Recommendation:
    settings: LoopSettings  # the requested settings with the recommended values in place
    fits: bool
    target: str  # cuda | cpu | mps | mlx
    budget: int  # bytes the run may use
    estimate: MemoryEstimate  # of the recommended settings
    requested_estimate: MemoryEstimate  # of the settings as requested (on the same target)
    reasons: list[str] = field(default_factory=list)
    planned_seq: int = 0  # the sequence length the requested estimate is for

    @property
    def why_not(self) -> str | None:
        """The reason that says the run does not fit at all (None where it fits)."""
        return None if self.fits else next((r for r in self.reasons if r.startswith(DOES_NOT_FIT)), "does not fit")

    @property
    def requested_fits(self) -> bool:
        return self.requested_estimate.total <= self.budget

    def config_file(self, given: set[str] | None = None) -> dict:
        """recommended_config.json, as `ptbr train/finetune --config` reads it: the settings the
        user gave and the ones recommended (None: all). Defaults derived from other settings (the
        warmup from max_steps) are left out, so that they follow a later --max-steps."""
        values = dataclasses.asdict(self.settings)
        if given is None:
            given = set(values)
        keep = given | {k for k in RECOMMENDED_KEYS[mode_of(self.settings)] if values.get(k) is not None}
        return {k: v for k, v in values.items() if k in keep} | {"reasons": list(self.reasons)}


def mode_of(settings: LoopSettings) -> str:
    return "finetune" if isinstance(settings, FinetuneConfig) else "pretrain"


def seq_key(mode: str) -> str:
    return "seq_len" if mode == "pretrain" else "max_seq_len"


def choose_target(hardware: Hardware, mode: str, device: str, backend: str = "auto") -> str:
    """On Apple Silicon both modes plan for the MLX backend (what --backend auto runs there), unless
    --backend torch asks for MPS; --backend mlx plans for MLX anywhere (on Linux, its CPU build)."""
    if backend == "mlx":
        return "mlx"
    if device == "cuda" or (device == "auto" and hardware.gpus):
        return "cuda"
    if device == "mps" and not hardware.apple_silicon:  # the run stops (--device mps is Apple's GPU)
        return "mps"
    if device == "mps" or (device == "auto" and hardware.apple_silicon):
        return "mps" if backend == "torch" else "mlx"
    return "cpu"


def choose_precision(hardware: Hardware, target: str, requested: str, reasons: list[str],
                     mode: str = "pretrain") -> str:
    """`auto` as the run will resolve it (ptbr.precision.auto_precision); an explicit precision is
    kept wherever the run accepts it (ptbr.backends.torch.device.resolve_precision: all but fp16 on
    a CPU and bf16 on a GPU without native bf16; the MLX backend refuses fp16), and otherwise
    replaced, with the reason (the run itself would refuse it)."""
    if target == "cuda" and hardware.gpus:
        gpu = hardware.gpus[0]
        native = auto_precision("cuda", gpu.real_bf16, mode == "pretrain")
        if requested == "auto" and native == "fp16":
            reasons.append(f"precision fp16 with GradScaler: the {gpu.name} (compute {gpu.compute_capability}) "
                           "has no native bf16")
        elif requested == "auto":
            reasons.append(f"precision bf16: the {gpu.name} computes bf16 natively")
        elif requested == "fp16" and native == "bf16":
            reasons.append(f"precision fp16 as asked (with GradScaler): the {gpu.name} computes bf16 natively, "
                           "which needs no loss scaling (--precision bf16 or auto)")
        elif requested == "bf16" and native == "fp16":
            reasons.append(f"precision fp16 instead of bf16: the {gpu.name} has no native bf16")
            return native
        return native if requested == "auto" else requested
    if requested == "auto":
        if target == "cuda":  # --device cuda on a machine without a GPU (the checks fail on it)
            return "fp32"
        if target == "mlx" and not hardware.apple_silicon:  # mlx[cpu]: the MLX backend's auto is fp32 there
            reasons.append("precision fp32: MLX on the CPU computes in fp32")
            return "fp32"
        chosen = auto_precision(target, target == "cpu" and hardware.cpu_bf16, mode == "pretrain")
        if target == "cpu" and chosen == "bf16":
            reasons.append("precision bf16 (autocast, fp32 weights): this CPU computes bf16 natively (AVX512-BF16 or "
                           "AMX), about 1.6x faster than fp32 at 85m")
        return chosen
    if target == "mlx" and requested == "fp16":
        reasons.append("precision bf16 instead of fp16: MLX has no loss scaling, and fp16's small gradients would "
                       "vanish")
        return "bf16"
    if target in ("mlx", "mps") or requested == "fp32" or (requested == "bf16" and target == "cpu"):
        return requested
    fallback = choose_precision(hardware, target, "auto", [], mode)
    reasons.append(f"precision {fallback} instead of {requested}: {requested} needs a CUDA GPU")
    return fallback


def memory_budget(hardware: Hardware, target: str, reasons: list[str], processes: int = 1) -> int:
    """Bytes a run may plan into on each device it uses: with several processes, each GPU holds the
    same micro-batch, so the GPU with the least free memory (of the first `processes`, the ones
    the ranks take) decides."""
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    if target == "cuda" and hardware.gpus:
        used = hardware.gpus[:max(1, processes)]
        index, gpu = min(enumerate(used), key=lambda pair: pair[1].memory_free)
        budget = int(USABLE_FRACTION["cuda"] * gpu.memory_free)
        least = f" (the least free of the {len(used)} GPUs the run uses)" if len(used) > 1 else ""
        reasons.append(f"GPU {index} {gpu.name}: {gib(gpu.memory_free)} of {gib(gpu.memory_total)} free{least}, "
                       f"planning for {gib(budget)} ({USABLE_FRACTION['cuda']:.0%}) on each GPU the run uses")
        return budget
    fraction = USABLE_FRACTION.get(target, USABLE_FRACTION["cpu"])
    budget = int(fraction * hardware.ram_available)
    if target in ("mps", "mlx") and hardware.apple_silicon:
        limit = hardware.metal_working_set or int(METAL_SHARE * (hardware.unified_memory or hardware.ram_total))
        if limit < budget:
            reasons.append(f"Apple Silicon: Metal's working-set limit {gib(limit)} is below {fraction:.0%} of the "
                           f"{gib(hardware.ram_available)} available")
            budget = limit
        else:
            reasons.append(f"Apple Silicon, {gib(hardware.ram_available)} of {gib(hardware.ram_total)} unified "
                           f"memory available, planning for {gib(budget)}")
    else:
        reasons.append(f"{'MLX on the CPU' if target == 'mlx' else 'no GPU'}: {gib(hardware.ram_available)} of "
                       f"{gib(hardware.ram_total)} {hardware.ram_name} available, planning for {gib(budget)} ({fraction:.0%})")
    return budget


def recommend(hardware: Hardware, requested: LoopSettings, arch: Architecture, *,
              max_positions: int | None = None, examples: int | None = None,
              longest: int | None = None, processes_given: bool = False) -> Recommendation:
    """The settings to run with on this hardware, and why. Fine-tuning: `examples` gives the
    steps per epoch; `longest` (tokens of the longest example) the length to plan memory for,
    since a micro-batch is padded to its longest example, never beyond it. `processes_given`: the
    user set a number of processes (kept, up to the GPUs there are; else one on each GPU)."""
    reasons: list[str] = []
    mode = mode_of(requested)
    key = seq_key(mode)
    target = choose_target(hardware, mode, requested.device, requested.backend)
    precision = choose_precision(hardware, target, requested.precision, reasons, mode)
    processes = plan_processes(hardware, target, requested, reasons, processes_given)
    effective = requested.batch_size * requested.grad_accum * requested_processes(hardware, target, requested)
    if effective % processes:
        processes = max(d for d in range(1, processes + 1) if effective % d == 0)
        reasons.append(f"{processes} processes: the effective batch {effective} must split evenly among them")
    budget = memory_budget(hardware, target, reasons, processes)  # of the GPUs those processes take
    share = effective // processes  # sequences per process per step
    wants_checkpointing = requested.gradient_checkpointing
    cap = getattr(requested, key)
    if max_positions and cap > max_positions:
        cap = max_positions
        reasons.append(f"{key} {cap}: the model has {max_positions} positions")
    planned = cap
    if longest and longest < cap:
        planned = padded_length(target, longest, cap)
        reasons.append(f"memory planned for the longest example, {longest} tokens"
                       + (f" (MLX pads it to {planned})" if planned != longest else "") + f" ({key} {cap} is only a cap)")

    sharding = {"fsdp": requested.fsdp if processes > 1 else False}

    def estimate(batch: int, length: int, checkpointing: bool, grad_accum: int | None = None) -> MemoryEstimate:
        return estimate_run(dataclasses.replace(requested, **sharding), arch, target, batch, length, precision,
                            checkpointing, processes, grad_accum=grad_accum or share // batch)

    def largest(length: int, checkpointing: bool) -> int | None:
        return next((b for b in _divisors_descending(share) if estimate(b, length, checkpointing).total <= budget),
                    None)

    # a pretraining model whose AdamW state does not fit one GPU even at micro-batch 1 with
    # checkpointing is sharded among the processes (FSDP) before anything shorter is tried
    if (processes > 1 and mode == "pretrain" and not sharding["fsdp"]
            and estimate(1, planned, True).total > budget):
        sharding["fsdp"] = True
        reasons.append(f"FSDP (--fsdp): the training state does not fit one GPU; shared among {processes} GPUs "
                       "it does")

    # the longest sequence first; shorter (halved) only when not even one sequence fits
    choice, length = None, planned
    while choice is None and length >= min(SHORTEST_SEQ, planned):
        plain = None if wants_checkpointing else largest(length, False)
        if plain is not None and plain * length >= min(share * length, BUSY_TOKENS.get(target, 1)):
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

    chosen = estimate(batch, length, checkpointing)
    asked = estimate(requested.batch_size, planned, wants_checkpointing)
    settings = dataclasses.replace(requested, batch_size=batch, grad_accum=share // batch,
                                   precision=precision, gradient_checkpointing=checkpointing,
                                   num_processes=str(processes), **sharding,
                                   **{key: length if length < planned else cap})
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    if not fits_at_all:
        reasons.append(f"{DOES_NOT_FIT}micro-batch 1 of {length} tokens with gradient checkpointing needs "
                       f"{gib(chosen.total)}, {gib(budget)} usable")
    else:
        per = f" x {processes} processes" if processes > 1 else ""
        reasons.append(f"micro-batch {batch} x grad_accum {share // batch}{per} keeps the requested effective batch "
                       f"of {effective} sequences; predicted peak {gib(chosen.total)} of {gib(budget)} usable"
                       f"{' per GPU' if processes > 1 else ''}")
        if length < planned:
            one = estimate(1, planned, True)
            kept = (f" (accumulating micro-batches keep the earlier ones' gradients, {gib(one.gradients)}; "
                    f"micro-batch 1 needs {gib(one.total)})" if share > 1 else "")
            reasons.append(f"{key} lowered from {planned} to {length}: one sequence of {planned} tokens does not fit "
                           f"even with gradient checkpointing{kept}")
        if not asked.total <= budget:
            reasons.append(f"the requested micro-batch {requested.batch_size} x {planned} tokens would need "
                           f"{gib(asked.total)}")
        if length < planned and mode == "finetune":
            reasons.append(f"examples longer than {length} tokens are cut to it (or dropped with --drop-long); "
                           f"learning_rate {requested.learning_rate:g} unchanged")
        elif length < planned:
            reasons.append(f"tokens per step fall from {effective * planned:,} to {effective * length:,} (the effective "
                           f"batch counts sequences, now {length} tokens long), and the model trains on {length}-token "
                           f"contexts: {planned // length}x --max-steps sees the same tokens; learning_rate "
                           f"{requested.learning_rate:g} unchanged")
            whole = next((b for b in _divisors_descending(share)
                          if estimate(b, planned, True, grad_accum=1).total <= budget), None)
            if whole is not None:  # without accumulation no earlier micro-batch's gradients are kept
                reasons.append(f"to keep {planned}-token contexts instead: --batch-size {whole} --grad-accum 1 "
                               f"--gradient-checkpointing fits (an effective batch of {whole * processes} sequences, "
                               "not the one asked; lower the learning rate to match)")
        else:
            reasons.append(f"learning_rate {requested.learning_rate:g} unchanged: the effective batch is unchanged")
    if mode == "finetune" and examples:
        steps, epochs = -(-examples // effective), requested.epochs
        reasons.append(f"{examples} training examples / {effective} per step = {steps} steps per epoch, "
                       f"{steps * epochs} for {epochs} epoch{'s' if epochs != 1 else ''}")
    if target == "cpu" and mode == "pretrain" and arch.parameters > 50_000_000:
        reasons.append("training on the CPU: expect hours per thousand steps; a GPU is 10-100x faster")
    return Recommendation(settings, fits_at_all, target, budget, chosen, asked, reasons, planned)


def requested_processes(hardware: Hardware, target: str, requested: LoopSettings) -> int:
    if requested.num_processes == "auto":
        return max(1, len(hardware.gpus)) if target == "cuda" else 1
    return int(requested.num_processes)


def plan_processes(hardware: Hardware, target: str, requested: LoopSettings, reasons: list[str],
                   given: bool = False) -> int:
    """Data-parallel processes: one per GPU, on every GPU there is (Kaggle's 2x T4: both); a number
    the user gave is kept (--compile runs in one process), up to the GPUs there are."""
    gpus = len(hardware.gpus) if target == "cuda" else 0
    if gpus <= 1:
        if given and str(requested.num_processes).isdigit() and int(requested.num_processes) > 1:
            reasons.append(f"--num-processes 1, not {requested.num_processes}: " + (
                "one GPU takes one process" if gpus else
                f"on {'a CPU' if target == 'cpu' else target} one process already uses every core, and several would "
                "share them (no faster, each holding the whole model): data parallelism is for several GPUs"))
        return 1
    if given and str(requested.num_processes).isdigit() and int(requested.num_processes) < gpus:
        asked = max(1, int(requested.num_processes))
        reasons.append(f"--num-processes {asked} as given: {asked} of the {gpus} GPUs ({gpus}: one process on each)")
        return asked
    more = given and str(requested.num_processes).isdigit() and int(requested.num_processes) > gpus
    reasons.append((f"--num-processes {requested.num_processes} is more than the {gpus} GPUs: " if more else
                    f"{gpus} GPUs: ") + f"--num-processes {gpus}, one data-parallel process on each "
                   f"({', '.join(sorted({g.name for g in hardware.gpus}))})")
    return gpus


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]
