"""What a run's --output may be: a directory of its own, not its inputs' folder, nor one that
holds a dataset or a model, nor one inside another run, nor a file. `ptbr train`/`ptbr finetune` refuse the rest (exit 6,
ptbr/runs/common.py) and `ptbr preflight` fails it (ptbr/preflight/checks.py), in the same words:
the run's files would mix with the data or the model, and starting over would move files there."""

from __future__ import annotations

from pathlib import Path

from ptbr.data import SAMPLE_DIR
from ptbr.data.tokens import dataset_files_in

OWN_OUTPUT_FIX = "give the run a directory of its own with --output (e.g. runs/NAME)"
# what only a run directory holds at its top (a folder named checkpoints/ is anyone's)
RUN_FILES = ("run_config.json", "training_summary.json")
# What makes a directory a model's (weights or an adapter's), never found at the top of a run's
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
               "adapter_model.safetensors", "adapters.safetensors")


def input_refusal(settings) -> tuple[str, str] | None:
    """(why, fix) where `settings.output` is the directory of the run's --data, --valid or --base
    (a file's folder), or a folder inside a dataset's or a model's directory given as one (the
    bundled sample's too, inside the installed package); None where it is none of them."""
    output = Path(settings.output).expanduser().resolve()
    sample = SAMPLE_DIR.resolve()
    if output == sample or sample in output.parents:  # (what a run without --data trains on)
        return "--output is inside ptbr's bundled sample dataset, in the installed package", OWN_OUTPUT_FIX
    for flag in ("data", "valid", "base"):
        value = getattr(settings, flag, None)
        source = Path(value).expanduser() if value else None
        if source is None or not source.exists():
            continue
        if (source.resolve() if source.is_dir() else source.resolve().parent) == output:
            return f"--output is the directory of --{flag} {value}", OWN_OUTPUT_FIX
        # inside a dataset's or a model's directory (prepare or a new download replaces those whole);
        # a folder of JSONL files (`--data .` in a project) may hold runs
        inside = source.is_dir() and source.resolve() in output.parents
        if inside and (dataset_files_in(source) or model_files_in(source)):
            return f"--output is inside the directory of --{flag} {value}", OWN_OUTPUT_FIX
    return None


def model_files_in(folder: str | Path) -> list[str]:
    """The files that make `folder` a model's (a run's final/, a base, an adapter)."""
    return [name for name in MODEL_FILES if (Path(folder) / name).exists()]


def enclosing_run(folder: str | Path) -> Path | None:
    """The run directory `folder` is inside (its plots/, checkpoints/, final/...), known by the
    files only a run writes at its top; None where it is in none."""
    return next((p for p in Path(folder).expanduser().resolve().parents
                 if any((p / name).is_file() for name in RUN_FILES)), None)


def folder_refusal(output: str | Path) -> tuple[str, str] | None:
    """(why, fix) where `output` cannot hold a run: a file, a folder inside another run, a dataset's
    folder, a model's (a run's final/, a base, an adapter); None where it can."""
    folder = Path(output)
    if folder.exists() and not folder.is_dir():
        return "the output path is a file, not a directory", "give --output a directory: a new one, or an earlier run's"
    outer = enclosing_run(folder)
    if outer is not None:
        return f"the output directory is inside the run {outer}, among its files", OWN_OUTPUT_FIX
    dataset = dataset_files_in(folder)
    if dataset:
        return (f"the output directory holds a dataset ({dataset[0]}), not a run",
                f"{OWN_OUTPUT_FIX}; a dataset is what --data names")
    model = model_files_in(folder)
    if model:
        return (f"the output directory holds a model ({model[0]}), not a run",
                f"{OWN_OUTPUT_FIX}; a model is what --base or --model names")
    return None
