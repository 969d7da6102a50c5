"""The presets as `transformers` LlamaForCausalLM models (torch)."""

from __future__ import annotations

from ptbr.config import ModelPreset


def llama_config(preset: ModelPreset, vocab_size: int, eos_id: int, pad_id: int | None = None):
    """A `LlamaConfig` for a preset: RMSNorm, RoPE, SwiGLU, SDPA attention. pad_token_id is the
    dataset's padding token or None, never EOS: transformers makes it the embedding's padding_idx,
    whose row starts at zero and never gets a gradient from the inputs, and EOS separates every
    document (`ptbr generate` pads with EOS where a model has no padding token)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=preset.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        tie_word_embeddings=preset.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        hidden_act="silu",
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(preset: ModelPreset, vocab_size: int, eos_id: int, seed: int, pad_id: int | None = None):
    """A freshly initialised `LlamaForCausalLM`; the seed fixes the weights without touching the
    caller's global RNG state."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(preset, vocab_size, eos_id, pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model, trainable_only: bool = False) -> int:
    # tied weights are one parameter: named_parameters() yields them once
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
