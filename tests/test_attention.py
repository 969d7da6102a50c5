"""Grouped-query attention where flash attention cannot run (fp32 on a GPU, fp16 on a T4): ptbr
makes transformers repeat the key/value heads there rather than pass enable_gqa=True, which sends
torch's SDPA to its math kernel (ptbr/backends/torch/attention.py; the GPU's side is in
tests/test_gpu.py). And bf16 attention on a CPU: the 16-bit kernel's forward pass, the fp32
kernel's backward pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ptbr.backends.torch import attention


@pytest.mark.parametrize("dtype, capability, possible", [
    (torch.bfloat16, (9, 0), True), (torch.float16, (8, 0), True), (torch.float16, (7, 5), False),
    (torch.float32, (9, 0), False), (torch.bfloat16, None, False)])
def test_flash_attention_needs_16_bits_on_ampere_or_newer(dtype, capability, possible):
    assert attention.flash_attention_possible(dtype, capability) is possible


def test_where_flash_cannot_run_the_key_value_heads_are_repeated(monkeypatch):
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.use_gqa_in_sdpa
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", original)  # put back after the test
    monkeypatch.setattr(attention, "_CAPABILITY", {0: (7, 5), 1: (9, 0)})  # a T4 and an H100
    attention.keep_sdpa_off_the_math_kernel()
    attention.keep_sdpa_off_the_math_kernel()  # once only
    wrapped = sdpa_attention.use_gqa_in_sdpa
    assert wrapped.ptbr_wrapped and wrapped.__wrapped__ is original
    monkeypatch.setattr(attention, "_CAPABILITY", {0: (7, 5), 1: (9, 0)})  # not on this machine: keep ours

    def tensor(dtype, device):  # what the choice reads of a key or value: no GPU needed here
        return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(2, 4, 16, 64))

    def choice(dtype, device):
        return wrapped(None, tensor(dtype, device), tensor(dtype, device))

    assert choice(torch.float16, "cuda:0") is False  # T4: no flash, repeat for the memory-efficient kernel
    assert choice(torch.float32, "cuda:1") is False  # fp32: no flash anywhere
    assert choice(torch.bfloat16, "cuda:1") is True  # flash takes enable_gqa: transformers' choice
    real = torch.zeros(2, 4, 16, 64)
    assert wrapped(None, real, real) == original(None, real, real)  # other devices: transformers' choice
    assert wrapped(torch.ones(2, 1, 16, 16), real, real) is False  # a mask: repeated, as transformers does


def test_a_training_step_on_cpu_leaves_the_gqa_choice_alone():
    """The choice's wrapper is installed for CUDA placements only (TorchStep, generate)."""
    from transformers.integrations import sdpa_attention

    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import LoopSettings, get_preset

    before = sdpa_attention.use_gqa_in_sdpa
    model = build_model(get_preset("tiny"), 64, 0, 0)
    placement = resolve_precision(torch.device("cpu"), "fp32")
    TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0, chunked_loss=False)
    assert sdpa_attention.use_gqa_in_sdpa is before


def test_the_choice_follows_autocast_not_the_keys_dtype(monkeypatch):
    """Under autocast the keys reach transformers' choice in fp32 (RoPE's cos and sin take the
    fp32 residual stream's dtype): what decides is the 16-bit dtype SDPA then computes in. bf16 on
    an H100 keeps enable_gqa (flash); fp16 on a T4 repeats the heads."""
    import numpy as np
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import AttentionInterface

    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import LoopSettings, ModelPreset
    from ptbr.data.batch import windows_to_batch

    seen = []
    original = sdpa_attention.use_gqa_in_sdpa
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa",
                        lambda mask, key, *rest: seen.append(key.dtype) or original(mask, key, *rest))
    model = build_model(ModelPreset("gqa", 64, 2, 4, 2, 128, 256, learning_rate=1e-3), 512, 0, 0)
    placement = resolve_precision(torch.device("cpu"), "bf16")
    step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                     chunked_loss=False)
    # transformers' own SDPA (on a CPU ptbr computes bf16 causal attention itself, without the choice)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention.sdpa_attention_forward)
    step.train_step([windows_to_batch(np.random.default_rng(0).integers(0, 512, size=(2, 65)))], 1e-4)
    assert seen and set(seen) == {torch.float32}  # transformers consults the module's function, with fp32 keys

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", original)
    monkeypatch.setattr(attention, "_CAPABILITY", {0: (9, 0), 1: (7, 5)})
    attention.keep_sdpa_off_the_math_kernel()
    monkeypatch.setattr(attention, "_CAPABILITY", {0: (9, 0), 1: (7, 5)})
    autocast = {"dtype": torch.bfloat16}  # inside placement.autocast() on a GPU (a CPU build cannot enter one)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: autocast["dtype"])

    def choice(device):
        key = SimpleNamespace(device=torch.device(device), dtype=torch.float32, shape=(2, 2, 64, 16))
        return sdpa_attention.use_gqa_in_sdpa(None, key, key)

    assert choice("cuda:0") is True  # bf16 autocast on an H100: flash takes enable_gqa
    autocast["dtype"] = torch.float16
    assert choice("cuda:1") is False  # fp16 autocast on a T4: no flash, the heads are repeated


def test_older_transformers_without_the_choice_is_left_alone(monkeypatch):
    """transformers before the choice existed (4.52's module has none) always repeats the heads:
    nothing to wrap, and a CUDA step must not fail on it."""
    from transformers.integrations import sdpa_attention

    monkeypatch.delattr(sdpa_attention, "use_gqa_in_sdpa")
    attention.keep_sdpa_off_the_math_kernel()
    assert not hasattr(sdpa_attention, "use_gqa_in_sdpa")


def _attention_inputs(batch, heads, kv_heads, seq, head_dim):
    """What transformers hands SDPA under CPU bf16 autocast: fp32 queries and keys (RoPE's cos and
    sin are fp32), bf16 values (straight from a Linear); a bf16 gradient of the output."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, generator=generator).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=generator).requires_grad_()
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=generator).bfloat16().requires_grad_()
    return q, k, v, torch.randn(batch, heads, seq, head_dim, generator=generator).bfloat16()


def _gradients(out, grad, inputs):
    for t in inputs:
        t.grad = None
    out.backward(grad)
    return [t.grad for t in inputs]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (4, 4, 32)], ids=["gqa", "mha"])
def test_cpu_bf16_attention_forward_as_the_bf16_kernel_backward_in_fp32(heads, kv_heads, head_dim):
    """The output is the 16-bit kernel's, bit for bit (the loss does not move); the gradients are
    the fp32 kernel's on the same bf16 values: closer to exact attention of those values than the
    16-bit kernel's backward (which was twice as slow on a CPU)."""
    import torch.nn.functional as F

    q, k, v, grad = _attention_inputs(2, heads, kv_heads, 64, head_dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads < heads)
        ours = attention.flash_attention_fp32_backward(q, k, v, None, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, bf16)
    bf16_grads = _gradients(bf16, grad, (q, k, v))
    our_grads = _gradients(ours, grad, (q, k, v))
    assert [g.dtype for g in our_grads] == [torch.float32, torch.float32, torch.bfloat16]  # the inputs'

    exact = [t.detach().bfloat16().float().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=kv_heads < heads).backward(grad.float())

    def error(g, reference):
        return ((g.float() - reference.grad).norm() / reference.grad.norm()).item()

    for name, ours_g, bf16_g, reference in zip("qkv", our_grads, bf16_grads, exact, strict=True):
        assert error(ours_g, reference) < 0.7 * error(bf16_g, reference), name
    assert max(error(g, r) for g, r in zip(our_grads[:2], exact[:2], strict=True)) < 2e-3  # fp32 gradients: 1.2e-3 measured


def _recording_sdpa(monkeypatch):
    """transformers' registered SDPA replaced by a recorder (put back after the test), then wrapped."""
    from transformers.modeling_utils import AttentionInterface

    calls = []

    def recorder(module, query, key, value, attention_mask, **kwargs):
        calls.append(kwargs)
        return "transformers", None

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", recorder)
    attention.backpropagate_cpu_bf16_attention_in_fp32()
    attention.backpropagate_cpu_bf16_attention_in_fp32()  # once only
    wrapped = AttentionInterface._global_mapping["sdpa"]
    assert wrapped.ptbr_wrapped and wrapped.__wrapped__ is recorder
    return wrapped, calls


def test_every_other_attention_keeps_transformers_function(monkeypatch):
    """A mask, dropout, a cached decoding step, a query shorter than the keys, fp32, asked-for
    attention weights, no causal mask, values narrower than keys: transformers' own function, with
    what it was given."""
    wrapped, calls = _recording_sdpa(monkeypatch)
    module = SimpleNamespace(training=False, is_causal=True, num_key_value_groups=2)
    q, k, v, _ = _attention_inputs(1, 4, 2, 8, 16)

    def run(query=q, key=k, value=v, mask=None, autocast=True, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return wrapped(module, query, key, value, mask, scaling=0.25, **kwargs)[0]

    assert run(mask=torch.zeros(1, 1, 8, 8)) == "transformers"
    assert run(dropout=0.1) == "transformers"  # transformers applies it, training or not
    assert run(query=q[:, :, -1:]) == "transformers"  # decoding one token
    assert run(query=q[:, :, -4:]) == "transformers"  # a cache: fewer queries than keys
    assert run(autocast=False) == "transformers"  # fp32 queries, keys and values
    assert run(output_attentions=True) == "transformers"
    assert run(is_causal=False) == "transformers"
    module.is_causal = False
    assert run(is_causal=None) == "transformers"  # None: the module's say, as transformers reads it
    module.is_causal = True
    assert run(value=v[..., :8]) == "transformers"  # values narrower than keys (DeepSeek-V2's heads)
    assert len(calls) == 9 and calls[0] == {"dropout": 0.0, "scaling": 0.25}
    out = run()  # bf16, causal, no mask: ours
    assert len(calls) == 9 and out.shape == (1, 8, 4, 16) and out.dtype == torch.bfloat16  # (batch, seq, heads, dim)
    assert run(is_causal=None).dtype == torch.bfloat16  # the module's is_causal: causal


def test_a_bf16_step_on_cpu_computes_attention_so_and_its_loss_does_not_move(monkeypatch):
    """TorchStep on a CPU installs the wrapper; a bf16 step's attention goes through it (every
    layer), and the model's loss is bit for bit transformers' own."""
    import numpy as np
    from transformers.modeling_utils import AttentionInterface

    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import LoopSettings, ModelPreset
    from ptbr.data.batch import windows_to_batch

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", AttentionInterface._global_mapping["sdpa"])
    preset = ModelPreset("gqa", 64, 2, 4, 2, 128, 256, learning_rate=1e-3)
    model = build_model(preset, 512, 0, 0)
    placement = resolve_precision(torch.device("cpu"), "bf16")
    step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                     chunked_loss=False)
    wrapped = AttentionInterface._global_mapping["sdpa"]
    assert getattr(wrapped, "ptbr_wrapped", False)
    used = []
    original = attention.flash_attention_fp32_backward
    monkeypatch.setattr(attention, "flash_attention_fp32_backward", lambda *a: used.append(1) or original(*a))
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 512, size=(2, 33)))

    def loss(function):
        AttentionInterface._global_mapping["sdpa"] = function
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss

    assert torch.equal(loss(wrapped), loss(wrapped.__wrapped__)) and len(used) == 2  # one per layer
    AttentionInterface._global_mapping["sdpa"] = wrapped
    step.train_step([windows_to_batch(ids.numpy())], 1e-4)
    assert len(used) == 4
