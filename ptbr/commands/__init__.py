"""One module per CLI command; each exposes main(args) -> exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ptbr.config import PRESETS, build_settings, read_config_file, settings_fields
from ptbr.errors import ConfigError, collect
from ptbr.log import log


def settings_from_args(cls: type, args: argparse.Namespace):
    """Settings from defaults < --config file < flags given on the command line."""
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    names = [f.name for f, _ in settings_fields(cls)]
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return build_settings(cls, file_values, overrides, source=args.config or "flags")


def end_a_failed_rank(code: int) -> None:
    """After a command failed with `code`: a rank of a data-parallel run whose process group is still
    open ends at once (ptbr/backends/torch/distributed.py exit_a_failed_rank); otherwise nothing."""
    if "torch.distributed" in sys.modules:  # no torch imported: no group
        from ptbr.backends.torch.distributed import exit_a_failed_rank

        exit_a_failed_rank(code)


def stopped_by_another_rank(exc: Exception, command: str):
    """In a rank of a data-parallel run, a collective that failed because another rank's process
    went away (ptbr/backends/torch/distributed.py stopped_by_another_rank): the Interrupted error
    to report instead of a crash; None otherwise (and where torch.distributed was never imported)."""
    if "torch.distributed" not in sys.modules:
        return None
    from ptbr.backends.torch.distributed import stopped_by_another_rank as by_another

    return by_another(exc, command)


def processes_to_launch(settings) -> int:
    """How many workers `--num-processes` asks ptbr to start; 1: run in this process. Inside a
    worker (torchrun, `accelerate launch`, or ptbr's own launch) the launcher has already decided."""
    from ptbr.backends import resolve_name

    inside = os.environ.get("WORLD_SIZE")
    if resolve_name(settings.backend) == "mlx":
        refuse_torch_options_on_mlx(settings, inside)
        note_torch_options_mlx_ignores(settings)
        return 1
    if inside:
        if settings.num_processes not in ("auto", "1", inside):
            raise ConfigError(f"--num-processes {settings.num_processes} in a run of {inside} processes", "--num-processes",
                              "let the launcher (torchrun / accelerate launch) decide, or leave --num-processes out")
        return 1
    if settings.num_processes == "1":
        return 1
    if settings.num_processes == "auto":
        from ptbr.backends.torch.distributed import visible_gpus

        return max(1, visible_gpus())
    return int(settings.num_processes)


def refuse_torch_options_on_mlx(settings, inside: str | None) -> None:
    """The MLX backend trains in one process: data parallelism and FSDP are torch's, and so are
    --lora-dropout-impl and --compile. --num-processes auto means one process there (no CUDA GPUs to spread over)."""
    problems = []
    if settings.num_processes not in ("1", "auto"):
        problems.append(f"--num-processes {settings.num_processes}: data parallelism runs on the torch backend")
    if getattr(settings, "fsdp", False):
        problems.append("--fsdp: sharding among processes runs on the torch backend")
    if getattr(settings, "lora_dropout_impl", "auto") != "auto":
        problems.append(f"--lora-dropout-impl {settings.lora_dropout_impl}: a torch backend option (MLX draws its "
                        "own dropout masks)")
    if getattr(settings, "compile", False):
        problems.append("--compile: a torch backend option (the MLX backend always compiles its step)")
    options_given = bool(problems)
    launched = bool(inside) and inside != "1"
    if launched:
        problems.append(f"started as one of {inside} processes (torchrun / accelerate launch): the MLX backend "
                        "trains in one")
    fix = ("leave these torch options out with --backend mlx, or use --backend torch" if options_given
           else "use --backend torch")
    if launched:
        fix += ", or start the MLX backend as one process (`ptbr ...`, not torchrun or accelerate launch)"
    collect(problems, ConfigError, "--backend mlx", fix)


def note_torch_options_mlx_ignores(settings) -> None:
    """The torch options that turn something off which the MLX backend never does: nothing to
    refuse (the run is what they ask for), but a line, so that nobody takes them for a change.
    Unlike --compile or --lora-dropout-impl, which ask for what MLX cannot do, and are refused."""
    if not getattr(settings, "chunked_loss", True):
        log("note: --no-chunked-loss changes nothing on the MLX backend: its loss always takes the whole logits")
    if not getattr(settings, "cuda_graphs", True):
        log("note: --no-cuda-graphs changes nothing on the MLX backend: CUDA graphs are the torch backend's "
            "(under --compile on a CUDA GPU)")


def run_or_launch(settings, args: argparse.Namespace, run) -> int:
    """run(settings) here, or in `--num-processes` workers started by torchrun's launcher."""
    processes = processes_to_launch(settings)
    if processes == 1:
        run(settings)
        return 0
    if getattr(settings, "compile", False):
        from ptbr.backends.torch.compiled import check_compile

        check_compile(None, processes)  # refused here, before any worker starts
    from pathlib import Path

    from ptbr.backends.torch.distributed import launch, visible_gpus
    from ptbr.cpus import usable_cpus
    from ptbr.files import first_missing
    from ptbr.runs.common import (
        WORKER_LOGS,
        check_before_launch,
        remove_a_launch_that_never_started,
    )

    gpus, cores = visible_gpus(), usable_cpus()
    if gpus and processes > gpus:
        log(f"warning: {processes} processes on {gpus} GPU(s): ranks share a GPU (one process per GPU is the usual)")
    elif not gpus and processes > cores:
        log(f"warning: {processes} processes on {cores} CPU cores: each rank gets a fraction of a core, and the run "
            "is slower than with fewer (on a CPU, data parallelism is for testing a multi-GPU setup)")
    check_before_launch(settings)
    made = first_missing(Path(settings.output))  # the topmost folder the launch creates
    logs = Path(settings.output) / WORKER_LOGS
    log(f"starting {processes} data-parallel processes (rank 0 reports here; the others log to {logs})")
    code = launch(processes, args.argv, logs, debug=getattr(args, "debug", False))
    if code and made is not None:
        remove_a_launch_that_never_started(Path(settings.output), code, made)
    return code


def check_preset_request(command: str, model_size: str, seq_len: int, **sizes: int) -> None:
    """For commands that build or size a preset without a full settings object (info, test-gpu):
    every bad value at once, as exit 2, before anything is built."""
    problems = [f"--{name.replace('_', '-')} must be > 0, got {value}"
                for name, value in (("seq_len", seq_len), *sizes.items()) if value <= 0]
    if model_size not in PRESETS:
        problems.append(f"unknown model size {model_size!r} (valid: {', '.join(PRESETS)})")
    elif seq_len > PRESETS[model_size].max_position_embeddings:
        problems.append(f"--seq-len {seq_len} exceeds the {model_size} model's maximum of "
                        f"{PRESETS[model_size].max_position_embeddings} positions")
    collect(problems, ConfigError, f"ptbr {command}", "give a listed model size and sizes within its limits "
            f"(`ptbr {command} --help`)")


def quiet_transformers() -> None:
    """transformers' own progress bars (e.g. 'Writing model shards') would interleave with ours, and
    its warnings speak to developers; with --debug (ptbr's log at DEBUG) they stay."""
    from transformers.utils import logging as hf_logging

    from ptbr.log import logger

    hf_logging.disable_progress_bar()
    if logger.isEnabledFor(logging.DEBUG):
        hf_logging.set_verbosity_warning()
    else:
        hf_logging.set_verbosity_error()
