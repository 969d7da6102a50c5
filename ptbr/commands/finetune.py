"""`ptbr finetune`."""

from ptbr.commands import quiet_transformers, run_or_launch, settings_from_args
from ptbr.config import FinetuneConfig


def main(args) -> int:
    settings = settings_from_args(FinetuneConfig, args)
    args.output = settings.output  # for the crash report
    quiet_transformers()
    from ptbr.runs.finetune import run_finetune

    return run_or_launch(settings, args, run_finetune)
