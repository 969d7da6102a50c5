"""`ptbr train`."""

from ptbr.commands import quiet_transformers, run_or_launch, settings_from_args
from ptbr.config import PretrainConfig


def main(args) -> int:
    settings = settings_from_args(PretrainConfig, args)
    args.output = settings.output  # for the crash report
    quiet_transformers()
    from ptbr.runs.pretrain import run_pretrain

    return run_or_launch(settings, args, run_pretrain)
