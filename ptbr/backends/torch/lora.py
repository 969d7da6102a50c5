"""The torch model of a fine-tuning run: the base (a Hugging Face causal LM, quantized to 4 or 8
bits by bitsandbytes, or not) with a PEFT LoRA adapter on top, and the adapter's PEFT files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ptbr.config import lora_dropout_impl
from ptbr.errors import ConfigError, DeviceError, ModelError
from ptbr.files import read_json
from ptbr.finetune.base import check_base, load_error, local_path, model_files_only
from ptbr.log import log


@dataclass
class AdaptedModel:
    model: object  # peft.PeftModel
    target_modules: list[str]
    trainable_parameters: int
    total_parameters: int  # of the base + adapter, counting 4-bit weights as unpacked
    initial: dict = field(default_factory=dict, repr=False)  # trainable name -> its seeded start (on CPU)

    def __post_init__(self) -> None:
        if not self.initial:
            self.initial = {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()
                            if p.requires_grad}

    @property
    def config(self) -> dict:
        """The base's Hugging Face config, as a dict (what the memory model reads)."""
        return self.model.config.to_dict()

    @property
    def weights_bytes(self) -> int:
        """Bytes of the loaded base and adapter (4-bit weights as packed)."""
        return int(self.model.get_memory_footprint())

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def reset(self) -> None:
        """The adapter back to its seeded initialisation, gradients dropped: --auto-fit's tries and
        a retry after an out-of-memory start from here without reloading the (quantized) base."""
        import torch

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self.initial:
                    param.copy_(self.initial[name])
                    param.grad = None


def compute_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def quantization_config(quant: str, placement):
    """BitsAndBytesConfig for --quant, after probing that bitsandbytes really quantizes here."""
    if quant == "none":
        return None
    device = placement.device
    if device.type not in ("cuda", "cpu"):
        raise DeviceError(f"--quant {quant} needs bitsandbytes, which runs on CUDA and CPU, not {device.type}",
                          f"--quant {quant}", "use --quant none (or the MLX path on Apple Silicon)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ModelError(f"--quant {quant} needs bitsandbytes, which is not installed", f"--quant {quant}",
                         "pip install 'ptbr[finetune]', or use --quant none") from exc
    from transformers import BitsAndBytesConfig

    dtype = compute_dtype(placement.precision)
    _probe_bitsandbytes(quant, device, dtype)
    if quant == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _probe_bitsandbytes(quant: str, device, dtype) -> None:
    """Quantize and multiply one small matrix for real: an unsupported device or build fails here,
    in one clear line, not deep inside the first training step."""
    import bitsandbytes
    import torch

    try:
        x = torch.linspace(-1, 1, 64 * 64, device=device, dtype=dtype).reshape(64, 64)  # no RNG draw
        if quant == "4bit":
            from bitsandbytes.functional import quantize_4bit

            packed, state = quantize_4bit(x, quant_type="nf4", compress_statistics=True)
            bitsandbytes.matmul_4bit(x[:2], packed.t(), quant_state=state)
        else:
            layer = bitsandbytes.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
            layer.weight = bitsandbytes.nn.Int8Params(x.float().cpu(), requires_grad=False, has_fp16_weights=False)
            layer.to(device)(x[:2])
    except Exception as exc:  # noqa: BLE001 - whatever bitsandbytes raises means "not here"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeviceError(f"bitsandbytes {bitsandbytes.__version__} cannot do {quant} on {device}: {reason}",
                          f"--quant {quant}", "upgrade bitsandbytes (pip install -U bitsandbytes), "
                          "or use --quant none") from exc


def linear_module_names(model) -> list[str]:
    """Names (last component) of every linear projection, the output layer (lm_head) excepted.
    bitsandbytes' Linear4bit and Linear8bitLt are torch.nn.Linear subclasses, so quantized bases
    give the same names. GPT-2-style bases (GPT-2, and the PT-BR models fine-tuned from it) make
    their projections with transformers' Conv1D, a Linear with its weight transposed, which PEFT
    adapts too (c_attn, c_proj, c_fc)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    output = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear | Conv1D) and module is not output and name != "lm_head"})


def resolve_target_modules(model, requested: str | None) -> list[str]:
    available = linear_module_names(model)
    if requested is None:
        if not available:
            raise ModelError("the base model has no linear projections to adapt", type(model).__name__,
                             "give --target-modules with the names of its projection modules")
        return available
    names = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ConfigError(f"no linear module named {', '.join(unknown)} in the base model", "--target-modules",
                          f"use some of: {', '.join(available)}")
    return names


def load_model(settings, placement) -> AdaptedModel:
    """The base, quantized per --quant, with a fresh LoRA adapter (its initialisation seeded by
    --seed without touching the global RNG)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    check_base(settings.base, settings.download)
    refuse_prequantized(settings.base)
    quantization = quantization_config(settings.quant, placement)
    options = {"dtype": compute_dtype(placement.precision), "trust_remote_code": settings.trust_remote_code}
    if quantization is not None:
        options["quantization_config"] = quantization
        options["device_map"] = {"": placement.device}
    options.update(model_files_only(settings.base, settings.download))
    try:
        # a local base by its absolute path: adapter_config.json records it for loading without ptbr
        base = AutoModelForCausalLM.from_pretrained(local_path(settings.base), **options)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, torch.OutOfMemoryError):
            raise DeviceError("out of memory while loading the base model", settings.base,
                              "use --quant 4bit, or a GPU with more memory") from exc
        raise load_error("base model", settings.base, exc) from exc
    if quantization is None:
        base = base.to(placement.device)
    else:
        keep_4bit_layout(base)
    base.config.use_cache = False  # the KV cache is for generation; training never reuses it
    checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if quantization is not None:
        # norms, embeddings and lm_head to fp32 for stable training; the 4/8-bit weights stay packed
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=settings.gradient_checkpointing,
                                               **checkpointing)
    elif settings.gradient_checkpointing:
        base.gradient_checkpointing_enable(**checkpointing)

    targets = resolve_target_modules(base, settings.target_modules)
    # GPT-2-style Conv1D projections store their weight transposed: PEFT's fan_in_fan_out, saved with
    # the adapter (PEFT sets it itself otherwise, with a warning on every load)
    transposed = any(isinstance(module, Conv1D) and name.rsplit(".", 1)[-1] in targets
                     for name, module in base.named_modules())
    lora = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM", fan_in_fan_out=transposed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = get_peft_model(base, lora)
    dropout = ""
    if settings.lora_dropout > 0:
        impl = lora_dropout_impl(settings.lora_dropout_impl, placement.device.type)
        if impl == "packed":
            from ptbr.backends.torch.dropout import pack_lora_dropout

            pack_lora_dropout(model)
        dropout = f", dropout {settings.lora_dropout:g} ({impl} masks)"
    trainable, total = model.get_nb_trainable_parameters()
    log(f"LoRA r={settings.lora_r} alpha={settings.lora_alpha} on {', '.join(targets)}{dropout}: "
        f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.3f}%)")
    return AdaptedModel(model, targets, trainable, total)


def keep_4bit_layout(model) -> int:
    """Stop bitsandbytes (0.50) from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, the first time a Linear4bit runs in eval mode without gradients, it
    rewrites its weight in place into another layout with the block scales rounded to bf16; taking
    a state dict (every checkpoint and adapter save) converts it back, re-quantizing the scales. The
    base weights would then change at each evaluation: training after it, an exact resume and
    the validation loss all drift. The flag is per layer (set in Linear4bit.__init__), so this
    touches this model only. Returns the number of layers switched."""
    switched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched


def mlx_quantization(config: dict | None) -> dict | None:
    """MLX's quantization of a model saved by `mlx_lm.convert -q` ({"group_size", "bits", ...}), None
    for any other: mlx-lm writes `quantization` (and copies it to `quantization_config`, without the
    `quant_method` every transformers quantization names), on which transformers fails with "...
    has no `quant_method` attribute", naming neither MLX nor what to do."""
    if not isinstance(config, dict) or not isinstance(config.get("quantization"), dict):
        return None
    copy = config.get("quantization_config")
    return None if isinstance(copy, dict) and copy.get("quant_method") else config["quantization"]


def refuse_mlx_quantized(model: str, what: str, fix: str) -> None:
    """A ModelError where `model` is saved in MLX's quantized format, which transformers cannot load."""
    quantization = mlx_quantization(read_json(Path(model).expanduser() / "config.json"))
    if quantization is not None:
        raise ModelError(f"the {what} is in MLX's quantized format ({quantization.get('bits')}-bit, made by "
                         "mlx_lm.convert -q: config.json has `quantization`, no `quant_method`), which the torch "
                         "backend cannot load", model, fix)


def refuse_prequantized(base: str, mlx_fix: str = "fine-tune it with --backend mlx, which trains on it as it is, "
                        "or give the original (unquantized) model") -> None:
    """A base saved quantized: the torch backend quantizes the original itself (--quant).
    `mlx_fix`: what to do with a base in MLX's format (fine-tuning and merging differ)."""
    refuse_mlx_quantized(base, "base model", mlx_fix)
    config = Path(base).expanduser() / "config.json"
    if config.is_file():
        try:
            quantized = "quantization_config" in json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # transformers will report the broken file itself
        if quantized:
            raise ModelError("the base model is saved already quantized", base,
                             "give the original (unquantized) model; ptbr quantizes it when loading (--quant)")
