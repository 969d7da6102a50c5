"""What only a CUDA GPU shows: mixed precision, GradScaler, device memory. Skipped without one."""

from __future__ import annotations

import json

import pytest
import torch

from ptbr.cli import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_auto_precision_picks_real_bf16_or_fp16_with_a_scaler(tmp_path):
    from ptbr.backends.torch.device import has_real_bf16, resolve_precision

    placement = resolve_precision(torch.device("cuda"), "auto")
    assert placement.precision == ("bf16" if has_real_bf16() else "fp16")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_training_learns_on_the_gpu(tmp_path, precision):
    from ptbr.backends.torch.device import has_real_bf16

    if precision == "bf16" and not has_real_bf16():
        pytest.skip("this GPU has no native bf16")
    out = tmp_path / "run"
    assert main(["train", "--output", str(out), "--model-size", "tiny", "--seq-len", "128", "--batch-size", "8",
                 "--max-steps", "60", "--device", "cuda", "--precision", precision]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(row["mem_bytes"] > 0 for row in rows)
    # the allocator's peak so far: it never falls, and the last is at most the process's peak now
    assert [row["mem_bytes"] for row in rows] == sorted(row["mem_bytes"] for row in rows)
    assert rows[-1]["mem_bytes"] <= torch.cuda.max_memory_allocated()


def test_test_gpu_prints_the_allocator_s_peak(capsys):
    """The probe's peak: torch.cuda.max_memory_allocated, reset when the probe begins."""
    import re

    assert main(["test-gpu", "--model-size", "tiny", "--seq-len", "512", "--batch-size", "32", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"peak memory (\d+\.\d\d) GiB \(the allocator's peak since the probe began\)$", out, flags=re.M)
    assert found, out
    assert found[1] == f"{torch.cuda.max_memory_allocated() / 1024**3:.2f}"


def test_bf16_is_refused_where_only_emulated(tmp_path):
    from ptbr.backends.torch.device import has_real_bf16

    if has_real_bf16():
        pytest.skip("this GPU has native bf16")
    assert main(["train", "--output", str(tmp_path), "--device", "cuda", "--precision", "bf16",
                 "--max-steps", "1"]) == 5


def train(out, precision: str, *extra: str) -> int:
    return main(["train", "--output", str(out), "--model-size", "tiny", "--seq-len", "128", "--batch-size", "8",
                 "--max-steps", "6", "--save-every", "3", "--eval-every", "3", "--eval-batches", "2",
                 "--device", "cuda", "--precision", precision, *extra])


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_run_resumed_on_the_gpu_repeats_the_uninterrupted_one(tmp_path, precision):
    """Resumed from its step-3 checkpoint, a mixed-precision GPU run repeats steps 4-6 of the
    uninterrupted run (GradScaler, CUDA RNG and pinned-memory batches included), as closely as two
    uninterrupted runs repeat each other (some CUDA backward kernels add atomically, so a GPU's run
    is not always bit-for-bit repeatable; where it is, the resumed run must be too)."""
    from safetensors.torch import load_file

    from ptbr.backends.torch.device import has_real_bf16

    if precision == "bf16" and not has_real_bf16():
        pytest.skip("this GPU has no native bf16")
    out, again = tmp_path / "run", tmp_path / "again"
    assert train(out, precision) == 0 and train(again, precision) == 0
    assert train(out, precision, "--resume", str(out / "checkpoints" / "step_000003")) == 0
    (straight,) = (out / "previous").iterdir()

    def after_resume(run) -> list[float]:
        return [value for row in metrics(run)[3:] for value in (row["loss"], row["grad_norm"], row["val_loss"] or 0.0)]

    def weights(run) -> dict:
        return load_file(str(run / "checkpoints" / "step_000006" / "model.safetensors"))

    noise = max(abs(a - b) for a, b in zip(after_resume(straight), after_resume(again), strict=True))
    drift = max(abs(a - b) for a, b in zip(after_resume(straight), after_resume(out), strict=True))
    print(f"{precision}: uninterrupted runs differ by {noise:.3g}, the resumed run by {drift:.3g}")
    assert drift <= noise
    if noise == 0:
        a, b = weights(straight), weights(out)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_compile_on_the_gpu_takes_the_whole_16_bit_logits(tmp_path, monkeypatch):
    """--compile on a GPU in bf16/fp16 (tiny, 8 x 256 tokens: one chunk of the chunked loss eager):
    the loss is compiled with the forward pass over the whole 16-bit logits (never the decoder
    alone), as the start-up line says, and the run learns."""
    from ptbr.backends.torch.device import has_real_bf16
    from ptbr.backends.torch.step import TorchStep

    def decoder_alone(*args):
        raise AssertionError("the decoder alone was compiled: the chunked loss's path")

    monkeypatch.setattr(TorchStep, "_decoder_hidden_states", decoder_alone)

    out = tmp_path / "run"
    precision = "bf16" if has_real_bf16() else "fp16"
    assert main(["train", "--output", str(out), "--model-size", "tiny", "--seq-len", "256", "--batch-size", "8",
                 "--max-steps", "60", "--device", "cuda", "--precision", precision, "--compile"]) == 0
    assert ("chunked loss: not under --compile here: micro-batches of 2048 tokens take the whole 16-bit logits"
            in (out / "train.log").read_text())
    rows = metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_graphs_replay_the_compiled_step(tmp_path, monkeypatch, precision):
    """--compile on a GPU, one micro-batch a step: the compiled forward and backward passes replay as
    CUDA graphs (the default, --cuda-graphs), as the start-up line says; the run trains as the same
    compiled run without them (to the rounding of attention's atomic backward kernels), resumes
    from a checkpoint, and a run of two micro-batches a step (which cannot take them) says why. In
    fp16 (a T4's precision) GradScaler scales the graphed loss and unscales its gradients."""
    from ptbr.backends.torch.device import has_real_bf16

    if precision == "bf16" and not has_real_bf16():
        pytest.skip("this GPU has no native bf16")
    graphed, plain, accumulated = tmp_path / "graphed", tmp_path / "plain", tmp_path / "accumulated"
    shape = ("--seq-len", "256", "--batch-size", "8", "--max-steps", "12", "--save-every", "6", "--eval-every", "6")

    def run(out, *extra):
        return main(["train", "--output", str(out), "--model-size", "tiny", *shape, "--device", "cuda",
                     "--precision", precision, "--compile", *extra])

    replays, replay = [], torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    assert run(graphed) == 0
    assert len(replays) >= 12  # a forward and a backward graph a step, once recorded
    replays.clear()
    assert run(plain, "--no-cuda-graphs") == 0 and replays == []
    assert "replay as CUDA graphs" in (graphed / "train.log").read_text()
    assert "CUDA graphs" not in (plain / "train.log").read_text()
    losses = [[r["loss"] for r in metrics(out)] for out in (graphed, plain)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-2) and losses[0][-1] < losses[0][0]
    assert run(graphed, "--resume", str(graphed / "checkpoints" / "step_000006")) == 0
    assert [r["loss"] for r in metrics(graphed)][6:] == pytest.approx(losses[0][6:], rel=1e-2)
    assert run(accumulated, "--batch-size", "4", "--grad-accum", "2") == 0
    assert "CUDA graphs: not with 2 micro-batches a step" in (accumulated / "train.log").read_text()


@pytest.fixture(scope="module")
def small_base(tmp_path_factory):
    """A random Mistral-shaped base (GQA, SwiGLU) with a tokenizer trained on PT-BR sentences, and
    a JSONL of those sentences to fine-tune on."""
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    from ptbr.data.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer
    from tests.conftest import PT_TEXT

    root = tmp_path_factory.mktemp("gpu-base")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(PT_TEXT * 4, vocab_size=384, min_frequency=1),
                                        eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tokenizer.save_pretrained(root / "base")
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=448, max_position_embeddings=256,
                           initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(root / "base")
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                              for t in PT_TEXT * 4), encoding="utf-8")
    return root


@pytest.mark.parametrize("quant, precision", [("4bit", "bf16"), ("4bit", "fp16"), ("8bit", "fp16"), ("none", "bf16")])
def test_finetuning_on_the_gpu_learns_merges_and_generates(small_base, tmp_path, capsys, quant, precision):
    """bitsandbytes on CUDA (NF4 and int8 bases), fp16 with its GradScaler (a T4's precision) and
    bf16: the adapter learns the sentences, merges into the base, and the merged model generates."""
    from ptbr.backends.torch.device import has_real_bf16

    if precision == "bf16" and not has_real_bf16():
        pytest.skip("this GPU has no native bf16")
    out = tmp_path / "run"
    assert main(["finetune", "--base", str(small_base / "base"), "--data", str(small_base / "train.jsonl"),
                 "--output", str(out), "--quant", quant, "--precision", precision, "--device", "cuda",
                 "--lora-r", "8", "--batch-size", "4", "--max-steps", "24", "--learning-rate", "1e-2",
                 "--eval-every", "0", "--merge"]) == 0
    rows = metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, [r["loss"] for r in rows]
    assert all(row["mem_bytes"] > 0 for row in rows)
    capsys.readouterr()
    assert main(["generate", "--model", str(out / "merged"), "--raw", "O sol nasceu", "--temperature", "0",
                 "--max-new-tokens", "8", "--device", "cuda"]) == 0
    assert capsys.readouterr().out.strip()


def test_fp32_grouped_query_attention_keeps_no_attention_matrices():
    """85m has 10 heads over 5 key/value heads. In fp32 transformers' enable_gqa sent SDPA to its
    math kernel (every layer's 8 x 10 x 1024 x 1024 fp32 attention matrix kept: 4.7 GB here, and
    at 32 x 1024 an H200 peaked at 53 GiB against 35 GiB predicted); with the key/value heads
    repeated the memory-efficient kernel runs, and the peak is the memory model's."""
    import numpy as np

    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import LoopSettings, get_preset
    from ptbr.data.batch import windows_to_batch
    from ptbr.memory import Architecture, estimate_training_memory

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    placement = resolve_precision(torch.device("cuda"), "fp32")
    model = build_model(get_preset("85m"), 32000, 0, 0).to(placement.device)
    step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                     chunked_loss=False)
    batch = windows_to_batch(np.random.default_rng(0).integers(0, 32000, size=(8, 1025)))
    for _ in range(2):
        step.train_step([batch], 1e-4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step.train_step([batch], 1e-4)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    predicted = estimate_training_memory(Architecture.from_preset(get_preset("85m"), 32000), 8, 1024, "fp32",
                                         device="cuda").total  # K and V saved repeated
    print(f"fp32 85m 8 x 1024: predicted {predicted / 2**20:,.0f} MiB, measured {measured / 2**20:,.0f} MiB")
    # the other H200 rows were within 1.3%; the repeated K and V are 3% here, the math kernel's matrices 50%
    assert abs(measured - predicted) / predicted < 0.02


def test_bf16_on_a_flash_gpu_keeps_the_grouped_query_path(monkeypatch):
    """Under bf16 autocast the keys reach transformers' choice in fp32; on Ampere and newer flash
    attention takes enable_gqa, and ptbr's wrapper must leave that choice (no repeated heads)."""
    import numpy as np
    from transformers.integrations import sdpa_attention

    from ptbr.backends.torch.device import has_real_bf16, resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import LoopSettings, get_preset
    from ptbr.data.batch import windows_to_batch

    if not has_real_bf16() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs Ampere or newer")
    placement = resolve_precision(torch.device("cuda"), "bf16")
    model = build_model(get_preset("85m"), 32000, 0, 0).to(placement.device)
    step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                     chunked_loss=False)  # installs the wrapper
    wrapped, answers = sdpa_attention.use_gqa_in_sdpa, []
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda *a, **k: answers.append(wrapped(*a, **k)) or answers[-1])
    step.train_step([windows_to_batch(np.random.default_rng(0).integers(0, 32000, size=(2, 257)))], 1e-4)
    assert answers and all(answers), answers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_on_the_gpu_is_the_whole_logits_loss(dtype, monkeypatch):
    """CUDA's 256 MiB chunks (2,097 tokens at a 32k vocabulary): 5,000 tokens make two full chunks
    and a short one; loss and gradients as F.cross_entropy over the whole logits."""
    import torch.nn.functional as F

    from ptbr.backends.torch.loss import chunked_cross_entropy
    from ptbr.data.batch import IGNORE_INDEX
    from ptbr.memory import chunk_tokens

    assert chunk_tokens(32000, "cuda") == 2097
    from ptbr.backends.torch import loss

    chunks, apply = [], loss._ChunkedLinearCrossEntropy.apply  # the chunk the loss really takes
    monkeypatch.setattr(loss._ChunkedLinearCrossEntropy, "apply", lambda *a: chunks.append(a[4]) or apply(*a))
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(5000, 64, device="cuda", generator=generator, requires_grad=True)
    weight = torch.randn(32000, 64, device="cuda", generator=generator, requires_grad=True)
    labels = torch.randint(0, 32000, (5000,), device="cuda", generator=generator)
    labels[::7] = IGNORE_INDEX

    def run(loss_fn):
        hidden.grad = weight.grad = None
        loss = loss_fn()
        (0.37 * loss).backward()
        return loss.detach(), hidden.grad.clone(), weight.grad.clone()

    ours = run(lambda: chunked_cross_entropy(hidden, weight, labels, dtype))
    whole = run(lambda: F.cross_entropy((hidden.to(dtype) @ weight.to(dtype).T).float(), labels,
                                        ignore_index=IGNORE_INDEX, reduction="sum"))
    assert chunks == [2097]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(ours, whole, strict=True):
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item()), (a - b).abs().max()
