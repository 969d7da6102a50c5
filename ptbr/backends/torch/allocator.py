"""Host memory on a CPU: how glibc's malloc hands freed memory back, in one of two settings.

By default glibc serves a large request with its own mmap (from 128 KiB, a bar that rises with what
is freed, up to 32 MiB) and unmaps it when freed, and it gives the heap's free top back to the
kernel past a threshold that follows the bar. A training step frees its activations, logits and
gradients, and the next step asks for the same sizes again: they come back as fresh pages, each
faulting on its first touch (the kernel maps and zeroes it). Measured with torch 2.13 on a 2-core
Xeon: `tiny` in bf16 (8 x 256) faulted 700-10,000 pages a step; `85m` (2 x 256) 24,000-32,000 a
step in fp32 and 38,000-57,000 in bf16; each is a few microseconds of the step.

The rising bar also makes the peak unpredictable: once it has risen, blocks below it stay in the
heap when freed, and micro-batches that free and ask for other sizes grow the heap. `tiny` at
64 x 256, fp32, held 1.93 GiB in four micro-batches and 3.27 GiB at 128 x 256 in two, where the
memory model predicts 1.24 and 1.93 GiB; with the bar fixed at 128 KiB, 1.10 and 1.79 GiB.

So ptbr's CPU runs set one of two, for their process:
- return_freed_memory (from the start): the bar fixed at 128 KiB (setting it stops it rising).
  Freed blocks from 128 KiB go back to the kernel; peaks are the memory model's, so --auto-fit's
  tries and the RAM guard can trust it.
- keep_freed_memory (once a run knows its predicted peak and that peak with what keeping can add
  fits; runs/common.py): the bar at glibc's largest (M_MMAP_THRESHOLD 32 MiB) and no trimming
  (M_TRIM_THRESHOLD at its largest): what a step frees below 32 MiB stays with the process and
  the next step reuses it (those steps then fault no page at all), as jemalloc or tcmalloc would
  (Intel's tuning guides for PyTorch on CPUs preload one for this reason); larger blocks still go
  back to the kernel. That holds more than the prediction: up to 1.76x (`tiny`, 128 x 256 in two
  micro-batches; 1.52x at 64 x 256 in four; within a few percent over the memory model's CPU grid
  of single micro-batches, except `tiny` with gradient checkpointing, 20% more).
Left alone: a C library other than glibc (musl, macOS), an allocator preloaded by the user
(LD_PRELOAD naming a malloc), and malloc settings in the environment (glibc reads them at
start-up): the user chose those.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 * 2**20  # glibc's most on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
DEFAULT_MMAP_THRESHOLD = 128 * 2**10  # glibc's first bar (DEFAULT_MMAP_THRESHOLD_MIN), fixed once set
LARGEST_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's top is given back past 2 GiB free

_DONE: list[bool] = []  # once per process


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # instant (platform.libc_ver reads the binary)
    except (ValueError, OSError, AttributeError):  # not glibc, or no confstr (Windows)
        return False


# what the user may have set for what ptbr would set (glibc reads them at start-up)
MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
MALLOC_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold",
                   "glibc.malloc.top_pad")


def user_chose_the_allocator(environ=os.environ) -> str | None:
    """What says the allocator is the user's to set, or None: a preloaded allocator, or a setting of
    mmap or trimming in glibc's environment variables or tunables."""
    if "malloc" in environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc, tbbmalloc (not libiomp5)
        return f"LD_PRELOAD={environ['LD_PRELOAD']}"
    chosen = [k for k in MALLOC_VARIABLES if k in environ]
    chosen += [k for k in MALLOC_TUNABLES if k in environ.get("GLIBC_TUNABLES", "")]
    return ", ".join(chosen) or None


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Set glibc's malloc parameters, unless the user chose the allocator; True where all were set."""
    if not _glibc() or user_chose_the_allocator() is not None:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([bool(mallopt(parameter, value)) for parameter, value in settings])


def return_freed_memory() -> bool:
    """Fix glibc's mmap bar at 128 KiB (see the module's docstring), unless keep_freed_memory did
    its part already; True where it is now so."""
    if _DONE:
        return False
    return _mallopt((M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD))


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in the process (see the module's docstring); once per process.
    True where it is now so, False where it was left alone."""
    if _DONE:
        return _DONE[0]
    done = _mallopt((M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD), (M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD))
    _DONE.append(done)
    return done


def give_back_freed_memory(always: bool = False) -> None:
    """Return what the heap holds free to the kernel (glibc's malloc_trim), where ptbr stopped the
    trimming: after loading a checkpoint, whose files were read into buffers that were copied into
    the model and freed, a resumed run otherwise kept them for good (an 85m run at 2 x 32 held 1,856
    MiB from its first resumed step, against 1,467 MiB uninterrupted: 126% of the prediction).
    `always`: with glibc's own settings too, whose trimming gives back only the heap's free top:
    after --auto-fit's tries (a throwaway model and its steps) the run started with them held (`tiny`
    at 64 x 4 x 256 in a 1.5 GiB container: nothing left of the limit, and the run was killed)."""
    if not (always and _glibc()) and not (_DONE and _DONE[0]):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)
