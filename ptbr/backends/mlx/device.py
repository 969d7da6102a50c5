"""Where MLX runs (the Metal GPU or the CPU) and in which precision, resolved in one place and
probed for real; the allocator's limits and the memory figures a run reports."""

from __future__ import annotations

from dataclasses import dataclass

from ptbr.errors import DeviceError

# The allocator keeps freed buffers to reuse them in the next step; this share of the device's
# memory (Metal's working set, or the RAM on CPU) is the most it may keep, so that cached buffers
# never crowd out a step's own.
CACHE_SHARE = 0.25


@dataclass(frozen=True)
class MlxPlacement:
    device: str  # gpu (Metal) | cpu
    precision: str  # fp32 | fp16 | bf16
    reason: str

    @property
    def dtype(self):
        """The compute dtype: the frozen base's weights, and the casts of the trainable ones."""
        import mlx.core as mx

        return {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[self.precision]


def metal_available() -> bool:
    import mlx.core as mx

    return bool(mx.metal.is_available())


def resolve_device(name: str) -> str:
    """ptbr's --device for MLX: auto is the Metal GPU where there is one, else the CPU; mps means
    the Metal GPU; cuda is torch's. The device becomes MLX's default, and one array is made on it."""
    import mlx.core as mx

    if name == "cuda":
        raise DeviceError("--device cuda is not a device of the MLX backend", "--backend mlx",
                          "use --backend torch for CUDA GPUs, or --device auto, mps or cpu with --backend mlx")
    metal = metal_available()
    if name == "auto":
        name = "gpu" if metal else "cpu"
    elif name == "mps":
        if not metal:
            raise DeviceError("--device mps but MLX sees no Metal GPU", f"mlx {mx.__version__}",
                              "use --device cpu, or install MLX's Metal build on Apple Silicon (pip install mlx)")
        name = "gpu"
    device = mx.gpu if name == "gpu" else mx.cpu
    try:
        mx.set_default_device(device)
        mx.eval(mx.zeros((1,)))
    except Exception as exc:  # noqa: BLE001 - any failure here means the device is unusable
        raise DeviceError(f"cannot allocate on MLX's {name}: {exc}", name, "use --device cpu") from exc
    return name


def resolve_precision(device: str, requested: str) -> MlxPlacement:
    if requested == "auto":
        if device == "gpu":
            return MlxPlacement(device, "bf16", "Metal GPU: bf16 compute, fp32 master weights and adapters")
        return MlxPlacement(device, "fp32", "cpu: fp32")
    if requested == "fp16":
        # torch's GradScaler has no MLX counterpart: without a loss scale, the gradients that flow back
        # through fp16 activations (about 1/tokens of a step each) fall below fp16's smallest value,
        # and the step silently trains on a fraction of them (measured on mlx[cpu]: relative gradient
        # error 0.19 at 8,192 tokens per step, 0.82 at 65,536; bf16 0.012 at both)
        raise DeviceError("fp16 training on MLX has no loss scaling: small gradients would vanish silently",
                          "--precision fp16", "use --precision bf16 (auto's choice on Metal) or fp32")
    return MlxPlacement(device, requested, f"--precision {requested}")


def working_set_limit() -> int | None:
    """Metal's recommended working set in bytes; None on the CPU (mlx[cpu] reports no such size)."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    value = info.get("max_recommended_working_set_size")
    return int(value) if value else None


def configure_memory(device: str) -> str:
    """Wire the model's memory on Metal (up to the recommended working set, as mlx-lm does, so that
    macOS does not page it out mid-step) and bound the allocator's cache. Returns what was set."""
    import mlx.core as mx
    import psutil

    limit = working_set_limit() if device == "gpu" else None
    said = []
    if limit:
        mx.set_wired_limit(limit)
        said.append(f"wired limit {limit / 1024**3:.1f} GiB")
    cache = int(CACHE_SHARE * (limit or psutil.virtual_memory().total))
    mx.set_cache_limit(cache)
    said.append(f"allocator cache at most {cache / 1024**3:.1f} GiB")
    return ", ".join(said)


def peak_memory() -> int:
    """The most MLX's allocator has held at once in this process (its arrays, not the cache)."""
    import mlx.core as mx

    return int(mx.get_peak_memory())


def memory_report() -> str:
    import mlx.core as mx

    return (f"MLX active {mx.get_active_memory():,} B, peak {mx.get_peak_memory():,} B, "
            f"cache {mx.get_cache_memory():,} B")
