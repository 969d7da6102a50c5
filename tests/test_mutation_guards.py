"""Direct tests for bugs that a mutation run let through, or caught only by chance (`nox -s mutants`).

Each test pins one promise of the step, the loop, the batch sources or a checkpoint to an exact
number that a plausible wrong version changes: a skipped step changes nothing; losses and updates
are weighted by target tokens, not averaged per batch; clipping bounds the applied gradient to
exactly max_grad_norm; a resumed run continues the RNG; batches are a pure function of the step
whatever was asked before; the loop keeps the best validation loss and stops after five non-finite
steps in a row; a checkpoint counts only when complete, and is intact only when its hashes agree;
a train.bin shorter than one window is refused. Tiny 2-layer models, CPU.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ptbr.backends.torch.device import resolve_precision
from ptbr.backends.torch.step import TorchStep, build_optimizer
from ptbr.cli import main
from ptbr.config import LoopSettings
from ptbr.data.batch import IGNORE_INDEX, windows_to_batch
from ptbr.data.tokens import (
    PretrainBatches,
    RandomWindows,
    TokenDataset,
    describe,
    eval_windows,
    open_dataset,
    read_windows,
)
from ptbr.errors import DataError, TrainingDiverged
from ptbr.finetune.batches import ChatBatches
from ptbr.finetune.data import Example
from ptbr.train.checkpoint import (
    complete_checkpoints,
    corruption,
    latest_checkpoint,
    read_state,
    save_checkpoint,
)
from ptbr.train.loop import Callbacks, LoopState, fit

VOCAB, SEQ_LEN = 64, 16


@pytest.fixture(autouse=True)
def _own_rng():
    """These tests seed and draw from torch's global RNG: no other test sees what they left."""
    with torch.random.fork_rng(devices=[]):
        yield


def tiny_model(seed: int = 0):
    """A 2-layer Llama. initializer_range 0.2: per-token losses then range from ~1 to ~9, so a
    per-batch mean and a per-token mean of the same batches differ by far more than rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2 * SEQ_LEN,
                         initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def backend(model, optimizer=None, max_grad_norm: float = 0.0) -> TorchStep:
    """TorchStep on the CPU in fp32; plain SGD unless told otherwise, so an update is lr * gradient."""
    optimizer = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return TorchStep(model, optimizer, resolve_precision(torch.device("cpu"), "fp32"), max_grad_norm,
                     chunked_loss=True)


def uneven_micro_batches() -> list[dict]:
    """A full micro-batch of 4 rows (64 targets) and a 1-row one with only 2 targets (the short
    remainder of an epoch, or a padded fine-tuning example)."""
    windows = np.random.default_rng(0).integers(0, VOCAB, size=(5, SEQ_LEN + 1))
    full, short = windows_to_batch(windows[:4]), windows_to_batch(windows[4:])
    short["labels"] = short["labels"].copy()
    short["labels"][:, 2:] = IGNORE_INDEX
    return [full, short]


def one_batch(micro_batches: list[dict]) -> dict:
    return {key: np.concatenate([b[key] for b in micro_batches]) for key in micro_batches[0]}


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def update(before: dict, model) -> dict[str, torch.Tensor]:
    return {name: before[name] - p.detach() for name, p in model.named_parameters() if p.requires_grad}


def global_norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


def token_losses(model, batch: dict) -> torch.Tensor:
    """Cross-entropy of every target token of a batch, computed here without TorchStep."""
    logits = model(input_ids=torch.as_tensor(batch["input_ids"])).logits
    labels = torch.as_tensor(batch["labels"]).flatten()
    losses = F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return losses[labels != IGNORE_INDEX]


def hand_gradients(model, loss_fn) -> dict[str, torch.Tensor]:
    """The gradient of loss_fn(model) on a copy of the model."""
    twin = copy.deepcopy(model)
    loss_fn(twin).backward()
    return {name: p.grad.detach().clone() for name, p in twin.named_parameters() if p.requires_grad}


def assert_same_tensors(a: dict, b: dict, **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tolerance, msg=name)


# ---- a non-finite step is skipped, not applied ---------------------------------------------------


def test_a_step_with_non_finite_gradients_changes_no_parameter_and_no_optimizer_state():
    model = tiny_model()
    step = backend(model, adamw(model), max_grad_norm=1.0)
    twin_model = copy.deepcopy(model)
    twin = backend(twin_model, adamw(twin_model), max_grad_norm=1.0)
    batch = uneven_micro_batches()
    for backend_ in (step, twin):  # a good step first, so that AdamW has moments to protect
        assert not backend_.train_step(batch, lr=1e-2).skipped
    weights, optimizer_state = params_of(model), copy.deepcopy(step.optimizer.state_dict())

    poisoned = model.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    result = step.train_step(batch, lr=1e-2)
    poisoned.remove()
    assert result.skipped and math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
    assert_same_tensors(params_of(model), weights, rtol=0, atol=0)
    after = step.optimizer.state_dict()
    assert after["state"].keys() == optimizer_state["state"].keys()
    for index, moments in optimizer_state["state"].items():
        assert_same_tensors(after["state"][index], moments, rtol=0, atol=0)
    # the next good step is exactly the one a run that never saw the bad step takes (no gradient
    # of the bad step left over)
    step.train_step(batch, lr=1e-2)
    twin.train_step(batch, lr=1e-2)
    assert_same_tensors(params_of(model), params_of(twin_model), rtol=0, atol=0)


def test_a_non_finite_first_step_leaves_adamw_as_if_it_never_happened():
    """A NaN loss at the very first step, before AdamW has any state, leaves the weights and no step
    counted, and the next good step is exactly that of a run that never saw the bad one."""
    model = tiny_model()
    step = backend(model, adamw(model), max_grad_norm=1.0)
    twin_model = copy.deepcopy(model)
    twin = backend(twin_model, adamw(twin_model), max_grad_norm=1.0)
    batch = uneven_micro_batches()
    weights = params_of(model)
    poisoned = model.model.norm.register_forward_hook(lambda module, args, out: out * math.nan)
    result = step.train_step(batch, lr=1e-2)
    poisoned.remove()
    assert result.skipped and math.isnan(result.loss)
    assert_same_tensors(params_of(model), weights, rtol=0, atol=0)
    step.train_step(batch, lr=1e-2)
    twin.train_step(batch, lr=1e-2)
    assert_same_tensors(params_of(model), params_of(twin_model), rtol=0, atol=0)
    # the skipped step was not counted: every parameter's AdamW state is at its first step, as the twin's
    counted = [int(state["step"]) for state in step.optimizer.state.values()]
    assert counted == [int(state["step"]) for state in twin.optimizer.state.values()] == [1] * len(weights)


def adamw(model, **settings):
    """ptbr's own optimizer (AdamW, fused on CPU, no decay on norms)."""
    return build_optimizer(model, LoopSettings(**settings), torch.device("cpu"))


# ---- losses and updates are weighted by target tokens ------------------------------------------


def test_eval_loss_is_the_mean_per_target_token_over_uneven_batches():
    model = tiny_model()
    batches = uneven_micro_batches()
    with torch.no_grad():
        per_batch = [token_losses(model, b) for b in batches]
    by_token = float(torch.cat(per_batch).mean())
    by_batch = float(torch.stack([losses.mean() for losses in per_batch]).mean())
    assert [len(losses) for losses in per_batch] == [64, 2]
    assert abs(by_token - by_batch) > 0.3  # the batches really tell the two means apart

    assert backend(model).eval_loss(batches) == pytest.approx(by_token, rel=1e-6)


def test_accumulated_update_over_uneven_micro_batches_is_the_one_big_batch_update():
    """SGD at a real learning rate: the applied update is lr * the gradient of the mean loss over
    all 66 target tokens, as if the micro-batches were one batch, and measurably not lr * the mean
    of the two micro-batches' mean-loss gradients."""
    lr = 0.5
    micro = uneven_micro_batches()
    updates, results = [], []
    for batches in (micro, [one_batch(micro)]):
        model = tiny_model()
        step = backend(model)
        before = params_of(model)
        results.append(step.train_step(batches, lr=lr))
        updates.append(update(before, model))
    accumulated, big = updates
    assert_same_tensors(accumulated, big, rtol=1e-5, atol=1e-7)
    assert results[0].target_tokens == results[1].target_tokens == 66
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-6)

    model = tiny_model()
    by_token = hand_gradients(model, lambda m: torch.cat([token_losses(m, b) for b in micro]).mean())
    by_batch = hand_gradients(model, lambda m: sum(token_losses(m, b).mean() for b in micro) / len(micro))
    assert_same_tensors(accumulated, {k: lr * g for k, g in by_token.items()}, rtol=1e-4, atol=1e-6)
    differences = [float((accumulated[k] - lr * by_batch[k]).abs().max()) for k in accumulated]
    assert max(differences) > 1e-2  # 10,000 x the tolerance above: a mean of means cannot pass


def test_a_step_with_a_single_target_token_is_applied_and_one_with_none_is_skipped():
    model = tiny_model()
    step = backend(model)
    batch = uneven_micro_batches()[1]
    batch["labels"] = batch["labels"].copy()
    batch["labels"][:, 1:] = IGNORE_INDEX  # one target left
    before = params_of(model)
    result = step.train_step([batch], lr=0.5)
    assert (result.target_tokens, result.skipped) == (1, False)
    assert result.loss == pytest.approx(float(token_losses(tiny_model(), batch)[0]), rel=1e-6)
    assert any(float(u.abs().max()) > 0 for u in update(before, model).values())

    batch["labels"][:] = IGNORE_INDEX
    before = params_of(model)
    result = step.train_step([batch], lr=0.5)
    assert (result.target_tokens, result.skipped, result.input_tokens) == (0, True, SEQ_LEN)
    assert_same_tensors(params_of(model), before, rtol=0, atol=0)


# ---- clipping --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.25, 2.0, 0.0], ids=["clipped", "under the limit", "clipping off"])
def test_the_applied_gradient_norm_is_min_of_the_norm_and_max_grad_norm(ratio):
    """SGD at lr 1: the update is the applied gradient. max_grad_norm = ratio * the gradient's norm
    (0 turns clipping off); the reported grad_norm is the norm before clipping."""
    model = tiny_model()
    micro = uneven_micro_batches()
    gradients = hand_gradients(model, lambda m: torch.cat([token_losses(m, b) for b in micro]).mean())
    norm = global_norm(gradients.values())
    limit = ratio * norm
    step = backend(model, max_grad_norm=limit)
    before = params_of(model)
    result = step.train_step(micro, lr=1.0)
    applied = update(before, model)

    assert result.grad_norm == pytest.approx(norm, rel=1e-5)
    expected_norm = min(norm, limit) if limit > 0 else norm
    assert global_norm(applied.values()) == pytest.approx(expected_norm, rel=1e-5)
    scale = expected_norm / norm
    assert_same_tensors(applied, {k: scale * g for k, g in gradients.items()}, rtol=1e-4, atol=1e-7)


# ---- the RNG continues exactly after a resume ----------------------------------------------------


def trained_backend() -> TorchStep:
    """TorchStep with ptbr's AdamW after one step, so that the optimizer has the moments a real
    run's checkpoint holds (draws nothing from the RNG: the tiny model has no dropout)."""
    model = tiny_model()
    step = backend(model, adamw(model), max_grad_norm=1.0)
    step.train_step(uneven_micro_batches(), lr=1e-2)
    return step


def test_load_state_restores_the_torch_rng_a_run_saved(tmp_path):
    """Pretraining: the draw after a resume is the draw the uninterrupted run made next."""
    step = trained_backend()
    torch.manual_seed(3)
    torch.rand(5)  # wherever the run stood
    step.save_state(tmp_path)
    uninterrupted = torch.rand(8)

    torch.manual_seed(12345)  # a fresh process seeds its own way (finetune seeds before loading)
    step.load_state(tmp_path)
    assert torch.equal(torch.rand(8), uninterrupted)


@pytest.mark.parametrize("saved_by", ["this ptbr", "an earlier ptbr"])
def test_an_optimizer_state_resumes_exactly_whoever_numbered_it(tmp_path, saved_by):
    """optimizer.pt is keyed by parameter name; an earlier ptbr saved torch's own numbering (0, 1,
    ...). Either way the resumed AdamW continues with the saved moments: the next update equals
    the uninterrupted run's, bit for bit."""
    step = trained_backend()
    step.save_state(tmp_path)
    if saved_by == "an earlier ptbr":
        torch.save(step.optimizer.state_dict(), tmp_path / "optimizer.pt")
    step.train_step(uneven_micro_batches(), lr=1e-2)
    uninterrupted = params_of(step.model)

    fresh = tiny_model(seed=5)  # other weights, an empty optimizer: all of it comes from the files
    resumed = backend(fresh, adamw(fresh), max_grad_norm=1.0)
    resumed.load_state(tmp_path)
    assert float(resumed.optimizer.state_dict()["state"][0]["step"]) == 1
    resumed.train_step(uneven_micro_batches(), lr=1e-2)
    assert_same_tensors(params_of(fresh), uninterrupted, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_state_restores_the_cuda_rng_too(tmp_path):
    step = trained_backend()
    torch.cuda.manual_seed_all(3)
    step.save_state(tmp_path)
    uninterrupted = torch.rand(8, device="cuda")

    torch.cuda.manual_seed_all(12345)
    step.load_state(tmp_path)
    assert torch.equal(torch.rand(8, device="cuda"), uninterrupted)


def test_lora_dropout_after_a_resume_draws_the_masks_of_the_uninterrupted_run(tmp_path):
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                        target_modules=["q_proj", "v_proj"]))
    model.eval()  # as from_pretrained leaves a base: the step itself must turn dropout on
    step = backend(model, adamw(model), max_grad_norm=1.0)
    micro = uneven_micro_batches()
    torch.manual_seed(1)
    step.train_step(micro, lr=1e-2)  # LoRA's B starts at 0; after one step the masks change the loss
    step.save_state(tmp_path)
    uninterrupted = [step.train_step(micro, lr=1e-2).loss for _ in range(2)]
    weights = params_of(model)

    torch.manual_seed(1)
    step.load_state(tmp_path)
    resumed = [step.train_step(micro, lr=1e-2).loss for _ in range(2)]
    assert resumed == uninterrupted
    assert_same_tensors(params_of(model), weights, rtol=0, atol=0)

    step.load_state(tmp_path)
    torch.manual_seed(2)  # the same weights and optimizer with other masks: another loss
    assert step.train_step(micro, lr=1e-2).loss != uninterrupted[0]
    # evaluation draws no masks: twice the same number, whatever the RNG
    assert step.eval_loss(micro) == step.eval_loss(micro)


def _leave_a_mark(path: str) -> dict:
    Path(path).write_text("code ran while loading a checkpoint")
    return {}


class _CodeInAPickle:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return _leave_a_mark, (str(self.marker),)


@pytest.mark.parametrize("name", ["optimizer.pt", "scaler.pt", "rng.pt"])
def test_load_state_never_runs_code_from_a_checkpoint(tmp_path, name):
    """The states are loaded with weights_only=True: a pickle that would run code is refused."""
    step = trained_backend()
    step.save_state(tmp_path)
    marker = tmp_path / "marker"
    torch.save({"state": _CodeInAPickle(marker)}, tmp_path / name)
    with pytest.raises(pickle.UnpicklingError):  # refused by torch.load(weights_only=True), not later
        step.load_state(tmp_path)
    assert not marker.exists()


# ---- batches are a pure function of (seed, step), whatever was asked before -----------------------


def token_dataset(tmp_path, tokens: int = 500) -> TokenDataset:
    path = tmp_path / "train.bin"
    (np.arange(tokens) % VOCAB).astype("<u2").tofile(path)
    train = np.memmap(path, dtype="<u2", mode="r")
    return TokenDataset(tmp_path, tmp_path / "tokenizer.json", np.dtype("<u2"), VOCAB, 0, None, train, None)


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


def assert_pure(make_source, steps=(3, 1, 3, 0, 1)) -> None:
    """One source asked in a jumbled order (as a resume, a retry or a diagnosis asks) gives each
    step the batches a fresh source gives it."""
    source = make_source()
    seen = [(step, source.cycle(step)) for step in steps]
    for step, batches in seen:
        assert same_batches(batches, make_source().cycle(step)), f"step {step}"
    assert not same_batches(seen[0][1], seen[1][1])


def test_pretraining_batches_do_not_depend_on_earlier_calls(tmp_path):
    dataset = token_dataset(tmp_path)
    assert_pure(lambda: PretrainBatches(dataset, batch_size=2, grad_accum=3, seq_len=SEQ_LEN, seed=5))
    windows = RandomWindows(dataset.train, dataset.train_path, 4, SEQ_LEN, VOCAB, seed=5)
    first = windows.batch(2)
    windows.batch(0)
    assert np.array_equal(windows.batch(2), first)
    # batch 2 x grad_accum 3 sees the same windows as batch 6 x grad_accum 1
    split = PretrainBatches(dataset, batch_size=2, grad_accum=3, seq_len=SEQ_LEN, seed=5).cycle(4)
    whole = PretrainBatches(dataset, batch_size=6, grad_accum=1, seq_len=SEQ_LEN, seed=5).cycle(4)
    assert [len(b["input_ids"]) for b in split] == [2, 2, 2]
    assert same_batches([one_batch(split)], whole)


def test_fine_tuning_batches_do_not_depend_on_earlier_calls():
    examples = [Example(i + 1, 100 * i + np.arange(3 + i % 5), np.ones(3 + i % 5, dtype=bool)) for i in range(11)]
    # 2 steps per epoch: steps 3 and 1 are the same place in epochs 1 and 0, in different orders
    assert_pure(lambda: ChatBatches(examples, batch_size=2, grad_accum=4, seed=7, pad_id=0))
    # --group-by-length (its order computed once per epoch): 11 steps of one example per epoch, asked
    # across epochs 1 and 0
    assert_pure(lambda: ChatBatches(examples, batch_size=1, grad_accum=1, seed=7, pad_id=0, group_by_length=True),
                steps=(13, 1, 13, 0, 1))


def test_validation_windows_are_evenly_spaced_and_capped(tmp_path):
    """60 tokens, seq_len 8: 52 start positions hold 6 disjoint-length windows, spread from the
    first token to the last; at most max_batches x batch_size of them; exactly one window fits."""
    dataset = token_dataset(tmp_path, tokens=60)  # token i is i: a window's first id is its start

    def starts(tokens, batch_size: int, max_batches: int) -> list[list[int]]:
        batches = eval_windows(tokens, dataset.train_path, batch_size, 8, VOCAB, max_batches)
        for batch in batches:
            assert np.array_equal(batch, batch[:, :1] + np.arange(9))  # whole windows of seq_len + 1
        return [batch[:, 0].tolist() for batch in batches]

    assert starts(dataset.train, 2, 5) == [[0, 10], [20, 30], [40, 51]]
    assert starts(dataset.train, 2, 2) == [[0, 17], [34, 51]]
    assert starts(dataset.train[:9], 2, 5) == [[0]]
    assert starts(dataset.train[:8], 2, 5) == []


# ---- the loop: evaluation, best step, checkpoints, non-finite steps --------------------------------


def test_every_module_trains_though_the_wrapper_already_said_training():
    """A base from from_pretrained is in evaluation mode, and a PEFT (or DDP) wrapper around it says
    training: gradient checkpointing and dropout follow each module's own flag, so the step puts
    every module in training mode, also where no probe ran (--no-chunked-loss, no padding check)."""
    model = tiny_model()
    model.train()
    model.model.layers[0].eval()
    assert model.training and not model.model.layers[0].self_attn.training  # as PEFT over a loaded base
    step = TorchStep(model, adamw(model), resolve_precision(torch.device("cpu"), "fp32"), 1.0, chunked_loss=False)
    step.train_step(uneven_micro_batches(), 1e-3)
    assert all(module.training for module in model.modules())
    step.eval_loss(uneven_micro_batches())
    assert all(module.training for module in model.modules())


def test_elapsed_s_is_the_wall_clock_between_rows_writing_included(tmp_path, monkeypatch):
    """A row's elapsed_s counts what the loop did since the row before, writing that row included
    (metrics, memory, checkpoints): the step times read from it are the wall clock's, as a
    reference trainer's are in the speed benchmark."""
    from ptbr.backends.torch.step import TorchStep

    writing = 1.0  # longer than a step and its evaluation take here, even on a busy machine
    real = TorchStep.memory_bytes

    def slow_memory_bytes(self):
        time.sleep(writing)  # read while the row is written, after the row's clock
        return real(self)

    monkeypatch.setattr(TorchStep, "memory_bytes", slow_memory_bytes)
    _, _, rows, _ = fit_tiny(tmp_path, 3)
    for before, after in zip(rows, rows[1:], strict=False):
        step_s = 2 * SEQ_LEN / after["tokens_per_s"]  # the step's own time (2 windows a step)
        assert after["elapsed_s"] - before["elapsed_s"] >= writing + step_s, (before, after)


class Recorder(Callbacks):
    def __init__(self):
        self.evals, self.checkpoints = [], []

    def on_eval(self, state, val_loss, is_best):
        self.evals.append((state.step, val_loss, is_best))

    def on_checkpoint(self, state, path):
        self.checkpoints.append((state.step, path.name))


def fit_tiny(tmp_path, max_steps: int, poisoned_steps=(), learning_rate: float = 3e-2):
    """fit() over a tiny model with evaluation and a checkpoint after every step; the gradients of
    the steps in poisoned_steps (1-based) are made infinite."""
    settings = LoopSettings(output=str(tmp_path / "run"), max_steps=max_steps, learning_rate=learning_rate,
                            warmup_steps=0, eval_every=1, save_every=1, batch_size=2, seed=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    dataset = token_dataset(tmp_path)
    model = tiny_model()
    step = backend(model, adamw(model), max_grad_norm=1.0)
    backward_calls = []

    def poison(grad):
        backward_calls.append(1)
        return torch.full_like(grad, math.inf) if len(backward_calls) in poisoned_steps else grad

    model.model.layers[0].mlp.up_proj.weight.register_hook(poison)
    source = PretrainBatches(dataset, 2, 1, SEQ_LEN, seed=0)
    eval_batches = [windows_to_batch(w) for w in eval_windows(dataset.train, dataset.train_path, 2, SEQ_LEN, VOCAB, 2)]
    recorder = Recorder()
    state = LoopState()
    started = time.monotonic()
    try:
        fit(step, source, eval_batches, settings, run_dir, state, callbacks=recorder)
    finally:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the time the loop books is time it really spent
    assert 0 < state.elapsed_s <= time.monotonic() - started
    return state, recorder, rows, run_dir


def test_fit_evaluates_and_saves_every_step_and_keeps_the_best_val_loss(tmp_path):
    state, recorder, rows, run_dir = fit_tiny(tmp_path, max_steps=6)
    val = [row["val_loss"] for row in rows]
    assert [(step, loss) for step, loss, _ in recorder.evals] == list(zip(range(1, 7), val, strict=True))
    best = min(range(6), key=val.__getitem__)
    assert 0 < best < 5  # the validation loss falls, then rises: the last step is not the best
    assert [is_best for _, _, is_best in recorder.evals] == [v < min(val[:i], default=math.inf)
                                                              for i, v in enumerate(val)]
    assert (state.best_val_loss, state.best_step) == (val[best], best + 1)
    assert recorder.checkpoints == [(s, f"step_{s:06d}") for s in range(1, 7)]
    assert read_state(run_dir / "checkpoints" / "step_000006")["loop"]["best_step"] == best + 1


def test_fit_skips_non_finite_steps_and_stops_after_five_in_a_row(tmp_path):
    # four bad steps, a good one, four bad ones: never five in a row, so the run completes
    state, recorder, rows, run_dir = fit_tiny(tmp_path / "a", 10, poisoned_steps={2, 3, 4, 5, 7, 8, 9, 10})
    assert (state.step, state.skipped_steps, state.bad_in_a_row) == (10, 8, 4)
    weights = [(run_dir / "checkpoints" / f"step_{s:06d}" / "model.safetensors").read_bytes() for s in (1, 5, 6, 10)]
    assert weights[0] == weights[1] and weights[1] != weights[2] and weights[2] == weights[3]
    assert [row["val_loss"] for row in rows[1:5]] == [rows[0]["val_loss"]] * 4  # nothing moved

    with pytest.raises(TrainingDiverged) as info:
        fit_tiny(tmp_path / "b", 10, poisoned_steps={2, 3, 4, 5, 6})
    assert info.value.what.startswith("loss or gradients not finite for 5 steps in a row (last: step 6, lr ")
    # the run's own precision is not offered as the cure; a resume would keep the learning rate
    assert info.value.fix == ("start over (--resume never, or another --output) with a lower --learning-rate (a "
                              "resume keeps the run's learning rate)")
    assert read_state(tmp_path / "b" / "run" / "checkpoints" / "step_000005")["loop"]["skipped_steps"] == 4
    # not finite from the first step on: no update was ever applied, the weights it started from are the cause
    with pytest.raises(TrainingDiverged) as info:
        fit_tiny(tmp_path / "c", 10, poisoned_steps={1, 2, 3, 4, 5})
    assert info.value.fix == ("no update was ever applied, so the learning rate is not the cause: check the weights "
                              "the run starts from (a NaN or infinity in the base model's files; `ptbr generate "
                              "--model BASE` says whether its output is finite)")


def test_a_checkpoint_counts_when_every_file_has_its_recorded_size_and_is_intact_with_its_hash(tmp_path):
    step = backend(tiny_model())
    schedule = {"peak_lr": 1e-3, "warmup_steps": 0, "horizon": 5, "min_lr_ratio": 0.1}

    def save(number: int, keep_last: int) -> list[str]:
        save_checkpoint(tmp_path, number, step, {"loop": {"step": number}, "scheduler": schedule}, keep_last)
        return [p.name for p in complete_checkpoints(tmp_path)]

    assert [save(n, keep_last=2) for n in (1, 2, 3)][-1] == ["step_000002", "step_000003"]
    assert save(4, keep_last=1) == ["step_000004"]
    assert save(5, keep_last=0) == ["step_000004", "step_000005"]  # 0 keeps all
    newest = latest_checkpoint(tmp_path)
    state = read_state(newest)
    assert (state["format"], state["step"], state["loop"], state["scheduler"]) == (2, 5, {"step": 5}, schedule)
    assert state["files"] == {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                              for p in newest.iterdir() if p.name != "trainer_state.json"}
    assert {"model.safetensors", "optimizer.pt", "scaler.pt", "rng.pt"} <= state["files"].keys()
    assert corruption(newest, state) is None

    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # a flipped bit: still complete (every size agrees), no longer intact
    weights.write_bytes(bytes(data))
    assert read_state(newest) == state
    assert corruption(newest, state) == "model.safetensors does not match the sha256 recorded when it was saved"
    weights.write_bytes(bytes(data[:-1]))  # a write cut short
    assert read_state(newest) is None
    assert latest_checkpoint(tmp_path).name == "step_000004"
    (tmp_path / "checkpoints" / "step_000004" / "trainer_state.json").unlink()
    assert latest_checkpoint(tmp_path) is None


def test_checkpoints_past_step_999999_are_ordered_by_their_step(tmp_path, monkeypatch):
    """step_1000000 sorts before step_999999 as text: --keep-last deleted the newest ones and a
    resume went back to step 999,999. A checkpoint that is skipped says why."""
    step = backend(tiny_model())
    schedule = {"peak_lr": 1e-3, "warmup_steps": 0, "horizon": 5, "min_lr_ratio": 0.1}
    for number in (999_998, 999_999, 1_000_000, 1_000_001):
        save_checkpoint(tmp_path, number, step, {"loop": {"step": number}, "scheduler": schedule}, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1000000", "step_1000001"]
    assert latest_checkpoint(tmp_path).name == "step_1000001"
    assert not list((tmp_path / "checkpoints").glob(".old-*"))  # pruned whole
    # the hang watchdog hears of a checkpoint's progress file by file (one silence per file, not per checkpoint)
    heard: list[str] = []
    save_checkpoint(tmp_path / "other", 1, step, {"loop": {"step": 1}, "scheduler": schedule}, progress=heard.append)
    assert heard[0] == "its files written" and "optimizer.pt hashed" in heard and "model.safetensors hashed" in heard
    import ptbr.train.checkpoint as checkpoint

    said: list[str] = []
    monkeypatch.setattr(checkpoint, "log", said.append)
    (tmp_path / "checkpoints" / "step_1000001" / "rng.pt").unlink()
    assert latest_checkpoint(tmp_path).name == "step_1000000"
    assert said == [f"warning: skipping incomplete or corrupt checkpoint {tmp_path / 'checkpoints' / 'step_1000001'}: "
                    "rng.pt is missing"]


@pytest.mark.parametrize("field, value", [("elapsed_s", "soon"), ("best_val_loss", "low"), ("best_step", [3]),
                                          ("tokens_seen", 1.5)])
def test_a_trainer_state_with_a_malformed_loop_value_is_not_a_checkpoint(tmp_path, field, value):
    step = backend(tiny_model())
    schedule = {"peak_lr": 1e-3, "warmup_steps": 0, "horizon": 5, "min_lr_ratio": 0.1}
    save_checkpoint(tmp_path, 1, step, {"loop": {"step": 1, "elapsed_s": 2.5, "best_val_loss": 3.0, "best_step": 1,
                                                 "tokens_seen": 64}, "scheduler": schedule}, 0)
    newest = latest_checkpoint(tmp_path)
    assert read_state(newest) is not None
    path = newest / "trainer_state.json"
    state = json.loads(path.read_text())
    state["loop"][field] = value
    path.write_text(json.dumps(state))
    assert read_state(newest) is None and latest_checkpoint(tmp_path) is None


# ---- token files: every check looks at every token ----------------------------------------------


def test_the_max_token_id_is_found_in_any_chunk_and_a_lone_bad_id_is_located(tmp_path):
    path = tmp_path / "train.bin"
    for position in (0, 3, 4, 9):  # first and last token of a chunk of 4, the last token
        tokens = np.ones(10, dtype="<u2")
        tokens[position] = 50
        tokens.tofile(path)
        dataset = TokenDataset(tmp_path, path, np.dtype("<u2"), VOCAB, 0, None,
                               np.memmap(path, dtype="<u2", mode="r"), None)
        assert dataset.max_token_id(chunk=4) == 50, position
    (np.arange(20) % VOCAB).astype("<u2").tofile(path)
    tokens = np.memmap(path, dtype="<u2", mode="r+")
    tokens[5] = 999
    with pytest.raises(DataError) as info:
        read_windows(tokens, path, np.array([3]), 8, VOCAB)
    assert info.value.where == f"{path} at token offset 5 (byte 10)"


def test_open_dataset_refuses_what_disagrees_with_meta_and_an_empty_train_bin(dataset_dir):
    meta = json.loads((dataset_dir / "meta.json").read_text())

    def problem_with(**changes) -> str:
        (dataset_dir / "meta.json").write_text(json.dumps(meta | changes))
        with pytest.raises(DataError) as info:
            open_dataset(dataset_dir)
        return info.value.what

    tokens = meta["train_tokens"]
    assert problem_with(train_tokens=tokens + 1) == f"meta.json says {tokens + 1} train tokens but train.bin holds {tokens}"
    val = meta["val_tokens"]  # val.bin cut short: evaluation would run on part of it, unsaid
    assert problem_with(val_tokens=val + 1) == f"meta.json says {val + 1} val tokens but val.bin holds {val}"
    assert problem_with(vocab_size=401) == "meta.json says vocab_size 401 but the tokenizer has 400"
    (dataset_dir / "val.bin").unlink()
    (dataset_dir / "meta.json").write_text(json.dumps(meta))
    assert "no val.bin: training will not evaluate" in describe(open_dataset(dataset_dir))["warnings"]
    (dataset_dir / "train.bin").write_bytes(b"")
    assert problem_with(train_tokens=0) == "train.bin is empty"


def test_a_dataset_without_meta_json_refuses_an_id_equal_to_the_vocab_size(dataset_dir):
    """Datasets of an older ptbr have no meta.json; their ids are checked against the tokenizer."""
    (dataset_dir / "meta.json").unlink()
    tokens = np.fromfile(dataset_dir / "train.bin", dtype="<u2")
    tokens[len(tokens) // 2] = 399  # the largest id of a 400-token vocabulary
    tokens.tofile(dataset_dir / "train.bin")
    assert open_dataset(dataset_dir).vocab_size == 400
    tokens[len(tokens) // 2] = 400
    tokens.tofile(dataset_dir / "train.bin")
    with pytest.raises(DataError) as info:
        open_dataset(dataset_dir)
    assert info.value.what == (f"train.bin holds token id 400 >= vocab size 400 at token offset {len(tokens) // 2}: "
                               "wrong tokenizer or wrong dtype")


# ---- a train.bin shorter than one window ---------------------------------------------------------


def test_random_windows_refuses_a_token_file_shorter_than_one_window(tmp_path):
    dataset = token_dataset(tmp_path, tokens=SEQ_LEN + 1)
    windows = RandomWindows(dataset.train, dataset.train_path, 3, SEQ_LEN, VOCAB, seed=0)
    assert np.array_equal(windows.batch(0), np.tile(np.arange(SEQ_LEN + 1), (3, 1)))  # exactly one window fits
    with pytest.raises(DataError) as info:
        RandomWindows(dataset.train[:SEQ_LEN], dataset.train_path, 3, SEQ_LEN, VOCAB, seed=0)
    assert info.value.what == f"train.bin holds {SEQ_LEN} tokens, fewer than seq_len + 1 = {SEQ_LEN + 1}"
    assert info.value.where == str(dataset.train_path)


def test_train_on_data_shorter_than_one_window_exits_3_before_training(tmp_path, dataset_dir, capsys):
    """40 tokens: --seq-len 40 needs 41 and is refused, whichever layer checks; --seq-len 39 trains."""
    data = tmp_path / "short"
    data.mkdir()
    for name in ("tokenizer.json", "val.bin"):
        (data / name).write_bytes((dataset_dir / name).read_bytes())
    np.fromfile(dataset_dir / "train.bin", dtype="<u2")[:40].tofile(data / "train.bin")
    meta = json.loads((dataset_dir / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps(meta | {"train_tokens": 40}))

    def train(seq_len: int, output) -> int:
        return main(["train", "--data", str(data), "--output", str(output), "--model-size", "tiny", "--seq-len",
                     str(seq_len), "--batch-size", "2", "--max-steps", "1", "--eval-batches", "1", "--device", "cpu"])

    capsys.readouterr()
    assert train(40, tmp_path / "refused") == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: train.bin holds 40 tokens, fewer than seq_len + 1 = 41 (")
    assert line.endswith("; fix: lower --seq-len or add data")
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    assert train(39, tmp_path / "fits") == 0
    assert len((tmp_path / "fits" / "metrics.jsonl").read_text().splitlines()) == 1
    assert "step 1/1 | loss " in capsys.readouterr().err  # the loop's progress line
