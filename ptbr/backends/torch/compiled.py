"""`ptbr train --compile`: the forward pass of a training step (and its loss where it takes the
whole logits) through torch.compile (TorchInductor), checked first for what it needs, so that a
missing piece is a one-line error before the run starts, not a compiler traceback at the first step.

Inductor turns the model's small kernels (RMSNorm, rotary embeddings, SiLU x up, the residual adds,
log-softmax and its backward) into a few fused ones and leaves the matrix multiplies and attention
to torch's own kernels; on a CPU it writes C++ (built with the machine's C++ compiler), on a GPU
Triton kernels (Volta or newer; the launcher is built with the C compiler). With the chunked loss
(ptbr/backends/torch/loss.py) only the decoder, up to its final hidden states, is compiled, and the
loss runs eager on them; on a CUDA GPU in bf16/fp16 the whole 16-bit logits' loss is compiled with
the forward pass instead, where those logits take at most 1 GiB (ptbr.memory.compiled_whole_logits:
faster there, and inductor never makes their fp32 copy). The compiled code is cached
(TORCHINDUCTOR_CACHE_DIR, by default under the system's temporary directory), so that a later
run of the same shapes starts within seconds.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

from ptbr.errors import ConfigError
from ptbr.versions import image_variant

MIN_TRITON_CAPABILITY = (7, 0)  # Triton's GPUs: Volta and newer (Kaggle's P100, 6.0, is not)


def cpp_compilers() -> tuple[str, ...]:
    """The C++ compiler commands inductor tries on a CPU, in its order: $CXX as one command if it
    is set, else g++ (clang++ on macOS); torch's own setting, so that ptbr checks what it runs."""
    from torch._inductor import config

    candidates = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    return tuple(c for c in candidates if c)


def c_compilers() -> tuple[str, ...]:
    """The C compiler Triton builds its GPU launcher with: $CC if set, else gcc, else clang."""
    given = os.environ.get("CC")
    return (given,) if given else ("gcc", "clang")


def cuda_problems(has_triton: bool, capability: tuple[int, int]) -> list[str]:
    """What stops torch.compile on a CUDA GPU of this compute capability."""
    problems = []
    if not has_triton:
        problems.append("Triton is not installed (torch.compile's GPU kernels; it comes with torch's CUDA wheels)")
    if tuple(capability) < MIN_TRITON_CAPABILITY:
        problems.append(f"the GPU's compute capability {capability[0]}.{capability[1]} is below the 7.0 that "
                        "Triton needs")
    return problems


def check_compile(device, processes: int) -> None:
    """Refuse --compile where it cannot run (or has not been tested): every problem at once.
    `device` (a torch.device) None: before the device is known (ptbr's launcher checks the
    processes only)."""
    problems, fixes = [], ["leave --compile out"]
    kind = device.type if device is not None else None
    if kind is not None and kind not in ("cpu", "cuda"):
        problems.append(f"on {kind} (torch.compile for {kind} is experimental)")
    elif kind is not None:
        language, commands = ("C++", cpp_compilers()) if kind == "cpu" else ("C", c_compilers())
        if not any(shutil.which(command) for command in commands):
            variable = "CXX" if kind == "cpu" else "CC"
            problems.append(f"no {language} compiler found, which torch.compile needs on {kind} (tried "
                            f"{', '.join(commands)}; ${variable} names another)")
            variant = image_variant()
            fixes.append(f"build an image of your own with one (the ptbr-{variant} image holds none, and has no "
                         "network or root to add one)" if variant else
                         f"install one (e.g. apt install {'g++' if kind == 'cpu' else 'gcc'})")
        if kind == "cuda":
            import torch
            from torch.utils._triton import has_triton

            problems += cuda_problems(has_triton(), torch.cuda.get_device_capability(device))
    if processes > 1:
        problems.append(f"a run of {processes} data-parallel processes (--compile is tested in one process only)")
        fixes.append("--num-processes 1")
    if problems:
        raise ConfigError(f"--compile: {'; '.join(problems)}", None, ", or ".join(fixes))


def compile_loss(loss, cuda_graphs: bool = False):
    """`loss` (module, batch) -> summed cross-entropy, compiled; shapes are static (pretraining's
    are fixed: one compile per micro-batch shape). `cuda_graphs`: torch.compile's reduce-overhead
    mode, where the compiled forward and backward passes are recorded once as CUDA graphs and then
    replayed, one launch for the hundreds of kernels a small model's step is made of (the caller
    marks each step's start: ptbr/backends/torch/step.py)."""
    import torch

    return torch.compile(loss, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)


def cuda_graphs_refusal(device_type: str, gradient_checkpointing: bool) -> str | None:
    """Why a compiled run's steps cannot replay as CUDA graphs here (None: they can, in a step of
    one micro-batch; under gradient accumulation the second micro-batch's replay would overwrite
    the first one's gradients, which live in the graphs' memory until the update)."""
    if device_type != "cuda":
        return "CUDA graphs are for CUDA GPUs"
    if gradient_checkpointing:
        return "not with --gradient-checkpointing (its recomputation under CUDA graphs is untested)"
    return None


# what --cuda-graphs does where a step replays as CUDA graphs (train's start-up line, preflight)
GRAPHS_REPLAY = "each step's compiled forward and backward passes then replay as CUDA graphs (--no-cuda-graphs: without)"
# why a step whose chunked loss runs eager on the compiled decoder takes no CUDA graphs (train's
# start-up line, preflight; ptbr.memory.loss_compiled_with_forward says which steps those are)
EAGER_LOSS_REFUSAL = ("not where the chunked loss runs eager on the compiled decoder (fp32, or 16-bit logits above "
                      "1 GiB; --no-chunked-loss takes them)")


def accumulation_refusal(micro_batches: int) -> str:
    """Why steps of several micro-batches take no CUDA graphs (train's start-up line, preflight)."""
    return (f"not with {micro_batches} micro-batches a step (a second replay would overwrite the first one's "
            "gradients; --grad-accum 1 with a larger --batch-size takes them)")


@contextmanager
def deterministic_kernels():
    """torch's deterministic mode (warnings only where an op has no deterministic kernel) while a
    compiled step's forward and backward run, and are compiled. Left to itself, inductor writes
    the embedding's backward (a scatter-add into the vocabulary's rows) as atomic adds from several
    threads, whose order, and so whose float rounding, changes from run to run: a resumed run
    would drift from the uninterrupted one in the last bits. In deterministic mode it calls torch's
    own kernel for it instead; the same code then gives the same numbers every run (checked on CPU;
    on a GPU, attention's backward kernels still add atomically, cuDNN's and flash attention's,
    whose notice that they do the CLI hides, see ptbr/cli.py; cuBLAS gave no notice on an H100
    under CUDA 13)."""
    import torch
    from torch.utils import deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = False  # the mode's NaN-filling of new buffers: time, no use here
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]
