"""Hardware facts as plain data, and the probe that gathers them without ever raising.

Everything downstream (checks, the recommender, tests) reads a `Hardware` object, so tests inject
a 16 GB T4 or an 8 GB Mac by building one, and nothing there needs the real machine.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ptbr.cpus import usable_cpus

GIB = 1024**3


@dataclass
class GPU:
    name: str
    memory_total: int  # bytes
    memory_free: int  # bytes, as seen by a process that holds a CUDA context (as training will)
    compute_capability: str  # "7.5" on a T4, "9.0" on an H100
    real_bf16: bool  # native bf16 (Ampere, compute 8.0, and newer); a T4 only emulates it
    driver: str | None = None


@dataclass
class Hardware:
    os: str
    cpu_cores: int  # logical, as torch counts them for its threads
    ram_total: int  # bytes
    ram_available: int  # bytes
    gpus: list[GPU] = field(default_factory=list)
    apple_silicon: bool = False
    unified_memory: int | None = None  # bytes shared by CPU and GPU on Apple Silicon
    metal_working_set: int | None = None  # Metal's recommended maximum working set (from mlx)
    in_kaggle: bool = False
    cpu_bf16: bool = False  # the CPU multiplies bf16 natively (AVX512-BF16 or AMX), as torch probes it
    torch_cuda: str | None = None  # the CUDA version torch was built with; None: a CPU build
    notes: list[str] = field(default_factory=list)  # what the probe could not find out, and why
    # a container's (cgroup's) memory limit, where tighter than the RAM: ram_total and ram_available are within it
    ram_limit: int | None = None

    @property
    def ram_name(self) -> str:
        return "RAM" if self.ram_limit is None else "RAM (the container's memory limit)"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        data = dict(data)
        data["gpus"] = [GPU(**gpu) for gpu in data.get("gpus", [])]
        return cls(**data)


# What `ptbr preflight --for kaggle` plans for: the kernel `ptbr kaggle bundle` makes asks for
# Kaggle's "NvidiaTeslaT4" machine, two 16 GB T4s (15.8 GB as CUDA counts them, 15.6 free to a
# process holding a context), 4 CPUs and about 29 GB of RAM, with a CUDA build of torch.
KAGGLE_T4 = GPU("Tesla T4", memory_total=15_828_320_256, memory_free=15_642_001_408, compute_capability="7.5",
                real_bf16=False)
KAGGLE_T4X2 = Hardware("Kaggle kernel, NvidiaTeslaT4 (planned for, not probed)", 4, 31 * GIB, 29 * GIB,
                       [KAGGLE_T4, KAGGLE_T4], in_kaggle=True, torch_cuda="12")


def has_real_bf16(compute_capability: str) -> bool:
    try:
        return int(compute_capability.split(".")[0]) >= 8
    except (ValueError, AttributeError):
        return False


def in_kaggle() -> bool:
    return "KAGGLE_KERNEL_RUN_TYPE" in os.environ or Path("/kaggle/working").is_dir()


def probe_hardware(use_torch: bool = True) -> Hardware:
    """What this machine has. Never raises: a fact that cannot be read is left empty and the
    reason goes to `notes` (a diagnostic must not crash itself)."""
    notes: list[str] = []
    hardware = Hardware(os=f"{platform.system()} {platform.release()} {platform.machine()}",
                        cpu_cores=usable_cpus(), ram_total=0, ram_available=0, in_kaggle=in_kaggle())
    try:
        from ptbr.ram import ram

        memory = ram()
        hardware.ram_total, hardware.ram_available, hardware.ram_limit = memory.total, memory.available, memory.limit
    except Exception as exc:  # noqa: BLE001
        notes.append(f"RAM unknown: {type(exc).__name__}: {exc}")
    hardware.apple_silicon = platform.system() == "Darwin" and platform.machine() == "arm64"
    if hardware.apple_silicon:
        hardware.unified_memory = hardware.ram_total or None
        hardware.metal_working_set = _metal_working_set(notes)
    if use_torch:
        _probe_with_torch(hardware, notes)
    hardware.notes = notes
    return hardware


def _probe_with_torch(hardware: Hardware, notes: list[str]) -> None:
    """What torch sees: its CUDA build and GPUs, and whether the CPU multiplies bf16 natively."""
    try:
        import torch

        from ptbr.backends.torch.device import cpu_has_native_bf16
    except Exception as exc:  # noqa: BLE001
        notes.append(f"torch cannot be imported: {type(exc).__name__}: {exc}")
        return
    hardware.torch_cuda = torch.version.cuda
    try:
        hardware.cpu_bf16 = cpu_has_native_bf16()
    except Exception as exc:  # noqa: BLE001
        notes.append(f"CPU bf16 support unknown: {type(exc).__name__}: {exc}")
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # noqa: BLE001
        notes.append(f"CUDA unusable: {type(exc).__name__}: {exc}")
        return
    drivers = _nvidia_drivers(notes) if count else []
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            capability = f"{props.major}.{props.minor}"
            hardware.gpus.append(GPU(props.name, int(total), int(free), capability, has_real_bf16(capability),
                                     drivers[index] if index < len(drivers) else None))
        except Exception as exc:  # noqa: BLE001
            notes.append(f"GPU {index} unreadable: {type(exc).__name__}: {exc}")


def _nvidia_drivers(notes: list[str]) -> list[str]:
    if not shutil.which("nvidia-smi"):
        notes.append("nvidia-smi not found: driver version unknown")
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=True)
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]
    except Exception as exc:  # noqa: BLE001
        notes.append(f"nvidia-smi failed: {type(exc).__name__}")
        return []


def _metal_working_set(notes: list[str]) -> int | None:
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        value = info.get("max_recommended_working_set_size")
        return int(value) if value else None
    except Exception as exc:  # noqa: BLE001
        notes.append(f"Metal working set unknown (mlx: {type(exc).__name__}: {exc})")
        return None
