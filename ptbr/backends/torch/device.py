"""Device and precision, resolved in one place and probed for real."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass

from ptbr.errors import DeviceError


@dataclass(frozen=True)
class Placement:
    device: object  # torch.device
    precision: str  # fp32 | fp16 | bf16
    reason: str

    @property
    def autocast_dtype(self):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.precision)

    def autocast(self):
        """Mixed precision for the forward pass; plain fp32 needs no context (nanoGPT style)."""
        import torch

        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def has_real_bf16() -> bool:
    """True only where the GPU computes bf16 natively (Ampere+); a T4 only emulates it."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False))


def cpu_bf16_units() -> list[str]:
    """The CPU's units that multiply bf16 matrices in hardware (x86 AMX, AVX512-BF16), as torch's
    own CPU probes see them."""
    import torch

    probes = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    return [unit for unit, name in probes if getattr(torch.cpu, name, lambda: False)()]


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 matrices in hardware: there oneDNN runs bf16 matmuls
    about twice as fast as fp32 ones."""
    return bool(cpu_bf16_units())


def resolve_device(name: str):
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda but torch sees no CUDA GPU", f"torch {torch.__version__}",
                          "check nvidia-smi and that torch is a CUDA build, or use --device cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise DeviceError("--device mps but Metal (MPS) is not available", f"torch {torch.__version__}",
                          "use --device cpu")
    device = torch.device(name)
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # noqa: BLE001 - any failure here means the device is unusable
        raise DeviceError(f"cannot allocate on {name}: {exc}", name, "check the driver, or use --device cpu") from exc
    return device


def resolve_precision(device, requested: str, pretraining: bool = False) -> Placement:
    """The run's precision on `device`; `auto` as ptbr.precision.auto_precision rules (on a CPU,
    bf16 only for pretraining)."""
    import torch

    from ptbr.precision import auto_precision

    kind = device.type
    if requested == "auto":
        native = has_real_bf16() if kind == "cuda" else (kind == "cpu" and pretraining and cpu_has_native_bf16())
        chosen = auto_precision(kind, native, pretraining)
        reason = {("cuda", "bf16"): "the GPU has native bf16",
                  ("cuda", "fp16"): "the GPU has no native bf16 (T4-class): fp16 with GradScaler",
                  ("cpu", "bf16"): "the CPU computes bf16 natively: autocast, fp32 weights; --precision fp32 for "
                                   "fp32 throughout"}.get((kind, chosen), f"{kind}: {chosen}")
        return Placement(device, chosen, reason)
    if requested == "fp16" and kind == "cpu":
        raise DeviceError("fp16 training needs a GPU", "--precision fp16", "use --precision fp32 (or bf16) on CPU")
    if requested == "bf16" and kind == "cuda" and not has_real_bf16():
        name = torch.cuda.get_device_name(device)
        raise DeviceError(f"{name} has no native bf16 (only emulated, far slower)", "--precision bf16",
                          "use --precision fp16 (or auto) on this GPU")
    return Placement(device, requested, f"--precision {requested}")


def peak_memory(device) -> int:
    """The most memory this process has held so far, the figure the memory model predicts: on a
    CUDA GPU the allocator's peak (torch.cuda.max_memory_allocated, since the process started or
    its peak statistics were last reset); on the CPU (and MPS) the process's peak resident set,
    the interpreter, libraries and data loading included (peak_resident_bytes)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return peak_resident_bytes()


def reset_peak_memory(device) -> None:
    """Start the peak over (after --auto-fit's tries, whose peaks are not the run's): the allocator's
    on a GPU; on Linux the process's high-water mark (VmHWM; writing 5 to /proc/self/clear_refs
    sets it to what is resident now). Elsewhere a CPU's peak cannot be reset and stays."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def peak_resident_bytes() -> int:
    """The process's peak resident set size in bytes.

    Linux: VmHWM of /proc/self/status, the high-water mark of this process's own address space.
    Not ru_maxrss there: a process started by exec from a larger one (Python's subprocess, a
    notebook's `!ptbr ...`) inherits in ru_maxrss the peak of the process it replaced (a 10 MiB
    child of a 1.5 GiB Python process: ru_maxrss 1.5 GiB, VmHWM 10 MiB).
    Elsewhere getrusage's ru_maxrss: bytes on macOS, KiB on the other Unixes; on Windows (no
    `resource` module) psutil's peak working set."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def fit_threads_to_cpus() -> str | None:
    """torch's CPU thread pool within the CPUs this process may use (ptbr/cpus.py: a container's CPU
    quota, a cpuset): torch counts the machine's cores, and a quota below them throttles every step.
    OMP_NUM_THREADS, where set, is the user's (or a data-parallel launcher's) choice and is kept.
    Returns the line that says what changed, None where nothing did."""
    import os

    import torch

    from ptbr.cpus import processes_on_this_machine, usable_cpus

    # the ranks of a data-parallel run on this machine share them (torchrun, accelerate and ptbr's
    # launcher set OMP_NUM_THREADS themselves; srun or mpirun may not)
    threads, usable = torch.get_num_threads(), max(1, usable_cpus() // processes_on_this_machine())
    if "OMP_NUM_THREADS" in os.environ or threads <= usable:
        return None
    torch.set_num_threads(usable)
    many = "s" if usable > 1 else ""
    return (f"torch: {usable} CPU thread{many}, not {threads}: this process may use {usable} CPU{many} (a container's "
            "CPU quota or a CPU affinity), and more threads would be throttled")
