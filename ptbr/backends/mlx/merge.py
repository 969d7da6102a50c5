"""Merging a LoRA adapter into its base with MLX, where torch is not installed (`ptbr merge` and
`ptbr finetune --merge` on a Mac with the MLX path only): W + scale * B A per adapted projection,
written as a Hugging Face folder that transformers and mlx_lm.load both load.

The base is loaded unquantized, as the torch merge does: a QLoRA adapter is merged into the
original weights, in the base's own dtype unless asked otherwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ptbr.backends.mlx.file_limit import load_mlx_lm
from ptbr.errors import ModelError
from ptbr.files import telling_line

SHARD_BYTES = 5 * 1024**3  # transformers' default shard size


def merge_into(base: str, adapter: Path, directory: Path, dtype: str, download: bool = False) -> str:
    """Write base + adapter (an mlx-lm adapter directory), merged, into `directory`; returns the
    merged weights' dtype."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.utils import load_adapters, load_model, make_shards

    from ptbr.backends.mlx.lora import base_quantization, local_model_dir, rope_settings
    from ptbr.backends.mlx.models import global_generator
    from ptbr.finetune.base import read_config

    path = local_model_dir(base, download)
    config = read_config(str(path)) or {}
    if base_quantization(config, base):
        raise ModelError("the base model is saved already quantized", base,
                         "give the original (unquantized) model the adapter was trained on")
    try:
        with global_generator():
            model, _ = load_model(path, model_config=rope_settings(config))
        load_adapters(model, str(adapter))
    except Exception as exc:  # noqa: BLE001 - a shape or name mismatch: the adapter is for another base
        reason = telling_line(exc)  # mlx-lm's first line announces a list of tensors
        raise ModelError(f"the adapter does not fit this base model: {reason}", str(adapter),
                         "give the --base the adapter was trained on") from exc
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    if dtype != "auto":
        model.set_dtype({"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[dtype])
    weights = dict(tree_flatten(model.parameters()))
    if getattr(model.args, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    shards = make_shards(weights, max_file_size_gb=SHARD_BYTES // 1024**3)
    index = {}
    for number, shard in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(directory / name), shard, metadata={"format": "pt"})
        index.update({key: name for key in shard})
    if len(shards) > 1:
        total = sum(value.nbytes for value in weights.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2))
    merged_dtype = str(next(iter(weights.values())).dtype).rsplit(".", 1)[-1]
    config["dtype"] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(merged_dtype, merged_dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for extra in ("generation_config.json",):
        if (path / extra).is_file():
            shutil.copy2(path / extra, directory / extra)
    return merged_dtype
