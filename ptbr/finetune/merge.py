"""Merging a LoRA adapter into its base: a full model that loads without peft, with the adapter's
tokenizer (chat template included) and its ptbr_adapter.json (the data format it was trained on).
An mlx-lm adapter (the MLX backend's) is converted to PEFT's format first (ptbr/finetune/export.py),
so that both formats go through the one merge; where torch is not installed (a Mac with the MLX path
only), MLX merges instead (ptbr/backends/mlx/merge.py), a PEFT adapter converted to mlx-lm's format.

The base is always loaded unquantized (a QLoRA run trained on NF4 weights: its adapter is merged
into the original weights, in the base's own dtype unless asked otherwise), on the CPU, so that a
GPU busy with training is not needed: a 7B model in bf16 takes about 15 GB of RAM here.
"""

from __future__ import annotations

from contextlib import ExitStack
from importlib.util import find_spec
from pathlib import Path

from ptbr.backends.torch.lora import refuse_prequantized
from ptbr.errors import ConfigError, ModelError
from ptbr.files import telling_line, write_directory
from ptbr.finetune.adapter import (
    check_adapter,
    check_merge_output,
    read_adapter_meta,
    write_adapter_meta,
)
from ptbr.finetune.base import check_base, files_only, load_error, local_path, model_files_only
from ptbr.finetune.export import adapter_as, adapter_format
from ptbr.log import log

DTYPES = ("auto", "fp32", "bf16", "fp16")


def merge_adapter(base: str, adapter: str | Path, output: str | Path, dtype: str = "auto",
                  trust_remote_code: bool = False, download: bool = False) -> Path:
    """Write base + adapter, merged, to `output` (written aside, then renamed into place). With
    torch installed PEFT merges (either format); without it, MLX does (ptbr/backends/mlx/merge.py)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", "--dtype", f"use one of: {', '.join(DTYPES)}")
    adapter = check_adapter(adapter)
    adapter_format(adapter)  # PEFT's or mlx-lm's weights with their config, else a ModelError naming the file
    output = check_merge_output(output, base, adapter)
    check_base(base, download)
    if find_spec("torch") is None and find_spec("mlx") is not None:
        return _merge_with_mlx(base, adapter, output, dtype, trust_remote_code, download)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    refuse_prequantized(base, "give the original (unquantized) model the adapter was trained on: a merge needs its "
                        "full weights")
    torch_dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                     **model_files_only(base, download))
        tokenizer_dir = adapter if (adapter / "tokenizer_config.json").is_file() else base
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code,
                                                  local_files_only=files_only(str(tokenizer_dir), download))
    except Exception as exc:  # noqa: BLE001
        raise load_error("base model", base, exc) from exc
    with ExitStack() as stack:  # an mlx-lm adapter is merged through its PEFT conversion
        merged = apply_adapter(model, Path(adapter_as(adapter, "peft", stack))).merge_and_unload()

    meta = merged_meta(base, adapter)

    def fill(tmp: Path) -> None:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        write_adapter_meta(tmp, meta)

    write_directory(output, fill, "the merged model")
    log(f"merged {adapter} into {base}: full model ({merged.dtype}) in {output}")
    return output


def merged_meta(base: str, adapter: Path) -> dict:
    """A merged model's ptbr_adapter.json: the adapter's (the data format it was trained on, which
    `ptbr generate` formats prompts by), and what was merged, which also marks the directory as a
    merge's (a later merge may replace it; generate applies no adapter on top of it)."""
    return read_adapter_meta(adapter) | {"merged_from": {"base": local_path(base), "adapter": str(adapter.resolve())}}


def apply_adapter(model, adapter: Path):
    """The PEFT adapter on `model`; an adapter that cannot be read, or was trained on another base,
    is one ModelError that says which of the two it is."""
    import warnings

    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    fix = "give the base model the adapter was trained on (its ptbr_adapter.json names it)"
    try:
        with warnings.catch_warnings():  # a module without weights is refused below, in one line
            warnings.filterwarnings("ignore", message="Found missing adapter keys")
            adapted = PeftModel.from_pretrained(model, str(adapter), local_files_only=True)
        # a base with more layers (or more of the adapted modules) than the adapter's: PEFT adds
        # LoRA modules the file has no weights for, and only warns. LoRA tensors only: embedding
        # layers saved or not with the adapter are PEFT's business (and save_embedding_layers="auto"
        # would look the base up on the Hub)
        created = {k for k in get_peft_model_state_dict(adapted, save_embedding_layers=False) if "lora_" in k}
        saved = {k for k in load_peft_weights(str(adapter)) if "lora_" in k}
        missing = sorted(created - saved)
        # a base with fewer layers: PEFT skips the file's tensors that no module takes, silently
        unused = sorted(saved - created, key=_in_layer_order)
    except Exception as exc:  # noqa: BLE001 - peft raises many kinds; all mean "this adapter cannot be used here"
        reason = telling_line(exc)  # torch's first line only says "Error(s) in loading state_dict for X:"
        if "size mismatch" in str(exc) or "shape" in str(exc).lower() or "Missing key" in str(exc):
            raise ModelError(f"the adapter does not fit this base model: {reason}", str(adapter), fix) from exc
        raise ModelError(f"the adapter cannot be loaded: {reason}", str(adapter),
                         "check that the adapter directory is complete and uncorrupted (OUTPUT/adapters)") from exc
    if missing:
        raise ModelError(f"the adapter does not fit this base model: it holds no weights for {len(missing)} LoRA "
                         f"tensors this base takes (e.g. {missing[0]}): not the base it was trained on (more layers?)",
                         str(adapter), fix)
    if unused:
        raise ModelError(f"the adapter does not fit this base model: the base has no module for {len(unused)} of its "
                         f"LoRA tensors (e.g. {unused[0]}): not the base it was trained on (fewer layers?)",
                         str(adapter), fix)
    return adapted


def _in_layer_order(key: str) -> tuple:
    """A LoRA tensor's name, its numbers compared as numbers (layers.2 before layers.10)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split("."))


def _merge_with_mlx(base: str, adapter: Path, output: Path, dtype: str, trust_remote_code: bool,
                    download: bool) -> Path:
    from transformers import AutoTokenizer

    from ptbr.backends.mlx.merge import merge_into

    tokenizer_dir = adapter if (adapter / "tokenizer_config.json").is_file() else Path(base)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code,
                                                  local_files_only=files_only(str(tokenizer_dir), download))
    except Exception as exc:  # noqa: BLE001
        raise load_error("tokenizer", str(tokenizer_dir), exc) from exc
    meta = merged_meta(base, adapter)
    merged = {}

    def fill(tmp: Path) -> None:
        with ExitStack() as stack:
            merged["dtype"] = merge_into(base, Path(adapter_as(adapter, "mlx", stack)), tmp, dtype, download)
        tokenizer.save_pretrained(str(tmp))
        write_adapter_meta(tmp, meta)

    write_directory(output, fill, "the merged model")
    log(f"merged {adapter} into {base} with MLX: full model ({merged['dtype']}) in {output}")
    return output
