"""`ptbr preflight`: check hardware, packages, data, model and disk before a run; predict its memory;
write DIR/preflight_report.json and DIR/recommended_config.json. Exit 10 when a check fails."""

from __future__ import annotations

import dataclasses
import os

from ptbr.errors import ConfigError, PreflightFailed

MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}


def main(args) -> int:
    from ptbr.commands import quiet_transformers
    from ptbr.preflight import run_preflight
    from ptbr.preflight.settings import requested_settings

    settings, given = requested_settings(args.mode, args)
    args.output = settings.output  # for the crash report
    hardware, kaggle = None, args.plan_for == "kaggle"
    if kaggle:
        from ptbr.kaggle.bundle import KAGGLE_BACKENDS, KAGGLE_DEVICES, KAGGLE_GPUS
        from ptbr.kaggle.layout import KAGGLE_RUN_DEFAULTS
        from ptbr.preflight.hardware import KAGGLE_T4X2

        if args.load_test:
            raise ConfigError("--load-test loads the model on this machine, not on Kaggle's", "--for kaggle",
                              "leave --load-test out: the kernel runs preflight on the T4s before training")
        if settings.device not in KAGGLE_DEVICES or settings.backend not in KAGGLE_BACKENDS:
            raise ConfigError(f"--device {settings.device} --backend {settings.backend} is not on Kaggle", "--for kaggle",
                              f"use --device {' or '.join(KAGGLE_DEVICES)} and --backend {' or '.join(KAGGLE_BACKENDS)}")
        if str(settings.num_processes).isdigit() and int(settings.num_processes) > KAGGLE_GPUS:
            raise ConfigError(f"--num-processes {settings.num_processes} is more than Kaggle's {KAGGLE_GPUS} GPUs",
                              "--for kaggle", f"give auto (one per GPU), or {KAGGLE_GPUS} or fewer")
        hardware = KAGGLE_T4X2
        # the bundle's defaults where the settings say nothing: a process on each T4, two checkpoints kept
        defaults = {key: value for key, value in KAGGLE_RUN_DEFAULTS.items() if key not in given}
        settings, given = dataclasses.replace(settings, **defaults), given | set(defaults)
        # what `auto` is there (torch: the bundle installs no MLX), not what it is on this machine (a Mac's MLX)
        settings = dataclasses.replace(settings, backend="torch")
    rank = launched_rank()
    if rank is not None and not kaggle:
        settings, given = as_launched(settings, given)
    quiet_transformers()
    # another rank of a launch (torchrun, accelerate launch) checks too; rank 0 prints the report and writes it
    result = run_preflight(settings, hardware, load_weights=args.load_test, given=given, write=not rank,
                           elsewhere=kaggle)
    if rank:
        print_failures(result, rank)
    else:
        print_result(result, kaggle)
    if result.failed:
        names = ", ".join(c.name for c in result.failed)
        raise PreflightFailed(f"{len(result.failed)} check(s) failed{f' on rank {rank}' if rank else ''}: {names}",
                              str(result.report_path or settings.output), "apply the fixes listed above, then run "
                              "preflight again")
    return 0


def launched_rank() -> int | None:
    """This process's rank where a launcher (torchrun, `accelerate launch`) started several of
    them, each running `ptbr preflight`; None for a single process."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return int(os.environ.get("RANK", "0") or 0)


def as_launched(settings, given: set[str]):
    """Under a launcher of N processes, the run is those N (`ptbr train` under it refuses another
    --num-processes, exit 2, and so does this): planned as `--num-processes N` given, so that
    recommended_config.json holds a number the run under the same launcher takes, not one process
    on every GPU of the machine."""
    from ptbr.commands import processes_to_launch

    processes_to_launch(settings)  # the refusals train makes inside a launcher
    return dataclasses.replace(settings, num_processes=os.environ["WORLD_SIZE"]), given | {"num_processes"}


def print_failures(result, rank: int) -> None:
    """A rank other than 0 of a launch: its failed checks alone, each naming the rank (rank 0
    prints the whole report; the ranks of one machine would print the same one again)."""
    width = max((len(c.name) for c in result.failed), default=0)
    for check in result.failed:
        print(f"rank {rank}: {MARK[check.status]}  {check.name:<{width}}  {check.message}")
        if check.fix:
            print(f"rank {rank}:       {'':<{width}}  fix: {check.fix}")


def print_result(result, kaggle: bool = False) -> None:
    counts = result.summary()
    print(f"preflight ({result.mode}): {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail")
    width = max(len(c.name) for c in result.checks)
    for check in result.checks:
        print(f"{MARK[check.status]}  {check.name:<{width}}  {check.message}")
        if check.fix and check.status != "pass":
            print(f"      {'':<{width}}  fix: {check.fix}")
    rec = result.recommendation
    if rec is not None:
        print("recommendation:")
        for reason in rec.reasons:
            print(f"  - {reason}")
    if result.report_path:
        print(f"report: {result.report_path}")
    elif any(c.name == "disk.output" for c in result.failed):
        print("report: not written (the --output a run would refuse, see disk.output above)")
    if result.config_path:
        command = "train" if result.mode == "pretrain" else "finetune"
        print(f"recommended config: {result.config_path}")
        if kaggle:  # the config holds the data and base planned with (none: the PT-BR sample, as in the bundle)
            from ptbr.preflight.checks import KAGGLE_BASE

            mode = "" if result.mode == "pretrain" else " --mode finetune"
            if any(c.name == "model.weights" for c in result.checks):  # planned from a config.json: the model on Kaggle
                mode += f" {KAGGLE_BASE}"
            print(f"next: ptbr kaggle bundle --config {result.config_path} --owner YOUR_KAGGLE_USERNAME --slug NAME "
                  f"--output bundles/NAME{mode}")
        else:
            print(f"next: ptbr {command} --config {result.config_path}")
