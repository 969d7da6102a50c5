"""--lora-dropout-impl packed: ptbr's LoRA dropout (ptbr/backends/torch/dropout.py) drops at the
asked rate, scales so the expected output is the input, masks the gradient the same way, repeats
under a seed, and replaces exactly PEFT's dropouts."""

from __future__ import annotations

import math

import pytest
import torch

from ptbr.backends.torch.dropout import (
    LEVELS,
    PackedDropout,
    drop_levels,
    keep_mask,
    pack_lora_dropout,
)
from ptbr.config import FinetuneConfig, lora_dropout_impl
from ptbr.errors import ConfigError


def test_the_rate_is_p_to_a_65536th_and_the_scale_its_exact_inverse():
    assert drop_levels(0.0) == 0
    assert drop_levels(0.05) == 3277  # round(0.05 * 65536)
    assert drop_levels(0.5) == 32768
    assert drop_levels(1e-9) == 1  # any p > 0 drops something
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError):
            drop_levels(bad)
    layer = PackedDropout(0.05).train()
    torch.manual_seed(0)
    out = layer(torch.ones(1 << 20))
    scale = LEVELS / (LEVELS - 3277)
    assert out.unique().tolist() == [0.0, pytest.approx(scale)]
    dropped = int((out == 0).sum())
    # 2^20 draws at rate 3277/65536: the count is within 5 standard deviations of its mean
    mean, sd = (1 << 20) * 3277 / LEVELS, math.sqrt((1 << 20) * 3277 / LEVELS * (1 - 3277 / LEVELS))
    assert abs(dropped - mean) < 5 * sd
    assert float(out.double().mean()) == pytest.approx(1.0, abs=5 * sd / (1 << 20) * scale)


def test_each_of_the_four_16_bit_numbers_of_a_draw_is_uniform():
    """A value's number is one quarter of a 64-bit draw: every quarter (and the sign bit that the
    full-range draw must set) is used alike, so no position in the tensor is dropped more often."""
    torch.manual_seed(1)
    keep = keep_mask(torch.Size([1 << 20]), 0.5, "cpu").view(-1, 4)  # the 4 numbers of each draw, by column
    rates = 1 - keep.double().mean(0)
    sd = math.sqrt(0.25 / (1 << 18))
    assert all(abs(r - 0.5) < 5 * sd for r in rates.tolist()), rates
    # an odd count still gets a number per value
    assert keep_mask(torch.Size([3, 5]), 0.5, "cpu").shape == (3, 5)


def test_the_gradient_is_masked_and_scaled_like_the_output_and_the_same_seed_repeats():
    x = torch.randn(4, 7, 33, requires_grad=True)
    layer = PackedDropout(0.25).train()
    torch.manual_seed(7)
    out = layer(x)
    (out * 3).sum().backward()
    factor = torch.where(out == 0, 0.0, LEVELS / (LEVELS - drop_levels(0.25)))
    assert torch.equal(x.grad, 3 * factor)
    assert torch.equal(out, x.detach() * factor)
    torch.manual_seed(7)
    assert torch.equal(layer(x), out)  # same generator state, same mask: an exact resume repeats it
    assert not torch.equal(layer(x), out)  # and the next call draws afresh


def test_eval_mode_zero_rate_and_16_bit_inputs():
    x = torch.randn(8, 16)
    assert PackedDropout(0.3).eval()(x) is x
    assert PackedDropout(0.0).train()(x) is x
    torch.manual_seed(0)
    half = PackedDropout(0.3).train()(x.bfloat16())
    assert half.dtype == torch.bfloat16


def test_auto_is_packed_on_a_cpu_and_torch_on_gpus_and_a_bad_value_is_refused():
    assert lora_dropout_impl("auto", "cpu") == "packed"
    assert lora_dropout_impl("auto", "cuda") == "torch"
    assert lora_dropout_impl("auto", "mps") == "torch"
    assert lora_dropout_impl("torch", "cpu") == "torch"
    assert lora_dropout_impl("packed", "cuda") == "packed"
    with pytest.raises(ConfigError, match="lora_dropout_impl must be one of auto, packed, torch"):
        FinetuneConfig(base="b", data="d", lora_dropout_impl="fast")


def test_pack_lora_dropout_replaces_peft_dropouts_only():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(dropout: float):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2)
        torch.manual_seed(0)
        return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                   target_modules=["q_proj", "v_proj", "down_proj"]))

    model = tiny(0.1)
    assert pack_lora_dropout(model) == 6  # 3 adapted projections x 2 layers
    packed = [m for m in model.modules() if isinstance(m, PackedDropout)]
    assert len(packed) == 6 and all(m.p == 0.1 for m in packed)
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert pack_lora_dropout(model) == 0  # already packed
    assert pack_lora_dropout(tiny(0.0)) == 0  # PEFT's nn.Identity at rate 0 stays
    # the adapter trains through it: gradients reach every LoRA matrix
    ids = torch.randint(0, 64, (2, 12))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # B starts at zero, A does not
    assert len(grads) == 6 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_gradient_checkpointing_recomputes_the_same_masks():
    """Non-reentrant checkpointing re-runs each layer's forward in the backward pass, restoring the
    RNG state first: the packed masks drawn again are the same, so the gradients equal those of a
    run without checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    grads = []
    for checkpointing in (False, True):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2)
        torch.manual_seed(0)
        base = LlamaForCausalLM(config)
        if checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.config.use_cache = False
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules="all-linear"))
        assert pack_lora_dropout(model) == 14
        model.train()
        ids = torch.randint(0, 64, (2, 12))
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
