"""Host memory on a CPU: glibc's malloc keeps what a training step frees for the next step.

By default glibc serves a large request with its own mmap (from 128 KiB, a bar that rises with what
is freed, up to 32 MiB) and unmaps it when freed, and it gives the heap's free top back to the
kernel past a threshold that follows the bar. A training step frees its activations, logits and
gradients, and the next step asks for the same sizes again: they come back as fresh pages, each
faulting on its first touch (the kernel maps and zeroes it). Measured with torch 2.13 on a 2-core
Xeon: `tiny` in bf16 (8 x 256) faulted 700-10,000 pages a step; `85m` (2 x 256) 24,000-32,000 a
step in fp32 and 38,000-57,000 in bf16; each is a few microseconds of the step.

ptbr's CPU runs fix the bar at glibc's largest (M_MMAP_THRESHOLD 32 MiB) and stop the trimming
(M_TRIM_THRESHOLD at its largest), for their process: what a step frees below 32 MiB stays with
the process and the next step reuses it (those steps then fault no page at all), as jemalloc or
tcmalloc would (Intel's tuning guides for PyTorch on CPUs preload one for this reason); larger
blocks still go back to the kernel. Peak resident memory stayed within a few percent of glibc's
default over the memory model's CPU grid (benchmarks/memory_accuracy.py), except `tiny` with
gradient checkpointing (20% more), where turning mmap off altogether (M_MMAP_MAX 0) held up to a
quarter more at several points. Left alone: a C library other than glibc (musl, macOS), an
allocator preloaded by the user (LD_PRELOAD naming a malloc), and malloc settings in the
environment (glibc reads them at start-up): the user chose those.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 * 2**20  # glibc's most on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
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


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in the process (see the module's docstring); once per process.
    True where it is now so, False where it was left alone."""
    if _DONE:
        return _DONE[0]
    done = False
    if _glibc() and user_chose_the_allocator() is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            done = (bool(mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD))
                    and bool(mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)))
    _DONE.append(done)
    return done


def give_back_freed_memory() -> None:
    """Return what the heap holds free to the kernel (glibc's malloc_trim), where ptbr stopped the
    trimming: after loading a checkpoint, whose files were read into buffers that were copied into
    the model and freed, a resumed run otherwise kept them for good (an 85m run at 2 x 32 held 1,856
    MiB from its first resumed step, against 1,467 MiB uninterrupted: 126% of the prediction)."""
    if not (_DONE and _DONE[0]):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)
