"""`ptbr train --compile`: the forward pass and the loss of a training step through torch.compile
(TorchInductor), checked first for what it needs, so that a missing piece is a one-line error
before the run starts, not a compiler traceback at the first step.

Inductor turns the model's small kernels (RMSNorm, rotary embeddings, SiLU x up, the residual adds,
log-softmax and its backward) into a few fused ones and leaves the matrix multiplies and attention
to torch's own kernels; on a CPU it writes C++ (built with the machine's C++ compiler), on a GPU
Triton kernels (whose launcher is built with the C compiler). The compiled code is cached
(TORCHINDUCTOR_CACHE_DIR, by default under the system's temporary directory), so that a later
run of the same shapes starts within seconds.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

from ptbr.errors import ConfigError

# what inductor looks for, in its order: the variable first, then the usual names
CPP_COMPILERS = ("g++", "c++", "clang++")
C_COMPILERS = ("gcc", "cc", "clang")


def compiler_for(device_type: str) -> str | None:
    """The compiler torch.compile will call on this device type, or None when there is none."""
    variable, names = ("CXX", CPP_COMPILERS) if device_type == "cpu" else ("CC", C_COMPILERS)
    given = os.environ.get(variable)
    if given:
        return shutil.which(given.split()[0])
    return next((found for found in map(shutil.which, names) if found), None)


def check_compile(device_type: str | None, processes: int) -> None:
    """Refuse --compile where it cannot run (or has not been tested): every problem at once.
    device_type None: before the device is known (ptbr's launcher checks the processes only)."""
    problems, fixes = [], ["leave --compile out"]
    if device_type is None:
        pass
    elif device_type not in ("cpu", "cuda"):
        problems.append(f"on {device_type} (torch.compile for {device_type} is experimental)")
    elif compiler_for(device_type) is None:
        kind, variable, names = ("C++", "CXX", CPP_COMPILERS) if device_type == "cpu" else ("C", "CC", C_COMPILERS)
        problems.append(f"no {kind} compiler found, which torch.compile needs on {device_type} (none of "
                        f"{', '.join(names)} on PATH, nor ${variable})")
        fixes.append(f"install one (e.g. apt install {names[0]})")
    if processes > 1:
        problems.append(f"a run of {processes} data-parallel processes (--compile is tested in one process only)")
    if problems:
        raise ConfigError(f"--compile: {'; '.join(problems)}", None, ", or ".join(fixes))


def compile_loss(loss):
    """`loss` (module, batch) -> summed cross-entropy, compiled; shapes are static (pretraining's
    are fixed: one compile per micro-batch shape)."""
    import torch

    return torch.compile(loss, dynamic=False)


@contextmanager
def deterministic_kernels():
    """torch's deterministic mode (warnings only where an op has no deterministic kernel) while a
    compiled step's forward and backward run, and are compiled. Left to itself, inductor writes
    the embedding's backward (a scatter-add into the vocabulary's rows) as atomic adds from several
    threads, whose order, and so whose float rounding, changes from run to run: a resumed run
    would drift from the uninterrupted one in the last bits. In deterministic mode it calls torch's
    own kernel for it instead; the same code then gives the same numbers every run."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
