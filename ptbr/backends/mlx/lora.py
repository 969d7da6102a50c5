"""The MLX model of a fine-tuning run: a Hugging Face base (Llama/Mistral family) loaded by mlx-lm,
quantized in memory with MLX's affine 4- or 8-bit format or already quantized by
`mlx_lm.convert -q`, with mlx-lm's LoRA layers on top; the adapter in mlx-lm's own format."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ptbr.backends.mlx.file_limit import load_mlx_lm
from ptbr.errors import ConfigError, ModelError
from ptbr.files import telling_line
from ptbr.finetune.base import check_base, files_only, load_error, max_positions, read_config
from ptbr.log import log

GROUP_SIZE = 64  # MLX's affine quantization: one scale and one bias per 64 weights
QUANT_BITS = {"4bit": 4, "8bit": 8}
ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class MlxAdapted:
    """A base with LoRA layers; what ptbr/runs/finetune.py and the MLX backend use of it."""

    model: object  # the mlx-lm model, LoRA layers in place
    config: dict  # the base's Hugging Face config.json
    base: str  # where the base was loaded from
    target_modules: list[str]  # module names as --target-modules takes them (q_proj, ...)
    keys: list[str]  # the same as mlx-lm's keys within a layer (self_attn.q_proj, ...)
    rank: int
    scale: float  # lora_alpha / r
    dropout: float
    trainable_parameters: int
    total_parameters: int  # base + adapter, 4/8-bit weights counted as unpacked
    quantization: dict | None  # {"group_size", "bits"} of the base's weights, None if not quantized
    initial: dict = field(default_factory=dict, repr=False)  # adapter name -> its seeded start

    def __post_init__(self) -> None:
        if not self.initial:
            import mlx.core as mx

            self.initial = {name: mx.array(value) for name, value in self.adapter_weights().items()}
            mx.eval(list(self.initial.values()))

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.config)

    @property
    def weights_bytes(self) -> int:
        """Bytes of the loaded base and adapter (4/8-bit weights as packed, with their scales)."""
        from mlx.utils import tree_flatten

        return sum(value.nbytes for _, value in tree_flatten(self.model.parameters()))

    def adapter_weights(self) -> dict:
        """The adapter's weights by mlx-lm's names (model.layers.N.self_attn.q_proj.lora_a, ...)."""
        from mlx.utils import tree_flatten

        return dict(tree_flatten(self.model.trainable_parameters()))

    def adapter_config(self) -> dict:
        """adapter_config.json as mlx_lm.load(..., adapter_path=...) and mlx_lm.generate read it."""
        return {"fine_tune_type": "lora", "num_layers": len(self.model.layers),
                "lora_parameters": {"rank": self.rank, "scale": self.scale, "dropout": self.dropout,
                                    "keys": self.keys},
                "model": self.base}

    def reset(self) -> None:
        """The adapter back to its seeded initialisation (no reload of the base)."""
        import mlx.core as mx

        self.model.load_weights([(name, mx.array(value)) for name, value in self.initial.items()], strict=False)
        mx.eval(self.model.parameters())


def local_model_dir(name: str, download: bool, what: str = "base model") -> Path:
    """A checked local model directory; a Hugging Face Hub id is fetched (or found in the cache)
    only with --download."""
    check_base(name, download, what)
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja", "*.tiktoken"],
                                      local_files_only=files_only(name, download)))
    except Exception as exc:  # noqa: BLE001 - network, missing repository, authentication
        raise load_error(what, name, exc) from exc


def base_quantization(config: dict, base: str) -> dict | None:
    """The MLX quantization a base was saved with (`mlx_lm.convert -q`), None for a plain base;
    other libraries' quantized weights are refused, as on torch."""
    quantization = config.get("quantization")
    if quantization:
        return quantization
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "another library")
        raise ModelError(f"the base model is saved quantized by {method}, which MLX does not train on", base,
                         "give the original (unquantized) model, or one converted by `mlx_lm.convert -q`")
    return None


def rope_settings(config: dict) -> dict:
    """RoPE as mlx-lm's Llama reads it (rope_theta, rope_scaling) from a config that transformers 5
    wrote, which keeps them under rope_parameters only: mlx-lm would silently use theta 10,000."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config or "rope_theta" not in rope:
        return {}
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}


def quantize(model, bits: int) -> int:
    """MLX's affine quantization, group 64, of every layer mlx_lm.convert -q quantizes (linear
    projections, embeddings and the output layer) whose input size is a multiple of 64. Returns
    the number of layers quantized."""
    import mlx.nn as nn

    quantized = []

    def predicate(path, module) -> bool:
        wanted = hasattr(module, "to_quantized") and module.weight.shape[-1] % GROUP_SIZE == 0
        if wanted:
            quantized.append(path)
        return wanted

    nn.quantize(model, group_size=GROUP_SIZE, bits=bits, class_predicate=predicate)
    return len(quantized)


def linear_keys(model) -> dict[str, list[str]]:
    """Module name (last component, as --target-modules takes it) -> mlx-lm's keys within a
    decoder layer, for every linear projection (quantized or not) of the layers."""
    import mlx.nn as nn

    found: dict[str, list[str]] = {}
    for key, module in model.layers[0].named_modules():
        if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            found.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    return found


def resolve_keys(model, requested: str | None) -> tuple[list[str], list[str]]:
    """(module names, mlx-lm keys) to adapt: the requested ones, or every linear projection of the
    layers (the output layer, outside the layers, never)."""
    available = linear_keys(model)
    if not available:
        raise ModelError("the base model has no linear projections to adapt", type(model).__name__,
                         "give --target-modules with the names of its projection modules")
    if requested is None:
        names = sorted(available)
    else:
        names = [name.strip() for name in requested.split(",") if name.strip()]
        unknown = [name for name in names if name not in available]
        if unknown:
            raise ConfigError(f"no linear module named {', '.join(unknown)} in the base model", "--target-modules",
                              f"use some of: {', '.join(sorted(available))}")
    return names, sorted(key for name in names for key in available[name])


def load_base(settings, dtype):
    """The base as an mlx-lm model in `dtype` (quantized per --quant), with its config.json."""
    import mlx.core as mx
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.utils import load_model

    from ptbr.backends.mlx.models import global_generator

    path = local_model_dir(settings.base, settings.download)
    config = read_config(str(path)) or {}
    saved_quantization = base_quantization(config, settings.base)
    if not any(path.glob("model*.safetensors")):
        raise ModelError("the MLX backend loads safetensors weights, and the base has none", settings.base,
                         "save the base with safetensors (transformers' save_pretrained does by default)")
    wanted_bits = QUANT_BITS.get(settings.quant)
    if saved_quantization and saved_quantization.get("bits") != wanted_bits:
        raise ConfigError(f"the base is saved {saved_quantization.get('bits')}-bit quantized (mlx_lm.convert -q), "
                          f"but --quant is {settings.quant}", settings.base,
                          f"use --quant {saved_quantization.get('bits')}bit with this base, or give the unquantized one")
    try:
        with global_generator():  # the constructor's random weights are replaced by the base's
            model, config = load_model(path, model_config=rope_settings(config),
                                       trust_remote_code=settings.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - unknown architecture, missing or mismatched weights
        # mlx-lm's reading of config.json (an architecture it lacks, or reads other keys of), not the files
        if "ModelArgs" in str(exc) or re.search(r"Model type \S+ not supported", str(exc)):
            kind = config.get("model_type", "this architecture")
            raise ModelError(f"mlx-lm cannot build this base ({kind}) from its config.json: {telling_line(exc)}",
                             settings.base, "fine-tune it with --backend torch") from exc
        raise load_error("base model", settings.base, exc) from exc
    model.set_dtype(dtype)  # floating weights only; the packed 4/8-bit ones stay as they are
    quantization = saved_quantization
    if saved_quantization:
        log(f"base already quantized by mlx_lm.convert: {saved_quantization.get('bits')}-bit, "
            f"group {saved_quantization.get('group_size')}")
    elif wanted_bits:
        layers = quantize(model, wanted_bits)
        quantization = {"group_size": GROUP_SIZE, "bits": wanted_bits}
        log(f"base quantized in memory: MLX affine {wanted_bits}-bit, group {GROUP_SIZE}, {layers} layers "
            f"(--quant {settings.quant} on MLX is MLX's format, not bitsandbytes' "
            f"{'NF4' if wanted_bits == 4 else 'LLM.int8'})")
    mx.eval(model.parameters())
    return model, config, quantization


def load_adapted(settings, dtype) -> MlxAdapted:
    """The base (quantized per --quant) with fresh LoRA layers."""
    model, config, quantization = load_base(settings, dtype)
    base = Path(settings.base).expanduser()
    return adapt(model, config, str(base.resolve()) if base.exists() else settings.base, quantization, settings)


def adapt(model, config: dict, base: str, quantization: dict | None, settings) -> MlxAdapted:
    """LoRA layers on the projections of every decoder layer of `model`, the rest frozen. mlx-lm
    draws lora_a uniformly (lora_b is zero) from MLX's global generator: it is seeded with --seed
    for that and put back as it was, so the adapter depends on the seed alone."""
    import mlx.core as mx
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from ptbr.backends.mlx.models import checkpoint_layers, count_parameters, global_generator

    names, keys = resolve_keys(model, settings.target_modules)
    model.freeze()
    scale = settings.lora_alpha / settings.lora_r
    with global_generator(settings.seed):
        linear_to_lora_layers(model, len(model.layers), {"rank": settings.lora_r, "scale": scale,
                                                         "dropout": settings.lora_dropout, "keys": keys})
        mx.eval(model.parameters())
    if settings.gradient_checkpointing:
        checkpoint_layers(model)
    model.train()
    adapted = MlxAdapted(model, config, base, names, keys, settings.lora_r, scale, settings.lora_dropout, 0, 0,
                         quantization)
    adapted.trainable_parameters = sum(v.size for v in adapted.adapter_weights().values())
    adapted.total_parameters = count_parameters(model)
    share = 100 * adapted.trainable_parameters / adapted.total_parameters
    log(f"LoRA r={settings.lora_r} alpha={settings.lora_alpha} (scale {scale:g}) on {', '.join(names)}: "
        f"{adapted.trainable_parameters:,} trainable parameters of {adapted.total_parameters:,} ({share:.3f}%)")
    return adapted


def write_adapter(adapted: MlxAdapted, directory: Path) -> None:
    """adapters.safetensors and adapter_config.json, as mlx_lm.lora writes them."""
    import mlx.core as mx

    mx.save_safetensors(str(directory / ADAPTER_WEIGHTS), adapted.adapter_weights(), metadata={"format": "mlx"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(adapted.adapter_config(), indent=2) + "\n", encoding="utf-8")
