"""The presets as mlx-lm Llama models, initialised as transformers initialises LlamaForCausalLM, and
written as Hugging Face folders that transformers and mlx_lm.load both load; gradient checkpointing
per layer instance."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ptbr.backends.mlx.file_limit import load_mlx_lm
from ptbr.config import ModelPreset

INITIALIZER_RANGE = 0.02  # transformers' LlamaConfig default


@contextmanager
def global_generator(seed: int | None = None) -> Iterator[None]:
    """Run the block with MLX's global generator seeded with `seed` (or as it is), and put it back
    as it was afterwards: mlx.nn's layers draw their initial weights from it when constructed, and
    a run's own draws (LoRA dropout) must not depend on how many layers were built before."""
    import mlx.core as mx

    high, low = (int(v) for v in mx.random.state[0].tolist())
    if seed is not None:
        mx.random.seed(seed)
    try:
        yield
    finally:
        mx.random.seed((high << 32) | low)


def model_args(preset: ModelPreset, vocab_size: int):
    """mlx-lm's ModelArgs for a preset. tie_word_embeddings is always given: mlx-lm defaults it to
    true and would then drop an untied model's lm_head."""
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.models.llama import ModelArgs

    return ModelArgs(model_type="llama", hidden_size=preset.hidden_size, num_hidden_layers=preset.num_layers,
                     intermediate_size=preset.intermediate_size, num_attention_heads=preset.num_heads,
                     rms_norm_eps=preset.rms_norm_eps, vocab_size=vocab_size, head_dim=preset.head_dim,
                     max_position_embeddings=preset.max_position_embeddings, num_key_value_heads=preset.num_kv_heads,
                     rope_theta=preset.rope_theta, tie_word_embeddings=preset.tie_word_embeddings)


def hf_config(preset: ModelPreset, vocab_size: int, eos_id: int, pad_id: int | None) -> dict:
    """config.json of the model as LlamaForCausalLM (the torch backend's llama_config, as JSON:
    pad_token_id None without a padding token, see there); mlx-lm reads the same keys."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "dtype": "float32",
    }


def build_model(preset: ModelPreset, vocab_size: int, seed: int, pad_id: int | None):
    """A freshly initialised mlx-lm Llama in fp32, as transformers initialises LlamaForCausalLM:
    every Linear and embedding weight normal(0, 0.02) (the padding token's embedding row zero),
    every norm 1. The seed fixes the weights through explicit keys: MLX's global generator is not
    touched."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.models.llama import Model

    with global_generator():  # the constructor's random weights are replaced below
        model = Model(model_args(preset, vocab_size))
    names = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = []
    for (name, param), key in zip(names, keys, strict=True):
        if param.ndim == 1:  # RMSNorm
            value = mx.ones(param.shape, mx.float32)
        else:
            value = INITIALIZER_RANGE * mx.random.normal(param.shape, mx.float32, key=key)
            if name == "model.embed_tokens.weight" and pad_id is not None:
                value[pad_id] = 0.0
        weights.append((name, value))
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())
    return model


def count_parameters(model) -> int:
    """Parameters, 4/8-bit weights counted as unpacked (their scales and biases are not counted)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    bits = {name: module.bits for name, module in model.named_modules()
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    total = 0
    for name, value in tree_flatten(model.parameters()):
        owner, leaf = name.rsplit(".", 1)
        if owner not in bits:
            total += value.size
        elif leaf == "weight":
            total += value.size * 32 // bits[owner]
        elif leaf not in ("scales", "biases"):
            total += value.size
    return total


def write_hf_model(model, config: dict, directory: Path) -> None:
    """model.safetensors with transformers' names (the same as mlx-lm's for Llama) and config.json."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def checkpoint_layers(model) -> int:
    """Gradient checkpointing: each decoder layer of this model recomputes its activations in the
    backward pass. Only these layer instances change (each gets a subclass of its class whose
    __call__ runs under mx.checkpoint); other models, and the library's classes, are untouched,
    and parameter names stay the same. Returns the number of layers.

    The recomputation calls the layer again, and a dropout inside it (LoRA's) would draw other masks
    from MLX's global generator, which has moved on: the gradients would belong to another loss than
    the one computed (torch restores its generator for the recomputation). So each call of a layer
    draws keys from the global generator once, outside the recomputed part, and its dropouts make
    their masks from those keys, the same in the forward pass and in the recomputation. Only while
    its dropouts are on (training): an evaluation that drew keys would move the generator, and the
    training steps after it would draw other masks, so that a run's losses depended on how often it
    evaluated (the compiled evaluation carries MLX's random state; without checkpointing, and on
    torch, an evaluation draws nothing)."""
    import mlx.core as mx
    import mlx.nn as nn

    keyed = _keyed_dropout_class()
    subclasses: dict[type, type] = {}
    for layer in model.layers:
        for _, module in layer.named_modules():
            if type(module) is nn.Dropout:
                module.__class__ = keyed
        base = type(layer)
        if base not in subclasses:
            def __call__(self, *args, _base=base, **kwargs):
                dropouts = [m for _, m in self.named_modules() if isinstance(m, keyed) and m.drops()]
                keys = mx.random.split(_fresh_key(), len(dropouts)) if dropouts else []

                def run(params, *inner):
                    for index, module in enumerate(dropouts):
                        module._key = keys[index]  # private (underscore): never a parameter
                    self.update(params)
                    return _base.__call__(self, *inner, **kwargs)

                return mx.checkpoint(run)(self.trainable_parameters(), *args)

            subclasses[base] = type(f"Checkpointed{base.__name__}", (base,), {"__call__": __call__})
        layer.__class__ = subclasses[base]
    return len(model.layers)


def _fresh_key():
    """A key drawn from MLX's global generator (so that a seeded run stays reproducible)."""
    import mlx.core as mx

    return mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32)


def _keyed_dropout_class():
    """nn.Dropout whose mask comes from the key its checkpointed layer set for this call."""
    import mlx.core as mx
    import mlx.nn as nn

    global _KeyedDropout
    if _KeyedDropout is None:
        class KeyedDropout(nn.Dropout):
            def drops(self) -> bool:
                """Whether a call draws a mask (training, and a dropout above 0)."""
                return self.training and self._p_1 != 1

            def __call__(self, x):
                if not self.drops():
                    return x
                mask = mx.random.bernoulli(self._p_1, x.shape, key=self.get("_key"))
                return (mask * x) * (1 / self._p_1)

        _KeyedDropout = KeyedDropout
    return _KeyedDropout


_KeyedDropout = None
