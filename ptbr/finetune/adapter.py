"""OUTPUT/adapters: the best LoRA adapter in its library's format (PEFT for torch, mlx-lm for MLX),
with the tokenizer it was trained with (chat template included) and ptbr_adapter.json (data
format, step, val_loss)."""

from __future__ import annotations

import json
from pathlib import Path

from ptbr.errors import ConfigError, ModelError, OutputError
from ptbr.files import is_litter, write_directory
from ptbr.log import log
from ptbr.outputs import enclosing_run

ADAPTER_META = "ptbr_adapter.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapters.safetensors")
# What a Hugging Face model directory holds; a merge may replace a directory of only these.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja", "vocab.json", "merges.txt", ADAPTER_META)


def save_adapter(backend, adapted, tokenizer, directory: Path, meta: dict) -> None:
    """Write the adapter aside, then swap it in: a crash or a full disk leaves the previous one."""

    def fill(tmp: Path) -> None:
        backend.write_adapter(adapted, tmp)
        tokenizer.save_pretrained(str(tmp))
        write_adapter_meta(tmp, meta)

    write_directory(directory, fill, "the adapter")


def check_adapter(adapter: str | Path) -> Path:
    """An adapter directory with its config and weights (PEFT's or mlx-lm's), or a clear error;
    never a silent lookup on a model hub for a missing file."""
    path = Path(adapter)
    if not path.is_dir():
        raise ModelError("adapter directory " + ("is a file" if path.exists() else "not found"), str(adapter),
                         "give the adapters/ directory of a fine-tuning run")
    if not (path / "adapter_config.json").is_file():
        raise ModelError("no adapter_config.json in the adapter directory", str(adapter),
                         "give the adapters/ directory of a fine-tuning run")
    if not any((path / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ModelError("no adapter weights (adapter_model.safetensors) in the adapter directory", str(adapter),
                         "copy the complete adapters/ directory")
    return path


def check_merge_output(output: str | Path, base: str, adapter: str | Path) -> Path:
    """Where a merged model may go: a new or empty directory, or an earlier merge (only a model's
    files, and the ptbr_adapter.json every merge writes); never the base, the adapter, another model
    (a base, a run's final/), a run directory or any other files."""
    def a_model_file(path: Path) -> bool:
        return path.name in MODEL_FILES or (path.is_file() and path.name.startswith("model") and
                                            path.suffix == ".safetensors")

    return check_output(output, "the merge", "the merged model", a_model_file,
                        (("base model", Path(base).expanduser()), ("adapter", Path(adapter))),
                        earlier=lambda folder: (folder / ADAPTER_META).is_file(),
                        not_earlier="a model that no merge wrote (no ptbr_adapter.json: a base, a run's final/, or a merge by "
                        "an older ptbr, which a new merge does not replace: move it aside)", in_a_run="merged")


def check_export_output(output: str | Path, adapter: str | Path, base: str | None) -> Path:
    """Where a converted adapter may go: a new or empty directory, or an earlier export (only
    adapter files: both formats' weights and configs, the files the adapter itself holds, and a
    ptbr_adapter.json saying it was exported); never the adapter, the base, a run's adapters/,
    a run directory or any other files."""
    adapter = Path(adapter)
    own = {*ADAPTER_WEIGHTS, "adapter_config.json", "README.md", ADAPTER_META, *MODEL_FILES}
    own |= {p.name for p in adapter.iterdir()} if adapter.is_dir() else set()
    protected = (("adapter", adapter),) + ((("base model", Path(base).expanduser()),) if base else ())

    def exported(folder: Path) -> bool:  # (converted_from: what exports wrote before exported_from)
        return bool({"exported_from", "converted_from"} & read_adapter_meta(folder).keys())

    return check_output(output, "the export", "the converted adapter", lambda path: path.name in own, protected,
                        earlier=exported, not_earlier="an adapter that no export wrote (a run's adapters/)")


def check_output(output: str | Path, writing: str, thing: str, replaceable, protected, earlier, not_earlier: str,
                 in_a_run: str | None = None) -> Path:
    """Where `thing` may be swapped in whole by `writing`: a new or empty directory, or an earlier
    one (every file `replaceable(path)` accepts it, and `earlier(directory)` recognises it); never a
    `protected` (name, directory), inside one or around one, nor a directory of other files (a run,
    a dataset, notes), nor one of the same files that `writing` did not write (`not_earlier`), nor a
    folder inside a run (its plots/, checkpoints/: `ptbr report` and a re-run would refuse or move
    it) other than the run's own `in_a_run` folder (a fine-tuning run's merged/)."""
    path = Path(output)
    if not str(output).strip():
        raise ConfigError("--output must be a directory path, got an empty one", "--output", f"give a new directory for {thing}")
    resolved = path.expanduser().resolve()
    for name, other in protected:
        if other.exists() and (resolved == other.resolve() or other.resolve() in resolved.parents or
                               resolved in other.resolve().parents):
            raise OutputError(f"--output is or holds the {name}: {writing} would replace it", str(output),
                              f"give a new directory for {thing}")
    outer = enclosing_run(resolved)
    if outer is not None and not (in_a_run and resolved == outer / in_a_run):
        raise OutputError(f"--output is inside the run {outer}, among its files: {writing} would mix with them",
                          str(output), f"give a new directory for {thing}" +
                          (f" ({outer / in_a_run} is the run's own place for it)" if in_a_run else ""))
    if path.exists():
        if not path.is_dir():
            raise OutputError("--output is a file", str(output), f"give a new directory for {thing}")
        other_files = sorted(p.name for p in path.iterdir() if not replaceable(p) and not is_litter(p))
        if other_files:
            shown = ", ".join(other_files[:4]) + (", ..." if len(other_files) > 4 else "")
            raise OutputError(f"--output already holds other files ({shown}): {writing} would replace them",
                              str(output), f"give a new directory for {thing}")
        if any(not is_litter(p) for p in path.iterdir()) and not earlier(path):
            raise OutputError(f"--output holds {not_earlier}: {writing} would replace it", str(output),
                              f"give a new directory for {thing}")
    return path


def write_adapter_meta(directory: Path, meta: dict) -> None:
    """ptbr_adapter.json into a directory being written (an adapter's, a merge's, an export's)."""
    (directory / ADAPTER_META).write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")


def read_adapter_meta(directory: str | Path) -> dict:
    """ptbr_adapter.json of an adapter directory; {} for adapters ptbr did not write, and, with a
    warning (what it records, the data format among it, is then unknown), for one that is damaged."""
    path = Path(directory) / ADAPTER_META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        meta = None
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
    else:
        reason = "not a JSON object"
    if isinstance(meta, dict):
        return meta
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        log(f"warning: {path} cannot be read ({reason}): what it records (the data format the adapter was "
            "trained on, its base) is unknown; copy the adapter directory again")
    return {}


_WARNED: set[str] = set()  # once per process
