"""Grouped-query attention where flash attention cannot run (fp32 on a GPU, fp16 on a T4): ptbr
makes transformers repeat the key/value heads there rather than pass enable_gqa=True, which sends
torch's SDPA to its math kernel (ptbr/backends/torch/attention.py; the GPU's side is in
tests/test_gpu.py)."""

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


def test_a_training_step_on_cpu_installs_nothing():
    """The wrapper is installed for CUDA placements only (TorchStep, generate)."""
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
