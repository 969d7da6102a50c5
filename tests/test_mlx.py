"""The MLX backend for real, on mlx[cpu]: the same loss, gradient norm and AdamW update as torch on
the same weights and batch; LoRA and 4-bit QLoRA fine-tuning of the tiny Mistral-shaped base of
tests/test_finetune.py, and pretraining of `tiny`, through ptbr's runs and CLI; exact resume;
adapters that load in mlx_lm and, converted, in PEFT; final/ that loads in transformers."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tests.test_finetune as finetune_tests
from ptbr.cli import main
from tests.conftest import nan_model

pytest.importorskip("mlx.core")
try:  # through ptbr, as ptbr imports it: a plain `import mlx_lm` lowers the open-file limit for good
    from ptbr.backends.mlx.file_limit import load_mlx_lm

    load_mlx_lm()
except ImportError:
    pytest.skip("mlx_lm is not installed", allow_module_level=True)

toy = finetune_tests.toy  # a tiny Mistral base (hidden 64, 2 layers, GQA) and chat data
REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # torch and MLX order their fp32 sums differently; that is all that separates them


def settings(toy, output: Path, **overrides):
    return finetune_tests.settings(toy, output, **({"backend": "mlx", "device": "cpu"} | overrides))


def mlx_logits(model, ids: np.ndarray) -> np.ndarray:
    import mlx.core as mx

    model.eval()  # LoRA dropout off
    return np.array(model(mx.array(ids)).astype(mx.float32))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids)).logits.numpy()


def real_tokens(batch: dict) -> np.ndarray:
    """A batch's input ids without its padded columns (every row of a toy batch is real up to its
    own length; logits are compared on the rows' common prefix)."""
    mask = np.asarray(batch["attention_mask"])
    return np.asarray(batch["input_ids"])[:, :int(mask.sum(1).min())]


# ---- the seam: nothing of the MLX path imports torch ------------------------------------------------


def ptbr_imports(path: Path) -> tuple[set[str], set[str]]:
    """(ptbr modules, other top-level modules) that a file imports, at any depth of its code."""
    ours, others = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        for name in names:
            (ours if name.split(".")[0] == "ptbr" else others).add(name)
    return ours, {name.split(".")[0] for name in others}


def module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_no_module_of_the_mlx_backend_imports_torch_even_through_ptbr():
    """Every module under ptbr/backends/mlx and every ptbr module they import, transitively: none
    imports torch (peft, bitsandbytes, accelerate), not even inside a function. The one import not
    followed is the backend factory's torch branch (ptbr/backends/__init__.py), which only
    --backend torch takes."""
    start = sorted((REPO / "ptbr" / "backends" / "mlx").glob("*.py")) + [REPO / "ptbr" / "finetune" / "export.py",
                                                                        REPO / "ptbr" / "commands" / "export_adapter.py"]
    seen, todo, offenders = set(), list(start), []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        ours, others = ptbr_imports(path)
        if others & {"torch", "peft", "bitsandbytes", "accelerate"}:
            offenders.append(f"{path.relative_to(REPO)}: {sorted(others & {'torch', 'peft', 'bitsandbytes'})}")
        for name in ours - ({"ptbr.backends.torch"} if path == REPO / "ptbr" / "backends" / "__init__.py" else set()):
            parts = name.split(".")
            for depth in range(2, len(parts) + 1):  # the package's __init__ runs too
                found = module_file(".".join(parts[:depth]))
                if found is not None:
                    todo.append(found)
    assert len(seen) > 10 and not offenders, offenders


# ---- the same numbers as torch -------------------------------------------------------------------


def step_batches(vocab: int, rows: int, length: int, seed: int) -> list[dict]:
    """Two micro-batches of different target counts (some labels masked), as pretraining windows.
    Ids 0 and 1 (eos and padding) are left out: transformers' embedding never passes a gradient to
    the padding token's row (padding_idx), MLX's embedding does."""
    rng = np.random.default_rng(seed)
    batches = []
    for masked in (0, 7):
        windows = rng.integers(2, vocab, (rows, length + 1))
        labels = windows[:, 1:].copy()
        labels[0, :masked] = -100
        batches.append({"input_ids": windows[:, :-1], "labels": labels})
    return batches


@pytest.mark.slow
def test_pretraining_step_matches_torch_on_the_same_weights(tmp_path):
    """tiny in fp32: MLX writes its freshly initialised model as a Hugging Face folder, torch loads
    it; on the same two micro-batches both report the same loss and gradient norm, and after one
    AdamW update (clipped: the norm is above max_grad_norm 0.5) the same loss again."""
    import torch
    from transformers import AutoModelForCausalLM

    from ptbr.backends.mlx import MlxBackend
    from ptbr.backends.torch import TorchBackend
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PRESETS, PretrainConfig

    config = PretrainConfig(seq_len=32, batch_size=2, max_grad_norm=0.5, learning_rate=3e-3, seed=5)
    mlx_backend, torch_backend = MlxBackend.create("cpu", "fp32"), TorchBackend.create("cpu", "fp32")
    mlx_step = mlx_backend.pretrain_step(PRESETS["tiny"], 512, 0, 1, config)
    mlx_backend.write_model(mlx_step, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.tie_word_embeddings and mlx_backend.parameter_count(mlx_step) == PRESETS["tiny"].param_count(512)
    assert float(model.model.embed_tokens.weight[1].abs().sum()) == 0.0  # the padding row, as transformers'
    torch_step = TorchStep(model, build_optimizer(model, config, torch_backend.placement.device),
                           torch_backend.placement, config.max_grad_norm, chunked_loss=config.chunked_loss)

    batches = step_batches(512, 2, 32, seed=0)
    for lr in (3e-3, 1e-3):
        a, b = mlx_step.train_step(batches, lr), torch_step.train_step(batches, lr)
        assert (a.target_tokens, a.input_tokens, a.skipped) == (b.target_tokens, b.input_tokens, b.skipped) == (121, 128, False)
        assert a.loss == pytest.approx(b.loss, abs=TOLERANCE) and a.grad_norm == pytest.approx(b.grad_norm, abs=TOLERANCE)
    assert a.grad_norm > config.max_grad_norm
    assert mlx_step.eval_loss(batches) == pytest.approx(torch_step.eval_loss(batches), abs=TOLERANCE)


@pytest.mark.slow
def test_lora_step_matches_peft_on_the_same_adapter(toy, tmp_path):
    """The toy base with MLX's seeded adapter, and the same adapter exported to PEFT on torch: the
    same loss and gradient norm on the same chat batch, step after step."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ptbr.backends.mlx import MlxBackend
    from ptbr.backends.torch import TorchBackend
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.finetune.base import load_tokenizer
    from ptbr.finetune.batches import collate
    from ptbr.finetune.data import inspect_jsonl
    from ptbr.finetune.export import export_adapter

    config = settings(toy, tmp_path / "run", lora_dropout=0.0, precision="fp32")
    backend = MlxBackend.create("cpu", "fp32")
    adapted = backend.load_adapted(config)
    assert adapted.trainable_parameters == 16384 and adapted.target_modules == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    (tmp_path / "mlx").mkdir()
    backend.write_adapter(adapted, tmp_path / "mlx")
    export_adapter(tmp_path / "mlx", "peft", tmp_path / "peft", str(toy.base))
    base = AutoModelForCausalLM.from_pretrained(toy.base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "peft"), is_trainable=True)
    torch_backend = TorchBackend.create("cpu", "fp32")
    torch_step = TorchStep(peft, build_optimizer(peft, config, torch_backend.placement.device),
                           torch_backend.placement, config.max_grad_norm, chunked_loss=False)  # as finetune_step
    mlx_step = backend.finetune_step(adapted, config)

    tokenizer = load_tokenizer(str(toy.base))
    examples = inspect_jsonl(toy.data / "train.jsonl", tokenizer, 256).examples[:6]
    batches = [collate(examples[:4], tokenizer.pad_token_id), collate(examples[4:], tokenizer.pad_token_id)]
    for _ in range(3):
        a, b = mlx_step.train_step(batches, 1e-2), torch_step.train_step(batches, 1e-2)
        assert a.target_tokens == b.target_tokens and a.loss == pytest.approx(b.loss, abs=TOLERANCE)
        assert a.grad_norm == pytest.approx(b.grad_norm, abs=TOLERANCE)
    assert mlx_step.eval_loss(batches) == pytest.approx(torch_step.eval_loss(batches), abs=TOLERANCE)


# ---- fine-tuning ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_base(toy, tmp_path_factory):
    """The toy base converted by mlx-lm itself to MLX's 4-bit format (mlx_lm.convert -q)."""
    load_mlx_lm()
    from mlx_lm import convert

    path = tmp_path_factory.mktemp("mlx4") / "base"
    convert(str(toy.base), str(path), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "4bit"])
def test_finetune_learns_and_the_adapter_loads_in_mlx_lm_and_in_peft(toy, quantized_base, tmp_path, quant):
    mlx_lm = load_mlx_lm()
    import gc

    import mlx.core as mx
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ptbr.runs.finetune import run_finetune

    gc.collect()
    held = mx.get_active_memory()  # arrays of earlier tests in this process, counted in the run's peak
    result = run_finetune(settings(toy, tmp_path / "out", quant=quant, epochs=8, eval_every=0))
    summary = result.summary
    assert summary["backend"] == "mlx" and summary["steps"] == 40 and summary["trainable_parameters"] == 16384
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    # the predicted peak is of the shapes MLX pads micro-batches to (a power of two from 32)
    predicted = json.loads((tmp_path / "out" / "run_config.json").read_text())["predicted_peak_bytes"]
    assert 0.85 < (max(row["mem_bytes"] for row in rows) - held) / predicted < 1.15
    adapters = tmp_path / "out" / "adapters"
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 2
    assert config["lora_parameters"] == {"rank": 8, "scale": 2.0, "dropout": 0.05, "keys": [
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
        "self_attn.v_proj"]}
    assert json.loads((adapters / "ptbr_adapter.json").read_text())["backend"] == "mlx"

    # mlx-lm alone loads the adapter onto the base it trained on (for QLoRA, the same base
    # quantized by mlx_lm.convert: ptbr's in-memory quantization is bit-identical to it)
    base = quantized_base if quant == "4bit" else toy.base
    model, _ = mlx_lm.load(str(base), adapter_path=str(adapters))
    ids = real_tokens(result.eval_batches[0])
    trained = mlx_logits(result.adapted.model, ids)
    np.testing.assert_array_equal(mlx_logits(model, ids), trained)
    if quant == "none":  # converted to PEFT, on torch: the same logits
        assert main(["export-adapter", str(adapters), "--to", "peft", "--output", str(tmp_path / "peft")]) == 0
        torch_base = AutoModelForCausalLM.from_pretrained(toy.base, dtype=torch.float32)
        peft = PeftModel.from_pretrained(torch_base, str(tmp_path / "peft"))
        np.testing.assert_allclose(torch_logits(peft, ids), trained, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
def test_qlora_on_a_base_quantized_by_mlx_lm_is_the_in_memory_qlora(toy, quantized_base, tmp_path):
    from ptbr.runs.finetune import run_finetune

    runs = [run_finetune(settings(toy, tmp_path / name, base=str(base), quant="4bit", max_steps=3, eval_every=0))
            for name, base in (("memory", toy.base), ("converted", quantized_base))]
    assert runs[0].summary["final_loss"] == runs[1].summary["final_loss"]
    code = main(["finetune", "--backend", "mlx", "--base", str(quantized_base), "--data", str(toy.data),
                 "--output", str(tmp_path / "none"), "--quant", "none"])
    assert code == 2  # a 4-bit base cannot train as an unquantized one


def test_an_adapter_on_the_quantized_base_it_trained_on_is_not_said_to_differ(toy, quantized_base, tmp_path,
                                                                              capsys):
    """An adapter trained on a base mlx_lm.convert -q made, applied to that base: the very model
    training measured, so no note that answers can differ (it is right on the unquantized base);
    torch names MLX's format instead of "check that the directory holds a complete model"."""
    from ptbr.runs.finetune import run_finetune

    run_finetune(settings(toy, tmp_path / "out", base=str(quantized_base), quant="4bit", max_steps=1, eval_every=0,
                          save_every=0))
    adapters = str(tmp_path / "out" / "adapters")
    note = "note: the adapter was trained on the base quantized (4bit); it is applied to --model as given"
    for model, noted in ((quantized_base, False), (toy.base, True)):
        capsys.readouterr()
        assert main(["generate", "--backend", "mlx", "--device", "cpu", "--model", str(model), "--adapter", adapters,
                     "Oi", "--max-new-tokens", "2"]) == 0
        assert (note in capsys.readouterr().err) == noted, model
    assert main(["generate", "--backend", "torch", "--device", "cpu", "--model", str(quantized_base), "Oi"]) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: the model is in MLX's quantized format (4-bit, made by mlx_lm.convert -q: config.json has "
        f"`quantization`, no `quant_method`), which the torch backend cannot load ({quantized_base}); fix: generate "
        "with --backend mlx, or give the unquantized model")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["finetune", "pretrain"])
def test_resume_is_exact(toy, tmp_path, crash_then_resume, mode):
    """10 steps straight and 5 + a crash + resume give bit-identical weights, optimizer state and
    metrics (QLoRA with LoRA dropout: MLX's random key resumes too)."""
    import mlx.core as mx

    from ptbr.backends.mlx.step import MlxStep
    from ptbr.config import PretrainConfig
    from ptbr.runs.finetune import run_finetune
    from ptbr.runs.pretrain import run_pretrain

    def run(name: str):
        if mode == "finetune":
            return run_finetune(settings(toy, tmp_path / name, quant="4bit", batch_size=4, grad_accum=2, max_steps=10,
                                         save_every=5, eval_every=5, lora_dropout=0.1))
        return run_pretrain(PretrainConfig(backend="mlx", device="cpu", output=str(tmp_path / name), seq_len=32,
                                           batch_size=2, grad_accum=2, max_steps=10, save_every=5, eval_every=5,
                                           eval_batches=2))

    run("straight")
    crash_then_resume(MlxStep, 6, lambda: run("resumed"))
    assert json.loads((tmp_path / "resumed" / "run_config.json").read_text())["resumed_from"].endswith("step_000005")
    weights = "adapters.safetensors" if mode == "finetune" else "model.safetensors"
    for name in (weights, "optimizer.safetensors", "rng.json"):
        a, b = (tmp_path / run_dir / "checkpoints" / "step_000010" / name for run_dir in ("straight", "resumed"))
        if name.endswith(".json"):
            assert a.read_text() == b.read_text()
            continue
        a, b = mx.load(str(a)), mx.load(str(b))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a), name
    rows = [[(r["step"], r["loss"], r["val_loss"]) for r in map(json.loads, (tmp_path / n / "metrics.jsonl")
                                                              .read_text().splitlines())] for n in ("straight", "resumed")]
    assert rows[0] == rows[1] and len(rows[0]) == 10


# ---- pretraining --------------------------------------------------------------------------------


@pytest.mark.slow
def test_pretraining_through_the_cli_learns_and_final_loads_in_transformers_and_mlx_lm(tmp_path, capsys):
    import gc

    import mlx.core as mx
    mlx_lm = load_mlx_lm()
    import torch
    from transformers import AutoModelForCausalLM

    gc.collect()
    held = mx.get_active_memory()  # arrays of earlier tests in this process, counted in the run's peak
    output = tmp_path / "run"
    code = main(["train", "--backend", "mlx", "--device", "cpu", "--output", str(output), "--seq-len", "64",
                 "--batch-size", "4", "--max-steps", "30", "--eval-every", "30", "--eval-batches", "2",
                 "--gradient-checkpointing"])
    assert code == 0
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5]) - 5 * 0.5  # 0.5 nats lower
    assert all(r["mem_bytes"] > 0 for r in rows)
    run_config = json.loads((output / "run_config.json").read_text())
    assert run_config["backend"] == "mlx" and run_config["versions"]["mlx-lm"] and "torch" not in run_config["versions"]
    # monitor and report read an MLX run as a torch one; the predicted peak is of what MLX measures
    peak = max(r["mem_bytes"] for r in rows)
    assert 0.8 < (peak - held) / run_config["predicted_peak_bytes"] < 1.2
    assert "| status | finished |" in (output / "report.md").read_text()
    capsys.readouterr()
    assert main(["monitor", "--once", str(output)]) == 0
    screen = capsys.readouterr().out
    assert "train: tiny, mlx on cpu, fp32" in screen and "finished: 30 steps" in screen
    assert f"({100 * peak / run_config['predicted_peak_bytes']:.0f}%)" in screen

    ids = np.arange(1, 33)[None]
    model, _ = mlx_lm.load(str(output / "final"))
    hf = AutoModelForCausalLM.from_pretrained(output / "final", dtype=torch.float32)
    np.testing.assert_allclose(torch_logits(hf, ids), mlx_logits(model, ids), atol=TOLERANCE, rtol=0)


def test_gradient_checkpointing_changes_only_these_layers_and_not_the_numbers():
    import mlx.core as mx
    from mlx_lm.models.llama import TransformerBlock

    from ptbr.backends.mlx import MlxBackend
    from ptbr.config import PRESETS, PretrainConfig

    backend = MlxBackend.create("cpu", "fp32")
    call = TransformerBlock.__call__
    plain, checkpointed = (backend.pretrain_step(PRESETS["tiny"], 256, 0, None,
                                                 PretrainConfig(seq_len=32, batch_size=2, gradient_checkpointing=g))
                           for g in (False, True))
    assert TransformerBlock.__call__ is call and type(plain.model.layers[0]) is TransformerBlock
    assert type(checkpointed.model.layers[0]).__name__ == "CheckpointedTransformerBlock"
    assert plain.trainable_weights().keys() == checkpointed.trainable_weights().keys()
    batches = step_batches(256, 2, 32, seed=1)
    for _ in range(2):
        a, b = plain.train_step(batches, 1e-3), checkpointed.train_step(batches, 1e-3)
        assert a.loss == pytest.approx(b.loss, abs=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert all(mx.allclose(plain.trainable_weights()[k], v, atol=1e-6).item()
               for k, v in checkpointed.trainable_weights().items())


def test_checkpointed_layers_recompute_with_the_dropout_masks_of_their_forward_pass(toy, tmp_path):
    """LoRA dropout with gradient checkpointing: the recomputation in the backward pass must use the
    forward pass's masks (it drew new ones from the global generator: gradients 56% off at dropout
    0.05). Checked against a finite difference of the same loss (same seed, so the same masks)
    along a random direction; then three compiled training steps run."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ptbr.backends.mlx import MlxBackend
    from ptbr.finetune.base import load_tokenizer
    from ptbr.finetune.batches import collate
    from ptbr.finetune.data import inspect_jsonl

    backend = MlxBackend.create("cpu", "fp32")
    config = settings(toy, tmp_path / "run", lora_dropout=0.3, gradient_checkpointing=True, precision="fp32")
    adapted = backend.load_adapted(config)
    start = {k: (0.1 * mx.random.normal(v.shape, key=mx.random.key(1)) if k.endswith("lora_b") else v)
             for k, v in adapted.adapter_weights().items()}  # B = 0 would hide A's gradient
    direction = {k: mx.random.normal(v.shape, key=mx.random.key(2)) for k, v in start.items()}
    step = backend.finetune_step(adapted, config)
    tokenizer = load_tokenizer(str(toy.base))
    batch = collate(inspect_jsonl(toy.data / "train.jsonl", tokenizer, 256).examples[:4], tokenizer.pad_token_id)
    ids, labels = step._arrays(batch)

    def loss_at(t: float) -> float:
        adapted.model.load_weights([(k, start[k] + t * direction[k]) for k in start], strict=False)
        backend.seed(7)
        step.model.train()
        loss = step._forward_loss(step.model.trainable_parameters(), ids, labels)
        mx.eval(loss)
        return loss.item()

    def central(t: float) -> float:
        return (loss_at(t) - loss_at(-t)) / (2 * t)

    # the curvature along a random direction is large (central differences: -25.7 at 3e-3, -21.8 at
    # 1e-3): Richardson's extrapolation of the two cancels their t^2 error (-21.30; analytic -21.29)
    finite = (9 * central(1e-3) - central(3e-3)) / 8
    adapted.model.load_weights(list(start.items()), strict=False)
    backend.seed(7)
    _, grads = step._first(ids, labels, mx.array(1.0))
    analytic = sum((g * direction[k]).sum().item() for k, g in tree_flatten(grads))
    assert analytic == pytest.approx(finite, rel=0.02)
    losses = [step.train_step([batch], 1e-2).loss for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_evaluation_does_not_change_the_training_of_checkpointed_layers_with_dropout(toy, tmp_path):
    """With --gradient-checkpointing and LoRA dropout, each checkpointed layer drew keys from MLX's
    global generator in evaluation too (the compiled evaluation carries its state): the training
    steps after an evaluation drew other masks, and a run's losses depended on --eval-every. As
    without checkpointing, and on torch, they do not."""
    import mlx.core as mx

    from ptbr.runs.finetune import run_finetune

    def losses(eval_every: int) -> list[float]:
        out = tmp_path / f"eval-{eval_every}"
        run_finetune(settings(toy, out, lora_dropout=0.1, gradient_checkpointing=True, batch_size=4, grad_accum=2,
                              max_steps=4, eval_every=eval_every, save_every=0))
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert losses(1) == losses(0)
    # the same, closer in: an evaluation leaves the generator where it was
    from ptbr.backends.mlx import MlxBackend
    from ptbr.finetune.base import load_tokenizer
    from ptbr.finetune.batches import collate
    from ptbr.finetune.data import inspect_jsonl

    backend = MlxBackend.create("cpu", "fp32")
    config = settings(toy, tmp_path / "step", lora_dropout=0.1, gradient_checkpointing=True)
    step = backend.finetune_step(backend.load_adapted(config), config)
    tokenizer = load_tokenizer(str(toy.base))
    batch = collate(inspect_jsonl(toy.data / "valid.jsonl", tokenizer, 256).examples[:4], tokenizer.pad_token_id)
    before = np.array(mx.random.state[0])
    step.eval_loss([batch])
    np.testing.assert_array_equal(np.array(mx.random.state[0]), before)
    step.train_step([batch], 1e-2)  # while training, each layer draws its keys
    assert (np.array(mx.random.state[0]) != before).any()


def test_batches_are_padded_to_a_few_shapes():
    from ptbr.backends.mlx.step import bucket_length, pad_batch

    lengths = (1, 32, 33, 49, 100, 130, 600, 1000, 1024)
    assert [bucket_length(n, 1024) for n in lengths] == [32, 32, 48, 64, 128, 192, 768, 1024, 1024]
    assert [bucket_length(n, 40) for n in (1, 33, 40)] == [32, 40, 40]  # the run's longest: a bucket of its own
    assert len({bucket_length(n, 4096) for n in range(1, 4097)}) == 15  # few shapes, few compilations
    assert max(bucket_length(n, 4096) / n for n in range(32, 4097)) <= 1.5  # at most a third of them padding
    ids, labels = pad_batch({"input_ids": np.ones((3, 40), np.int64), "labels": np.full((3, 40), 5)}, 4, 1024)
    assert ids.shape == labels.shape == (4, 48)
    assert (labels[:3, :40] == 5).all() and (labels[3] == -100).all() and (labels[:, 40:] == -100).all()


def test_a_non_finite_step_is_skipped_not_applied():
    import mlx.core as mx

    from ptbr.backends.mlx import MlxBackend
    from ptbr.config import PRESETS, PretrainConfig

    step = MlxBackend.create("cpu", "fp32").pretrain_step(PRESETS["tiny"], 256, 0, None,
                                                         PretrainConfig(seq_len=32, batch_size=2))
    before = {k: mx.array(v) for k, v in step.trainable_weights().items()}
    norm = step.model.model.norm.weight
    step.model.model.norm.weight = mx.full(norm.shape, float("inf"))
    result = step.train_step(step_batches(256, 2, 32, seed=2), 1e-3)
    assert result.skipped and not np.isfinite(result.loss)
    step.model.model.norm.weight = norm
    assert all(mx.array_equal(before[k], v).item() for k, v in step.trainable_weights().items())
    assert step.optimizer.step == 0  # AdamW did not count it either


# ---- the CLI around it ---------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_export_merge_and_smoke_take_mlx(toy, tmp_path, capsys):
    """The adapter of an MLX run: `generate` answers the same on both backends (converting the
    adapter on the fly for torch), export-adapter round-trips it exactly, `merge` merges it, and
    `smoke --backend mlx` passes."""
    import mlx.core as mx

    from ptbr.runs.finetune import run_finetune

    run_finetune(settings(toy, tmp_path / "out", quant="none", max_steps=4, eval_every=0))
    adapters = str(tmp_path / "out" / "adapters")

    def generate(*args: str) -> str:
        capsys.readouterr()
        assert main(["generate", *args, "Qual é o número 3 do Porto?", "--temperature", "0",
                     "--max-new-tokens", "8", "--device", "cpu"]) == 0
        return capsys.readouterr().out

    answer = generate("--backend", "mlx", "--model", str(toy.base), "--adapter", adapters)
    assert answer.strip() and "Qual é" not in answer  # the chat template: an answer, not a continuation
    # `until` (a chat template's end of turn written as text): generation ends at the first new tokens it names
    from ptbr.backends.mlx import generate as mlx_generate

    model = mlx_generate.load_for_generation(toy.base, None)
    free, finite = mlx_generate.generate(model, [1, 5, 9], set(), 6, 0.0, 0, 0)
    assert len(free) == 6 and finite
    assert mlx_generate.generate(model, [1, 5, 9], set(), 6, 0.0, 0, 0, until=lambda new: len(new) == 2) == (
        free[:2], True)
    assert generate("--backend", "torch", "--model", str(toy.base), "--adapter", adapters) == answer
    sampled = []  # --top-k of the vocabulary or more: every token, as on torch (mlx-lm raised, exit 1)
    for top_k in ("0", "1000000"):
        capsys.readouterr()
        assert main(["generate", "--backend", "mlx", "--model", str(toy.base), "Olá", "--temperature", "0.8",
                     "--top-k", top_k, "--seed", "3", "--max-new-tokens", "6", "--device", "cpu"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1] and sampled[0].strip()

    peft, back = tmp_path / "peft", tmp_path / "back"
    assert main(["export-adapter", adapters, "--to", "peft", "--output", str(peft)]) == 0
    assert main(["export-adapter", adapters, "--to", "peft", "--output", str(peft)]) == 0  # an earlier export: replaced
    assert main(["export-adapter", str(peft), "--to", "mlx", "--output", str(back)]) == 0
    assert "adapter converted from peft to mlx in " in capsys.readouterr().out
    # already in the asked format: a copy, and said so (it said "converted from peft to peft")
    assert main(["export-adapter", str(peft), "--to", "peft", "--output", str(tmp_path / "same")]) == 0
    assert capsys.readouterr().out.startswith("adapter copied in peft's format (it was in it already) in ")
    assert (json.loads((tmp_path / "same" / "ptbr_adapter.json").read_text()).get("converted_from")
            == json.loads((peft / "ptbr_adapter.json").read_text()).get("converted_from"))
    a, b = mx.load(f"{adapters}/adapters.safetensors"), mx.load(str(back / "adapters.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert json.loads((back / "adapter_config.json").read_text())["lora_parameters"] == json.loads(
        (Path(adapters) / "adapter_config.json").read_text())["lora_parameters"]
    assert (peft / "tokenizer.json").is_file() and json.loads((peft / "ptbr_adapter.json").read_text())["backend"] == "torch"
    assert generate("--backend", "mlx", "--model", str(toy.base), "--adapter", str(peft)) == answer

    assert main(["merge", "--base", str(toy.base), "--adapter", adapters, "--output", str(tmp_path / "merged")]) == 0
    assert generate("--backend", "mlx", "--model", str(tmp_path / "merged")) == answer
    # where torch is not installed, MLX merges: the same weights as PEFT's merge
    from ptbr.finetune.merge import _merge_with_mlx

    _merge_with_mlx(str(toy.base), Path(adapters), tmp_path / "merged-mlx", "auto", False, False)
    a, b = (mx.load(str(tmp_path / name / "model.safetensors")) for name in ("merged", "merged-mlx"))
    assert a.keys() == b.keys() and all(mx.allclose(a[k], b[k], atol=1e-6, rtol=0).item() for k in a)
    assert (tmp_path / "merged-mlx" / "ptbr_adapter.json").is_file()

    capsys.readouterr()
    assert main(["smoke", "--backend", "mlx", "--output", str(tmp_path / "smoke")]) == 0
    assert "on mlx" in capsys.readouterr().out


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_generate_from_a_model_with_nan_weights_is_refused_as_on_torch(tmp_path, capsys, temperature):
    """A NaN in the weights: MLX printed the prompt alone (greedy) or noise (sampling), exit 0,
    where torch refuses the model (tests/test_cli.py): the same line and exit 4 on MLX."""
    model_dir = nan_model(tmp_path / "nan-model")
    assert main(["generate", "--backend", "mlx", "--device", "cpu", "Era uma vez", "--model", str(model_dir),
                 "--max-new-tokens", "5", "--temperature", temperature]) == 4
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1] == (
        "error: the model's output is not finite (NaN or infinite logits): its weights are damaged, or the run that "
        "made them diverged (ptbr generate); fix: use another checkpoint of the run (OUTPUT/checkpoints/step_*), "
        "or copy the model's files again")


def test_generation_stops_at_the_first_step_whose_logits_are_not_finite(toy):
    """Every step is checked, not only the prompt's: a model whose third call gives NaN logits
    yields the two tokens before it, and says that its output was not finite."""
    import mlx.core as mx

    from ptbr.backends.mlx import generate as mlx_generate

    model = mlx_generate.load_for_generation(toy.base, None)
    prompt = [5]  # one token: one call for the prompt (mlx-lm reads a longer one in two)
    free, finite = mlx_generate.generate(model, prompt, set(), 6, 0.0, 0, 0)
    assert len(free) == 6 and finite

    class NanFrom:
        """The model, with NaN logits from its call number `first` on (the prompt's is the first)."""

        def __init__(self, first: int):
            self.layers, self.first, self.calls = model.layers, first, 0

        def __call__(self, inputs, cache=None):
            self.calls += 1
            logits = model(inputs, cache=cache)
            return logits * mx.array(float("nan")) if self.calls >= self.first else logits

    assert mlx_generate.generate(NanFrom(3), prompt, set(), 6, 0.0, 0, 0) == (free[:2], False)
    for temperature in (0.0, 0.8):  # the prompt's own logits: nothing
        assert mlx_generate.generate(NanFrom(1), prompt, set(), 6, temperature, 0, 0) == ([], False)


def test_peft_alpha_of_an_mlx_scale_is_the_number_a_user_wrote():
    from ptbr.finetune.export import alpha_of

    assert 29 / 7 * 7 != 29 and alpha_of(29 / 7, 7) == 29 and isinstance(alpha_of(29 / 7, 7), int)
    assert alpha_of(2.0, 8) == 16 and alpha_of(0.3, 5) == 1.5 and alpha_of(1 / 3, 1) == 0.333333333


def test_mlx_errors_are_one_line_with_their_exit_codes(toy, tmp_path, capsys, monkeypatch):
    def error_of(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().err.strip().splitlines()[-1]

    common = ["--backend", "mlx", "--base", str(toy.base), "--data", str(toy.data), "--output", str(tmp_path / "o")]
    code, err = error_of("finetune", *common, "--device", "cuda")
    assert code == 5 and "--device cuda is not a device of the MLX backend" in err
    code, err = error_of("finetune", *common, "--precision", "fp16")
    assert code == 5 and "fp16 training on MLX has no loss scaling" in err and "--precision bf16" in err
    code, err = error_of("finetune", *common, "--quant", "none", "--target-modules", "q_proj,qkv")
    assert code == 2 and "no linear module named qkv" in err
    code, err = error_of("export-adapter", str(toy.base), "--to", "peft", "--output", str(tmp_path / "x"))
    assert code == 4 and "no adapter_config.json in the adapter directory" in err
    # MLX trains in one process: data parallelism and FSDP are the torch backend's
    code, err = error_of("finetune", *common, "--num-processes", "2", "--fsdp")
    assert code == 2 and "2 problems: --num-processes 2: data parallelism runs on the torch backend; --fsdp" in err
    code, err = error_of("train", "--backend", "mlx", "--output", str(tmp_path / "p"), "--fsdp")
    assert code == 2 and "--fsdp: sharding among processes runs on the torch backend" in err
    code, err = error_of("finetune", *common, "--lora-dropout-impl", "packed")
    assert code == 2 and "--lora-dropout-impl packed: a torch backend option" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun starts its workers
    code, err = error_of("train", "--backend", "mlx", "--output", str(tmp_path / "p"))
    assert code == 2 and "started as one of 2 processes" in err
    assert not (tmp_path / "p").exists()  # refused before the run directory is made


def test_torch_options_that_change_nothing_on_mlx_say_so_in_one_line(toy, tmp_path, capsys):
    """--no-chunked-loss and --no-cuda-graphs turn off what MLX never does: not refused (the run is
    what they ask for, unlike --compile), and not silently taken either."""
    from ptbr.commands import processes_to_launch
    from ptbr.config import PretrainConfig
    from ptbr.log import setup_console

    setup_console()  # as the CLI does (another test may have left only pytest's handlers on ptbr's logger)
    capsys.readouterr()
    assert processes_to_launch(PretrainConfig(backend="mlx", chunked_loss=False, cuda_graphs=False)) == 1
    assert capsys.readouterr().err.splitlines() == [
        "note: --no-chunked-loss changes nothing on the MLX backend: its loss always takes the whole logits",
        "note: --no-cuda-graphs changes nothing on the MLX backend: CUDA graphs are the torch backend's (under "
        "--compile on a CUDA GPU)"]
    assert processes_to_launch(settings(toy, tmp_path / "ft", chunked_loss=False)) == 1
    assert capsys.readouterr().err.splitlines() == [
        "note: --no-chunked-loss changes nothing on the MLX backend: its loss always takes the whole logits"]
    for quiet in (PretrainConfig(backend="mlx"), PretrainConfig(backend="torch", chunked_loss=False,
                                                                cuda_graphs=False)):
        assert processes_to_launch(quiet) == 1 and capsys.readouterr().err == ""


def test_auto_fit_halves_the_micro_batch_on_an_mlx_out_of_memory(toy, tmp_path, monkeypatch, capsys):
    from ptbr.backends.mlx.step import MlxStep

    real = MlxStep.train_step
    rows = []

    def step(self, micro_batches, lr):
        rows.append(len(micro_batches[0]["input_ids"]))
        if rows[-1] > 2:
            raise RuntimeError("[metal::malloc] Unable to allocate 68719476736 bytes (injected by the test)")
        return real(self, micro_batches, lr)

    monkeypatch.setattr(MlxStep, "train_step", step)
    code = main(["finetune", "--backend", "mlx", "--device", "cpu", "--base", str(toy.base), "--data", str(toy.data),
                 "--output", str(tmp_path / "o"), "--quant", "none", "--batch-size", "8", "--max-steps", "2",
                 "--auto-fit"])
    assert code == 0 and rows[:3] == [8, 4, 2]
    summary = json.loads((tmp_path / "o" / "run_config.json").read_text())["settings"]
    assert (summary["batch_size"], summary["grad_accum"]) == (2, 4)


def test_loading_mlx_lm_keeps_the_hard_open_file_limit():
    """mlx-lm sets RLIMIT_NOFILE to (2048, 4096) when imported; through ptbr the soft limit may rise,
    the hard one stays (a fresh process: this one has loaded mlx-lm already)."""
    script = ("import resource, sys\n"
              "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))\n"
              "from ptbr.backends.mlx.file_limit import load_mlx_lm\n"
              "load_mlx_lm()\n"
              "import mlx_lm.utils\n"
              "print(*resource.getrlimit(resource.RLIMIT_NOFILE), hard)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    soft, hard, original_hard = (int(v) for v in out.stdout.split())
    assert hard == original_hard and soft == min(2048, original_hard)
    plain = subprocess.run([sys.executable, "-c", "import resource, mlx_lm; "
                            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[1])"],
                           capture_output=True, text=True, check=True, cwd=REPO)
    assert int(plain.stdout) == min(4096, original_hard)  # what the guard prevents; fails once mlx-lm stops doing it
