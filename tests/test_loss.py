"""The chunked cross-entropy (ptbr/backends/torch/loss.py, --chunked-loss): the same loss and
gradients as the whole logits through F.cross_entropy, a chunk of tokens at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ptbr import memory
from ptbr.backends.torch import loss as chunked
from ptbr.data.batch import IGNORE_INDEX

N, H, V = 50, 16, 100


@pytest.fixture
def seven_tokens_a_chunk(monkeypatch):
    """Chunks of 7 tokens at a vocabulary of 100: 50 tokens make 7 full chunks and a short one."""
    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * V * 7)
    assert chunked.chunk_tokens(V) == 7


def inputs(weight_grad: bool = True):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=generator, requires_grad=True)
    weight = torch.randn(V, H, generator=generator, requires_grad=weight_grad)
    labels = torch.randint(0, V, (N,), generator=generator)
    labels[::5] = IGNORE_INDEX
    labels[-1] = IGNORE_INDEX  # in the short last chunk too
    return hidden, weight, labels


def whole(hidden, weight, labels, dtype):
    return F.cross_entropy((hidden.to(dtype) @ weight.to(dtype).T).float(), labels, ignore_index=IGNORE_INDEX,
                           reduction="sum")


def gradients(loss_fn, hidden, weight, labels, dtype, scale=0.37):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels, dtype)
    (loss * scale).backward()  # the step scales the summed loss by world size / target tokens
    return loss.item(), hidden.grad, weight.grad


def test_chunk_size_is_32_mib_of_fp32_logits_256_on_a_gpu():
    assert memory.CHUNK_BYTES == 32 * 1024**2
    assert chunked.chunk_tokens(32000) == 262
    assert chunked.chunk_tokens(128256) == 65  # Llama 3's vocabulary
    assert chunked.chunk_tokens(10**9) == 1
    # on a CUDA GPU 256 MiB (fewer, larger kernels; measured on an H200, README "Performance")
    assert chunked.chunk_tokens(32000, "cuda") == 2097 and chunked.chunk_tokens(32000, "mps") == 262


def test_a_16_bit_trained_output_layer_takes_chunks_of_at_least_twice_its_hidden_size():
    """Where the output layer's gradient is summed from 16-bit products, each chunk writes and adds
    a (vocab x hidden) product: a chunk holds at least 2 x hidden tokens. Not in fp32, nor for a
    frozen output layer (LoRA)."""
    assert memory.CHUNK_TOKENS_PER_HIDDEN == 2
    assert chunked.chunk_tokens(32000, "cpu", 640) == 1280 and chunked.chunk_tokens(32000, "cuda", 640) == 2097
    assert chunked.chunk_tokens(32000, "cuda", 1536) == 3072  # 800m
    assert memory.gradient_summed_hidden(640, "bf16") == memory.gradient_summed_hidden(640, "fp16") == 640
    assert memory.gradient_summed_hidden(640, "fp32") == 0 == memory.gradient_summed_hidden(640, "bf16", trained=False)
    weight = torch.zeros(32000, 640, requires_grad=True)
    assert chunked.chunk_size(weight, torch.bfloat16, "cpu") == 1280
    assert chunked.chunk_size(weight, torch.float32, "cpu") == 262
    assert chunked.chunk_size(weight.detach(), torch.bfloat16, "cpu") == 262  # frozen


def test_the_loss_takes_its_device_s_chunk(monkeypatch):
    """The chunk follows the hidden states' device (CUDA's is checked on a GPU, tests/test_gpu.py)."""
    chunks, apply = [], chunked._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(chunked._ChunkedLinearCrossEntropy, "apply", lambda *a: chunks.append(a[4]) or apply(*a))
    hidden = torch.randn(300, 8, requires_grad=True)
    chunked.chunked_cross_entropy(hidden, torch.randn(32000, 8), torch.zeros(300, dtype=torch.long)).backward()
    assert chunks == [262]


def test_fp32_loss_and_gradients_are_the_whole_logits_ones(seven_tokens_a_chunk):
    hidden, weight, labels = inputs()
    expected = gradients(whole, hidden, weight, labels, torch.float32)
    got = gradients(chunked.chunked_cross_entropy, hidden, weight, labels, torch.float32)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=2e-6)
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=2e-6)
    assert float(got[1][::5].abs().max()) == 0.0  # an ignored token gets no gradient
    assert float(got[1].abs().max()) > 0.1


def test_bf16_computes_the_same_bf16_logits(seven_tokens_a_chunk):
    """In bf16 the logits are the same bf16 products, upcast: the same loss but for the order of
    its sum. The gradients differ by bf16 rounding (the whole way rounds the scaled gradient of the
    logits, the chunked way the unscaled one, and sums the weight's gradient in fp32)."""
    hidden, weight, labels = inputs()
    expected = gradients(whole, hidden, weight, labels, torch.bfloat16)
    got = gradients(chunked.chunked_cross_entropy, hidden, weight, labels, torch.bfloat16)
    exact = gradients(whole, hidden, weight, labels, torch.float32)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    for index in (1, 2):
        assert got[index].dtype == torch.float32
        chunked_error = float((got[index] - exact[index]).abs().max())
        whole_error = float((expected[index] - exact[index]).abs().max())
        assert chunked_error <= 1.5 * whole_error


def test_a_frozen_output_layer_gets_no_gradient(seven_tokens_a_chunk):
    """LoRA and QLoRA: the output layer is frozen; only the hidden states' gradient is made."""
    hidden, weight, labels = inputs(weight_grad=False)
    expected = gradients(whole, hidden, weight, labels, torch.float32)
    got = gradients(chunked.chunked_cross_entropy, hidden, weight, labels, torch.float32)
    assert got[2] is None and expected[2] is None
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=2e-6)


def test_without_gradients_only_the_loss_is_computed(seven_tokens_a_chunk):
    hidden, weight, labels = inputs()
    with torch.no_grad():
        loss = chunked.chunked_cross_entropy(hidden, weight, labels)
    assert loss.grad_fn is None
    assert loss.item() == pytest.approx(whole(hidden, weight, labels, torch.float32).item(), rel=1e-6)


def test_only_ignored_tokens_give_zero():
    hidden, weight, labels = inputs()
    loss = chunked.chunked_cross_entropy(hidden, weight, torch.full_like(labels, IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and float(hidden.grad.abs().max()) == 0.0 and float(weight.grad.abs().max()) == 0.0


def test_the_output_layer_returns_nothing_while_its_input_is_taken():
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(2, 3, H)
    with chunked.hidden_states_of(head) as seen:
        out = head(hidden)
    assert out.shape == (2, 3, 0)
    assert seen["hidden"] is hidden and seen["weight"] is head.weight
    assert head(hidden).shape == (2, 3, V) and "forward" not in head.__dict__  # the class's forward again

    def own(x):  # a forward of the instance's own (accelerate's hooks set one): kept
        return x

    head.forward = own
    with chunked.hidden_states_of(head):
        pass
    assert head.forward is own


def test_only_a_plain_output_layer_is_chunked(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32)
    model = LlamaForCausalLM(config)
    assert chunked.chunkable_head(model) == (model.lm_head, None)
    adapted = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
    assert chunked.chunkable_head(adapted) == (adapted.base_model.model.lm_head, None)
    assert adapted.training  # the check runs the model in evaluation mode, and leaves it as it was
    adapted_head = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    head, why = chunked.chunkable_head(adapted_head)
    assert head is None and "plain Linear" in why


@pytest.mark.parametrize("family", ["gemma2", "cohere"])
def test_a_model_that_changes_its_logits_after_the_output_layer_keeps_the_whole_logits(family):
    """Gemma-2 soft-caps its logits (30 tanh(logits / 30)), Cohere scales them (logit_scale 0.0625):
    the chunked loss, computed from the output layer's input and weight, would leave that out and
    train on another loss than the model's. Even at a random initialisation, where the cap changes
    the small logits by less than 1e-3, the check sees it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, intermediate_size=32, head_dim=8)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=2, target_modules=["q_proj"]))
    head, why = chunked.chunkable_head(model)
    assert head is None and "its logits are not its output layer's output" in why
    with torch.no_grad():  # what the check saw: logits other than the output layer's, by little
        hidden = model(input_ids=torch.arange(4)[None], output_hidden_states=True).hidden_states[-1]
        gap = (model(input_ids=torch.arange(4)[None]).logits - model.get_output_embeddings()(hidden)).abs().max()
    assert 0 < float(gap) < (1e-3 if family == "gemma2" else 1.0)


def _steps(chunked_loss: bool, precision: str, steps: int = 3, init_scale: float | None = None):
    from ptbr.backends.torch.device import Placement, resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PRESETS, LoopSettings
    from ptbr.data.batch import windows_to_batch

    model = build_model(PRESETS["tiny"], 300, eos_id=0, seed=0)
    # fp16 with GradScaler is a GPU's (ptbr refuses it on a CPU), but torch's CPU autocast and
    # GradScaler compute it too: the same code path as a T4's, here
    placement = (Placement(torch.device("cpu"), "fp16", "test") if precision == "fp16" else
                 resolve_precision(torch.device("cpu"), precision))
    step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                     chunked_loss=chunked_loss)
    assert (step.head is not None) == chunked_loss and step.scaler.is_enabled() == (precision == "fp16")
    if init_scale is not None:
        step.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    windows = np.random.default_rng(0).integers(0, 300, size=(12, 33))
    batch = {k: v.copy() for k, v in windows_to_batch(windows).items()}  # labels are a view of the windows
    batch["labels"][1, :7] = IGNORE_INDEX
    micro = [{k: v[:8] for k, v in batch.items()}, {k: v[8:] for k, v in batch.items()}]
    results = [step.train_step(micro, 1e-4) for _ in range(steps)]
    return results, {n: p.detach().clone() for n, p in model.named_parameters()}, step.eval_loss([batch])


@pytest.mark.parametrize("precision, tolerance, norms, weights", [("fp32", 1e-6, 1e-5, 2e-5),
                                                                  ("bf16", 1e-4, 1e-2, None),
                                                                  ("fp16", 1e-4, 1e-3, None)])
def test_training_steps_are_the_whole_logits_ones(monkeypatch, precision, tolerance, norms, weights):
    """Three AdamW steps (learning rate 1e-4: each moves a weight by up to 1e-4) of two uneven
    micro-batches, chunked and whole: the same losses, gradient norms and, in fp32, weights, within
    float noise (AdamW amplifies it in small gradients: one embedding weight of 38,400 ends 1.4e-5
    apart, a seventh of one step's 1e-4; the gradients themselves are the whole logits' to float
    noise, see test_fp32_loss_and_gradients_are_the_whole_logits_ones). In bf16 the gradients differ by bf16's
    rounding (1e-3 of the norm), which AdamW turns into whole updates of opposite sign where a
    gradient is near zero: its weights are not compared; nor in fp16, where the chunked loss
    scales its gradients by GradScaler's factor after the 16-bit matmuls, the whole logits before.
    Chunks of 50 tokens: the micro-batches of 256 and 128 tokens make 6 and 3 chunks (and the whole
    path's are counted not to chunk)."""
    calls = []
    real = chunked.chunked_cross_entropy

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * 300 * 50)
    monkeypatch.setattr(memory, "CHUNK_TOKENS_PER_HIDDEN", 0)  # in bf16 and fp16 too
    monkeypatch.setattr(chunked, "chunked_cross_entropy", counted)
    chunked_results, chunked_weights, chunked_eval = _steps(True, precision)
    # 3 steps of 2 micro-batches (256 and 128 tokens), then the evaluation of the 384 tokens at once
    assert calls == [256, 128] * 3 + [384]
    whole_results, whole_weights, whole_eval = _steps(False, precision)
    assert len(calls) == 7
    for a, b in zip(chunked_results, whole_results, strict=True):
        assert (a.target_tokens, a.input_tokens, a.skipped) == (b.target_tokens, b.input_tokens, b.skipped)
        assert a.loss == pytest.approx(b.loss, rel=tolerance)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=norms)
    assert chunked_eval == pytest.approx(whole_eval, rel=tolerance)
    for name in whole_weights if weights else ():
        torch.testing.assert_close(chunked_weights[name], whole_weights[name], rtol=0, atol=weights, msg=name)


def test_gradscaler_skips_the_same_overflowing_steps_with_the_chunked_loss(monkeypatch):
    """fp16 from a loss scale of 2**30: the gradients overflow fp16 and GradScaler skips the step
    and halves its scale, nine times, then training goes on; the chunked loss computes its
    gradients unscaled and multiplies them by the scale in fp32, so they must overflow in the
    decoder's fp16 backward pass just as the whole logits' do: the same steps skipped (a gradient
    norm that is not finite), the same scale after them, and the same losses."""
    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * 300 * 50)
    monkeypatch.setattr(memory, "CHUNK_TOKENS_PER_HIDDEN", 0)  # in bf16 and fp16 too
    runs = [_steps(chunked_loss, "fp16", steps=12, init_scale=2.0**30)[0] for chunked_loss in (True, False)]
    for results in runs:
        assert [np.isfinite(r.grad_norm) for r in results] == [False] * 9 + [True] * 3
        assert not any(r.skipped for r in results)  # routine in fp16: not counted as a divergence
    assert [r.loss for r in runs[0]] == pytest.approx([r.loss for r in runs[1]], rel=1e-4)
    assert runs[0][0].loss == runs[0][9].loss != runs[0][10].loss  # nothing moved until the scale fit


def test_the_step_chunks_a_16_bit_trained_output_layer_by_twice_its_hidden_size(monkeypatch):
    """The step and the loss take their chunks by one rule: 50-token chunks in fp32 (and for a
    frozen output layer), 2 x 128 = 256 tokens for `tiny` trained in bf16. A micro-batch of 32
    tokens is one chunk in fp32 and for a frozen output layer; trained in bf16 it takes the whole
    logits (fewer tokens than the hidden size)."""
    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PRESETS, LoopSettings
    from ptbr.data.batch import windows_to_batch

    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * 300 * 50)
    chunks, apply = [], chunked._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(chunked._ChunkedLinearCrossEntropy, "apply", lambda *a: chunks.append(a[4]) or apply(*a))
    # (precision, frozen, tokens per chunk, fewest tokens chunked: the hidden size in bf16, else any)
    for precision, frozen, expected, fewest in (("fp32", False, 50, 1), ("bf16", False, 256, 128),
                                                ("bf16", True, 50, 1)):
        model = build_model(PRESETS["tiny"], 300, eos_id=0, seed=0)
        model.get_output_embeddings().weight.requires_grad_(not frozen)
        placement = resolve_precision(torch.device("cpu"), precision)
        step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                         chunked_loss=True)
        assert step.loss_chunk() == expected
        assert step.chunked_from() == fewest
        for rows, taken in ((expected // 32 + 1, [expected]), (1, [expected] if fewest == 1 else [])):
            windows = np.random.default_rng(0).integers(0, 300, size=(rows, 33))
            batch = {k: v.copy() for k, v in windows_to_batch(windows).items()}
            chunks.clear()
            step.train_step([batch], 1e-4)
            assert chunks == taken  # by the step's chunk, or the whole logits


def test_a_16_bit_trained_output_layer_takes_one_chunk_from_its_hidden_size(monkeypatch):
    """Logits that fit one chunk (32 MiB: 27,962 tokens at a 300-token vocabulary) go through the
    chunked loss as one chunk from 128 tokens of `tiny` in bf16 on (its hidden size); 96 tokens
    take the whole logits; and the memory model plans each micro-batch the way the step runs it."""
    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PRESETS, LoopSettings
    from ptbr.data.batch import windows_to_batch
    from ptbr.memory import Architecture, estimate_training_memory

    chunks, apply = [], chunked._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(chunked._ChunkedLinearCrossEntropy, "apply", lambda *a: chunks.append(a[4]) or apply(*a))
    model = build_model(PRESETS["tiny"], 300, eos_id=0, seed=0)
    placement = resolve_precision(torch.device("cpu"), "bf16")
    step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                     chunked_loss=True)
    assert (step.loss_chunk(), step.chunked_from()) == (27962, 128)
    arch = Architecture.from_preset(PRESETS["tiny"], 300)
    for rows, taken in ((4, [27962]), (3, [])):
        windows = np.random.default_rng(0).integers(0, 300, size=(rows, 33))
        chunks.clear()
        step.train_step([{k: v.copy() for k, v in windows_to_batch(windows).items()}], 1e-4)
        assert chunks == taken
        planned = [estimate_training_memory(arch, rows, 32, "bf16", chunked_loss=chunked) for chunked in (True, False)]
        assert (planned[0] != planned[1]) == bool(taken)


def test_the_log_softmax_out_of_place_is_the_in_place_one(monkeypatch, seven_tokens_a_chunk):
    """On devices not known to compute log-softmax in place (Apple's MPS) the chunk takes a second
    buffer: the same numbers, bit for bit (here on CPU, both ways)."""
    hidden, weight, labels = inputs()
    in_place = gradients(chunked.chunked_cross_entropy, hidden, weight, labels, torch.float32)
    monkeypatch.setattr(chunked, "IN_PLACE_DEVICES", ())
    apart = gradients(chunked.chunked_cross_entropy, hidden, weight, labels, torch.float32)
    assert in_place[0] == apart[0]
    assert torch.equal(in_place[1], apart[1]) and torch.equal(in_place[2], apart[2])
    assert memory.IN_PLACE_DEVICES == ("cpu", "cuda")


@pytest.mark.parametrize("batch, precision, line", [
    (2, "fp32", "chunked loss: 4096 tokens per chunk at vocabulary 2,048; micro-batches of 64 tokens take one chunk"),
    (4, "bf16", "chunked loss: 4096 tokens per chunk at vocabulary 2,048; micro-batches of 128 tokens take one chunk"),
    (2, "bf16", "chunked loss: 4096 tokens per chunk at vocabulary 2,048; micro-batches of 64 tokens take the whole "
                "logits (fewer than 128: below that the output layer's gradient"),
])
def test_the_start_up_log_says_what_the_micro_batches_take(tmp_path, batch, precision, line):
    """`tiny` (hidden 128) on the bundled sample: 2 x 32 tokens are one chunk in fp32; in bf16 from
    128 tokens on, fewer take the whole logits."""
    from tests.test_training import train

    train(tmp_path / "run", "--batch-size", str(batch), "--max-steps", "1", "--precision", precision)
    assert line in (tmp_path / "run" / "train.log").read_text()
