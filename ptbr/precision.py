"""What `--precision auto` trains in: the one rule that a run (ptbr/backends/torch/device.py
resolve_precision) and preflight's plan (ptbr/preflight/recommend.py choose_precision) both apply.
No torch here: each caller says what its device computes natively (the run probes torch, preflight
reads its hardware report)."""

from __future__ import annotations


def auto_precision(device: str, native_bf16: bool, pretraining: bool) -> str:
    """bf16 on a CUDA GPU that computes it natively, else fp16 with GradScaler there (T4-class);
    bf16 autocast on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX), for pretraining only
    (measured about 1.6x faster at 85m; fine-tuning was not faster in bf16 there and took more
    memory); bf16 on MLX; fp32 everywhere else (CPU, MPS)."""
    if device == "cuda":
        return "bf16" if native_bf16 else "fp16"
    if device == "mlx":
        return "bf16"
    if device == "cpu" and native_bf16 and pretraining:
        return "bf16"
    return "fp32"
