"""Converting a LoRA adapter between PEFT's format (the torch backend's) and mlx-lm's (the MLX
backend's), with numpy only: neither torch nor mlx is needed.

The same low-rank update W + scale * B A, stored two ways:
  PEFT     base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight  (r, in)
           base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight  (out, r)
           adapter_config.json: r, lora_alpha (scale = lora_alpha / r), target_modules, ...
  mlx-lm   model.layers.N.self_attn.q_proj.lora_a  (in, r) = lora_A.weight transposed
           model.layers.N.self_attn.q_proj.lora_b  (r, out) = lora_B.weight transposed
           adapter_config.json: fine_tune_type, num_layers (the last N layers), lora_parameters
           {rank, scale, dropout, keys (module paths within a layer)}
The tokenizer files and ptbr_adapter.json travel with the weights.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ptbr.errors import ConfigError, ModelError, PtbrError
from ptbr.files import write_directory
from ptbr.finetune.adapter import (
    ADAPTER_META,
    check_export_output,
    read_adapter_meta,
    write_adapter_meta,
)

FORMATS = ("peft", "mlx")
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
MLX_WEIGHTS, MLX_CONFIG = "adapters.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."
LAYER = re.compile(r"^(?P<stem>.*\.layers)\.(?P<index>\d+)\.(?P<key>.+)$")
# safetensors dtypes -> numpy; bf16 has no numpy type and is widened to fp32 (exactly)
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def adapter_format(directory: str | Path) -> str:
    """peft or mlx, by the files an adapter directory holds."""
    directory = Path(directory)
    if (directory / PEFT_WEIGHTS).is_file() and (directory / PEFT_CONFIG).is_file():
        return "peft"
    if (directory / MLX_WEIGHTS).is_file() and (directory / MLX_CONFIG).is_file():
        return "mlx"
    if not directory.is_dir():
        raise ModelError("adapter directory " + ("is a file" if directory.exists() else "not found"), str(directory),
                         "give OUTPUT/adapters of a fine-tuning run (the directory)")
    if not (directory / PEFT_CONFIG).is_file():
        raise ModelError(f"no {PEFT_CONFIG} in the adapter directory", str(directory), "give OUTPUT/adapters")
    raise ModelError(f"no adapter weights: neither {PEFT_WEIGHTS} (PEFT) nor {MLX_WEIGHTS} (mlx-lm)",
                     str(directory), "give OUTPUT/adapters of a fine-tuning run")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (bf16 widened to fp32)."""
    data = path.read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
    except (struct.error, ValueError) as exc:
        raise ModelError(f"{path.name} is not a safetensors file", str(path), "give an intact adapter") from exc
    start = 8 + size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[start + begin:start + end]
        if entry["dtype"] == "BF16":
            value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif entry["dtype"] in DTYPES:
            value = np.frombuffer(raw, DTYPES[entry["dtype"]])
        else:
            raise ModelError(f"{path.name}: tensor {name} has dtype {entry['dtype']}, not a LoRA weight's",
                             str(path), "give a LoRA adapter")
        tensors[name] = value.reshape(entry["shape"])
    return tensors


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path.name} cannot be read: {exc}", str(path), "give an intact adapter") from exc
    if not isinstance(value, dict):
        raise ModelError(f"{path.name} does not hold an object", str(path), "give an intact adapter")
    return value


def base_layers(base: str | None) -> int | None:
    """num_hidden_layers of a local base model, None when unknown."""
    if not base:
        return None
    try:
        config = json.loads((Path(base).expanduser() / "config.json").read_text(encoding="utf-8"))
        return int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def split_name(name: str, directory: Path) -> tuple[str, int, str]:
    """'model.layers.3.self_attn.q_proj' -> ('model.layers', 3, 'self_attn.q_proj')."""
    match = LAYER.match(name)
    if not match:
        raise ConfigError(f"adapter weight {name} is not inside a decoder layer (model.layers.N)", str(directory),
                          "only adapters on the decoder layers' projections convert between PEFT and mlx-lm")
    return match["stem"], int(match["index"]), match["key"]


def mlx_to_peft(directory: Path, base: str | None) -> tuple[dict[str, np.ndarray], dict]:
    config = read_json(directory / MLX_CONFIG)
    if config.get("fine_tune_type", "lora") != "lora":
        raise ConfigError(f"a {config.get('fine_tune_type')} adapter has no PEFT LoRA equivalent", str(directory),
                          "convert LoRA adapters only")
    try:
        lora = config["lora_parameters"]
        rank, scale, dropout = int(lora["rank"]), float(lora["scale"]), float(lora.get("dropout", 0.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError("adapter_config.json lacks lora_parameters {rank, scale}", str(directory),
                         "give an adapter written by ptbr or mlx_lm.lora") from exc
    tensors, layers, modules = {}, set(), set()
    for name, value in read_safetensors(directory / MLX_WEIGHTS).items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or value.ndim != 2:
            raise ConfigError(f"adapter weight {name} is not a LoRA matrix (lora_a, lora_b)", str(directory),
                              "convert LoRA adapters of linear layers only")
        _, index, key = split_name(module, directory)
        layers.add(index)
        modules.add(key.rsplit(".", 1)[-1])
        tensors[f"{PEFT_PREFIX}{module}.lora_{leaf[-1].upper()}.weight"] = np.ascontiguousarray(value.T)
    base = base or config.get("model")
    total = base_layers(base)
    adapted = sorted(layers)
    every_layer = adapted == list(range(total if total is not None else max(adapted) + 1))
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": alpha_of(scale, rank), "lora_dropout": dropout, "target_modules": sorted(modules),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "layers_to_transform": None if every_layer else adapted, "layers_pattern": None, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "revision": None,
        "auto_mapping": None,
    }
    return tensors, peft_config


def alpha_of(scale: float, rank: int) -> float | int:
    """PEFT's lora_alpha for mlx-lm's scale: 29 rather than 29.000000000000004 (scale 29/7 at r=7)."""
    alpha = round(scale * rank, 9)
    return int(alpha) if alpha.is_integer() else alpha


def peft_to_mlx(directory: Path, base: str | None) -> tuple[dict[str, np.ndarray], dict]:
    config = read_json(directory / PEFT_CONFIG)
    unsupported = [f"{key} {config[key]!r}" for key, fine in (
        ("peft_type", lambda v: v == "LORA"), ("use_dora", lambda v: not v), ("bias", lambda v: v in (None, "none")),
        ("modules_to_save", lambda v: not v), ("rank_pattern", lambda v: not v), ("alpha_pattern", lambda v: not v),
        ("fan_in_fan_out", lambda v: not v)) if key in config and not fine(config[key])]
    if unsupported:
        raise ConfigError(f"this PEFT adapter has no mlx-lm equivalent: {', '.join(unsupported)}", str(directory),
                          "use it with --backend torch (PEFT's format); only plain LoRA adapters of linear layers "
                          "(one rank and alpha, no bias, no DoRA, no modules_to_save) convert to mlx-lm's")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError("adapter_config.json lacks r and lora_alpha", str(directory),
                         "give an adapter written by ptbr or PEFT") from exc
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors, layers, keys = {}, set(), set()
    for name, value in read_safetensors(directory / PEFT_WEIGHTS).items():
        match = re.match(rf"^{re.escape(PEFT_PREFIX)}(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$", name)
        if not match or value.ndim != 2:
            raise ConfigError(f"adapter weight {name} is not a LoRA matrix of a linear layer", str(directory),
                              "convert LoRA adapters of linear layers only")
        _, index, key = split_name(match["module"], directory)
        layers.add(index)
        keys.add(key)
        tensors[f"{match['module']}.lora_{match['which'].lower()}"] = np.ascontiguousarray(value.T)
    base = base or config.get("base_model_name_or_path")
    known = base_layers(base)
    total = known if known is not None else max(layers) + 1
    adapted = sorted(layers)
    of_base = f" of {base}" if known is not None else ""
    if max(adapted) >= total:
        raise ConfigError(f"the adapter covers layers up to {max(adapted)}, and the base {base} has {total}: not "
                          "the base it was trained on", str(directory), "give --base the model the adapter was "
                          "trained on")
    if adapted != list(range(total - len(adapted), total)):
        raise ConfigError(f"the adapter covers layers {adapted}, and mlx-lm adapts only the last N layers of "
                          f"the {total}{of_base}", str(directory), "convert adapters of every layer (or of the last "
                          "ones), with --base the model they were trained on")
    mlx_config = {"fine_tune_type": "lora", "num_layers": len(adapted),
                  "lora_parameters": {"rank": rank, "scale": scale, "dropout": float(config.get("lora_dropout") or 0.0),
                                      "keys": sorted(keys)},
                  "model": base}
    return tensors, mlx_config


def convert_into(adapter: str | Path, to: str, target: Path, base: str | None = None) -> str:
    """Write `adapter` in format `to` into the (existing, empty) directory `target`: its weights,
    adapter_config.json, and every other file of the adapter (tokenizer, ptbr_adapter.json).
    Returns the format it was in."""
    from safetensors.numpy import save_file

    if to not in FORMATS:
        raise ConfigError(f"unknown adapter format {to!r}", "--to", f"use one of: {', '.join(FORMATS)}")
    adapter = Path(adapter)
    source = adapter_format(adapter)
    own = {PEFT_WEIGHTS, PEFT_CONFIG, MLX_WEIGHTS, MLX_CONFIG, "README.md"}
    for path in sorted(adapter.iterdir()):
        if path.is_file() and path.name not in own:
            shutil.copy2(path, target / path.name)
    if source == to:
        tensors = read_safetensors(adapter / (PEFT_WEIGHTS if to == "peft" else MLX_WEIGHTS))
        config = read_json(adapter / (PEFT_CONFIG if to == "peft" else MLX_CONFIG))
        if base:
            config["base_model_name_or_path" if to == "peft" else "model"] = base
    else:
        tensors, config = (mlx_to_peft if to == "peft" else peft_to_mlx)(adapter, base)
    weights, metadata = (PEFT_WEIGHTS, {"format": "pt"}) if to == "peft" else (MLX_WEIGHTS, {"format": "mlx"})
    save_file(tensors, str(target / weights), metadata=metadata)
    (target / (PEFT_CONFIG if to == "peft" else MLX_CONFIG)).write_text(json.dumps(config, indent=2) + "\n",
                                                                          encoding="utf-8")
    meta_path = target / ADAPTER_META
    if meta_path.is_file():  # which library's format it is now in
        meta = read_json(meta_path) | {"backend": "torch" if to == "peft" else "mlx"}
        if source != to:  # a copy in its own format keeps what the adapter said of itself
            meta["converted_from"] = source
        meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return source


def adapter_as(adapter: str | Path, wanted: str, stack: ExitStack) -> str:
    """The adapter in format `wanted` (peft | mlx): itself, or converted into a temporary directory
    that lives as long as `stack` (generate and merge take either format this way). An error about
    the converted copy raised inside `stack` names the user's adapter directory instead."""
    if adapter_format(adapter) == wanted:
        return str(adapter)
    converted = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ptbr-adapter-")))
    convert_into(adapter, wanted, converted)

    def name_the_original(kind, error, traceback) -> bool:
        if isinstance(error, PtbrError):
            error.rename_path(str(converted), str(adapter))
        return False  # the error goes on

    stack.push(name_the_original)
    return str(converted)


def export_adapter(adapter: str | Path, to: str, output: str | Path, base: str | None = None) -> tuple[Path, str]:
    """`ptbr export-adapter`: the adapter in format `to`, written aside and swapped into `output`.
    Returns the output and the format the adapter was in."""
    adapter = Path(adapter)
    output = check_export_output(output, adapter, base)
    found = {}

    def fill(tmp: Path) -> None:
        found["source"] = convert_into(adapter, to, tmp, base)
        meta = read_adapter_meta(tmp) | {"exported_from": str(adapter.resolve())}  # what an export may replace
        write_adapter_meta(tmp, meta)

    write_directory(output, fill, "the converted adapter")
    return output, found["source"]
