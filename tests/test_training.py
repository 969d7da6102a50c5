"""Pretraining through the real CLI on tiny models: loss, accumulation, resume, run directory."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ptbr.cli import main
from ptbr.train.metrics import COLUMNS


def train(output, *extra):
    """`ptbr train` in-process, tiny model, small shapes; extra flags override."""
    args = ["train", "--output", str(output), "--model-size", "tiny", "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "6", "--warmup-steps", "2", "--save-every", "3", "--eval-every", "3",
            "--eval-batches", "2", "--device", "cpu", *extra]
    assert main(args) == 0


def weights(path):
    return load_file(str(path / "model.safetensors"))


def metrics(output):
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("chunked", [True, False])
def test_loss_uses_correctly_shifted_labels(monkeypatch, chunked):
    """Our loss on (inputs, labels), chunked (5 tokens a chunk) or whole, equals transformers' own
    loss, which shifts internally."""
    from ptbr import memory

    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * 300 * 5)
    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PRESETS, LoopSettings
    from ptbr.data.batch import windows_to_batch

    model = build_model(PRESETS["tiny"], 300, eos_id=0, seed=0)
    windows = np.random.default_rng(0).integers(0, 300, size=(2, 17))
    batch = windows_to_batch(windows)
    assert np.array_equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    step = TorchStep(model, build_optimizer(model, LoopSettings(), torch.device("cpu")),
                     resolve_precision(torch.device("cpu"), "fp32"), 1.0, chunked_loss=chunked)
    ours = step.eval_loss([batch])
    with torch.no_grad():
        # transformers shifts labels itself: logits[:, :-1] against tokens[:, 1:]; a causal model's
        # logits for the first T positions do not depend on the last token, so the two must agree
        full = torch.as_tensor(windows)
        theirs = model(input_ids=full, labels=full).loss.item()
    assert ours == pytest.approx(theirs, rel=1e-6)
    unshifted = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    # unshifted labels give a different number (with tied embeddings an untrained model even
    # "predicts" the current token better: exactly the bug that looks like learning)
    assert abs(step.eval_loss([unshifted]) - ours) > 0.1


def tiny_step(optimizer_factory, vocab=300, chunked_loss=True):
    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep
    from ptbr.config import PRESETS

    model = build_model(PRESETS["tiny"], vocab, eos_id=0, seed=0)
    return model, TorchStep(model, optimizer_factory(model), resolve_precision(torch.device("cpu"), "fp32"), 0.0,
                            chunked_loss=chunked_loss)


def test_accumulated_gradient_is_the_mean_over_the_whole_batch():
    """With SGD at lr 1 the update is the gradient itself: 4 micro-batches of 2 must give the
    gradient of one batch of 8 (averaged, not summed), and the optimizer steps once."""
    from ptbr.data.batch import windows_to_batch

    windows = np.random.default_rng(1).integers(0, 300, size=(8, 17))
    updates = []
    for micro in (8, 2):
        model, step = tiny_step(lambda m: torch.optim.SGD(m.parameters(), lr=1.0))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        result = step.train_step([windows_to_batch(windows[i:i + micro]) for i in range(0, 8, micro)], lr=1.0)
        updates.append(({k: before[k] - v for k, v in model.state_dict().items()}, result))
    (big, big_result), (acc, acc_result) = updates
    assert acc_result.loss == pytest.approx(big_result.loss, rel=1e-6)
    assert acc_result.target_tokens == big_result.target_tokens == 8 * 16
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-5, atol=1e-7)
    assert big["model.norm.weight"].abs().sum() > 0


def test_a_short_last_cycle_is_weighted_by_its_tokens():
    """Uneven micro-batches (the remainder of an epoch, padded fine-tuning data): the loss is the
    mean over every target token of the step, as if it were one batch."""
    from ptbr.data.batch import IGNORE_INDEX, windows_to_batch

    windows = np.random.default_rng(2).integers(0, 300, size=(3, 17))
    whole = windows_to_batch(windows)
    _, step = tiny_step(lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    expected = step.eval_loss([whole])
    masked = windows_to_batch(windows[2:])
    masked["labels"] = masked["labels"].copy()
    masked["labels"][:, :8] = IGNORE_INDEX
    split = step.train_step([windows_to_batch(windows[:2]), windows_to_batch(windows[2:])], lr=0.0)
    assert split.loss == pytest.approx(expected, rel=1e-6)
    uneven = step.train_step([windows_to_batch(windows[:2]), masked], lr=0.0)
    assert uneven.target_tokens == 2 * 16 + 8


def test_grad_accum_through_the_cli_matches_one_big_batch(tmp_path):
    """batch 2 x grad_accum 4 and batch 8 x grad_accum 1 train on the same sequences to the same model.
    In fp32: bf16 autocast (auto on a CPU with native bf16) rounds each matrix multiply's output to
    8 bits of mantissa, differently for 2 rows than for 8, which would hide the loop's arithmetic."""
    train(tmp_path / "big", "--batch-size", "8", "--grad-accum", "1", "--max-steps", "3", "--save-every", "3",
          "--precision", "fp32")
    train(tmp_path / "acc", "--batch-size", "2", "--grad-accum", "4", "--max-steps", "3", "--save-every", "3",
          "--precision", "fp32")
    big, acc = weights(tmp_path / "big" / "final"), weights(tmp_path / "acc" / "final")
    for name in big:
        # AdamW normalises each update, so float summation-order noise on ~0 gradients shows up at
        # ~1e-6 after a few steps; a wrong accumulation would be off by the learning rate (3e-3)
        torch.testing.assert_close(acc[name], big[name], rtol=0, atol=2e-5)
    loss_big = [row["loss"] for row in metrics(tmp_path / "big")]
    loss_acc = [row["loss"] for row in metrics(tmp_path / "acc")]
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: autocast, what auto picks on a native-bf16 CPU
def test_resume_is_bit_identical(tmp_path, precision):
    """10 steps in one go == 5 steps, interruption, resume to 10."""
    once = tmp_path / "once"
    train(once, "--max-steps", "10", "--save-every", "5", "--precision", precision)
    twice = tmp_path / "twice"
    train(twice, "--max-steps", "10", "--save-every", "5", "--precision", precision)
    # simulate a run that died after step 5: only the step-5 checkpoint survives
    shutil.rmtree(twice / "checkpoints" / "step_000010")
    shutil.rmtree(twice / "final")
    train(twice, "--max-steps", "10", "--save-every", "5", "--precision", precision)
    assert json.loads((twice / "run_config.json").read_text())["precision"] == precision
    a, b = weights(once / "final"), weights(twice / "final")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    rows = metrics(twice)
    assert [row["step"] for row in rows] == list(range(1, 11))  # no step logged twice
    assert [row["loss"] for row in rows] == [row["loss"] for row in metrics(once)]
    log = (twice / "train.log").read_text()
    assert "resuming from" in log and "step_000005" in log


def test_a_resume_in_another_precision_is_said(tmp_path, capsys):
    """Allowed (a run moved to another machine, or auto picking bf16 where it picked fp32 before),
    but never silent: the log names both precisions and how to continue as before."""
    out = tmp_path / "run"
    train(out, "--max-steps", "2", "--precision", "fp32")
    capsys.readouterr()
    train(out, "--max-steps", "3", "--precision", "bf16")
    assert ("note: this run trained in fp32 until now and goes on in bf16; --precision fp32 continues as it was"
            in capsys.readouterr().err)
    train(out, "--max-steps", "4", "--precision", "bf16")
    assert "note: this run trained in" not in capsys.readouterr().err
    # run again when finished, in another precision: no step trains, and its record stays as trained
    train(out, "--max-steps", "4", "--precision", "fp32")
    assert "note: this run trained in" not in capsys.readouterr().err
    assert json.loads((out / "run_config.json").read_text())["precision"] == "bf16"


def test_resume_never_starts_over(tmp_path):
    out = tmp_path / "run"
    train(out, "--max-steps", "3")
    first = metrics(out)[0]["loss"]
    train(out, "--max-steps", "3", "--resume", "never")
    assert metrics(out)[0]["loss"] == first and len(metrics(out)) == 3


def test_run_directory_layout_and_first_step_log(tmp_path, capsys):
    out = tmp_path / "run"
    train(out)
    err = capsys.readouterr().err
    assert "first batch: input_ids (4, 32) int64" in err
    assert "first step done: loss " in err
    assert {p.name for p in out.iterdir()} >= {"run_config.json", "metrics.jsonl", "metrics.csv", "checkpoints",
                                               "training_summary.json", "final", "train.log"}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    checkpoint = out / "checkpoints" / "step_000006"
    assert {"model.safetensors", "optimizer.pt", "scaler.pt", "rng.pt", "trainer_state.json"} <= {
        p.name for p in checkpoint.iterdir()}
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["loop"]["step"] == 6 and state["loop"]["tokens_seen"] == 6 * 4 * 32
    assert state["sampler"] == {"position": 6, "seed": 1337, "batch_size": 4, "grad_accum": 1}
    assert state["scheduler"]["step"] == 6 and state["scheduler"]["warmup_steps"] == 2
    for name in ("optimizer.pt", "scaler.pt", "rng.pt"):
        torch.load(checkpoint / name, weights_only=True)  # loadable without unpickling code
    config = json.loads((out / "run_config.json").read_text())
    assert config["settings"]["seq_len"] == 32 and config["versions"]["torch"] == torch.__version__
    from ptbr.backends.torch.device import cpu_has_native_bf16

    # --precision auto on a CPU: bf16 autocast where the CPU computes bf16 natively, and the log says so
    assert config["precision"] == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert f"precision {config['precision']} (" in err
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == COLUMNS and len(rows) == 6
    assert [r["val_loss"] != "" for r in rows] == [False, False, True, False, False, True]
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens_seen"] == 6 * 4 * 32


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_on_a_cpu(monkeypatch, native):
    """Pretraining (pretraining=True) picks bf16 autocast where the CPU multiplies bf16 in hardware,
    fp32 elsewhere; fine-tuning (the default, pretraining=False) and explicit precisions are kept."""
    from ptbr.backends.torch import device as devices

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    placement = devices.resolve_precision(cpu, "auto", pretraining=True)
    assert placement.precision == ("bf16" if native else "fp32")
    assert ("natively" in placement.reason) == native
    assert placement.autocast_dtype == (torch.bfloat16 if native else None)
    assert devices.resolve_precision(cpu, "auto").precision == "fp32"
    assert devices.resolve_precision(cpu, "fp32", pretraining=True).precision == "fp32"
    assert devices.resolve_precision(cpu, "bf16").precision == "bf16"


def test_first_loss_on_the_bundled_sample_is_stable():
    """Exact numbers: seed 1337, tiny, seq_len 64, batch 4 on the bundled sample, in fp32: --precision
    auto pretrains in bf16 on a CPU that computes it natively, whose kernels differ from one CPU to
    another (AVX512-BF16 on an AMD EPYC gave 7.66094)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        assert main(["train", "--output", tmp, "--model-size", "tiny", "--seq-len", "64", "--batch-size", "4",
                     "--max-steps", "1", "--device", "cpu", "--precision", "fp32"]) == 0
        first = metrics(Path(tmp))[0]
    assert first["loss"] == pytest.approx(7.6611, abs=1e-4)
    assert first["lr"] == pytest.approx(3e-3)


@pytest.mark.slow
def test_loss_falls_clearly_over_100_steps_on_the_bundled_sample(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--output", str(out), "--model-size", "tiny", "--max-steps", "100", "--seq-len", "128",
                 "--batch-size", "8", "--eval-every", "50", "--save-every", "100", "--device", "cpu"]) == 0
    rows = metrics(out)
    first, last = np.mean([r["loss"] for r in rows[:5]]), np.mean([r["loss"] for r in rows[-5:]])
    assert first > 7.0 and last < first - 1.5
    val = [r["val_loss"] for r in rows if r["val_loss"] is not None]
    assert len(val) == 2 and val[-1] < 6.5


def test_older_layout_dataset_trains(tmp_path, dataset_dir):
    from tests.test_data import make_old_layout

    old, tokenizer = make_old_layout(tmp_path, dataset_dir)
    out = tmp_path / "run"
    train(out, "--data", str(old), "--tokenizer", str(tokenizer), "--max-steps", "2")
    assert len(metrics(out)) == 2 and all(r["val_loss"] is None for r in metrics(out))


@pytest.mark.parametrize("pad_id", [None, 1])
def test_eos_is_trained_as_an_input_like_any_token(pad_id):
    """EOS separates every document: never transformers' padding_idx (a row that starts at zero and
    gets no gradient from the inputs), also where the dataset has no padding token (older layout)."""
    from ptbr.backends.torch.models import build_model
    from ptbr.config import PRESETS

    model = build_model(PRESETS["tiny"], 300, eos_id=5, seed=0, pad_id=pad_id)
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == pad_id and model.config.pad_token_id == pad_id
    ids = torch.tensor([[5, 9, 5, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    weight, grad = embedding.weight.detach(), embedding.weight.grad
    assert float(weight[5].abs().sum()) > 0 and float(grad[5].abs().sum()) > 0
    if pad_id is not None:  # the padding token's row: zero, and no gradient but the output layer's (tied)
        assert float(weight[pad_id].abs().sum()) == 0


def test_final_loads_in_plain_transformers_and_generates(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("Era uma vez", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 5
    assert tokenizer.eos_token == "<|endoftext|>"
    capsys.readouterr()
    assert main(["generate", "--model", str(out / "final"), "--max-new-tokens", "8", "--device", "cpu",
                 "Era uma vez"]) == 0
    assert capsys.readouterr().out.startswith("Era uma vez")

    # the model's 512 positions hold the prompt and the new tokens: more new ones are capped, and said;
    # a prompt that fills them is refused, as is one that is not UTF-8 (undecodable bytes of argv)
    generate = ["generate", "--model", str(out / "final"), "--device", "cpu", "--temperature", "0"]
    assert main([*generate, "--max-new-tokens", "100000", "Era uma vez"]) == 0
    prompt = len(AutoTokenizer.from_pretrained(out / "final")("Era uma vez")["input_ids"])
    assert (f"warning: --max-new-tokens 100,000 capped at {512 - prompt}: the prompt's {prompt} tokens and the new "
            "ones must fit the model's 512 positions") in capsys.readouterr().err
    assert main([*generate, "Era uma vez " * 400]) == 2
    assert "tokens; the model takes 512 in all (its positions, config.json's max_position_embeddings or n_positions)" in capsys.readouterr().err
    assert main([*generate, "caf\udce9"]) == 2
    assert "the prompt is not valid UTF-8 (character 4)" in capsys.readouterr().err


def test_a_val_bin_shorter_than_a_window_is_a_warning_that_says_why(tmp_path, dataset_dir, capsys):
    val_tokens = json.loads((dataset_dir / "meta.json").read_text())["val_tokens"]
    seq_len = min(val_tokens, 64)  # no window of seq_len + 1 tokens fits in val.bin
    meta = json.loads((dataset_dir / "meta.json").read_text())
    np.fromfile(dataset_dir / "val.bin", dtype="<u2")[:seq_len].tofile(dataset_dir / "val.bin")
    (dataset_dir / "meta.json").write_text(json.dumps(meta | {"val_tokens": seq_len}))
    assert main(["train", "--output", str(tmp_path / "run"), "--data", str(dataset_dir), "--model-size", "tiny",
                 "--seq-len", str(seq_len), "--max-steps", "1", "--device", "cpu"]) == 0
    assert (f"warning: no validation: val.bin holds {seq_len} tokens, fewer than seq_len + 1 = {seq_len + 1} "
            f"({dataset_dir / 'val.bin'}); training without evaluation") in capsys.readouterr().err
    # and `ptbr info` says so before any run (at the --seq-len given, or train's default)
    assert main(["info", "--data", str(dataset_dir), "--seq-len", str(seq_len)]) == 0
    assert (f"warning    val.bin holds {seq_len} tokens, fewer than seq_len + 1 = {seq_len + 1}: training at "
            f"--seq-len {seq_len} will not evaluate") in capsys.readouterr().out
    assert main(["info", "--data", str(dataset_dir), "--seq-len", str(seq_len - 1)]) == 0
    assert "will not evaluate" not in capsys.readouterr().out


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, capsys):
    args = ["train", "--model-size", "tiny", "--seq-len", "32", "--device", "cpu", "--max-steps", "2"]
    assert main([*args, "--output", str(tmp_path / "run"), "--warmup-steps", "3"]) == 0
    assert ("warning: --warmup-steps 3 is more than --max-steps 2: the learning rate rises for the whole run and "
            "never reaches its peak (--learning-rate)") in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path / "equal"), "--warmup-steps", "2"]) == 0  # the peak at the end
    err = capsys.readouterr().err
    assert "--warmup-steps" not in err and "--fsdp" not in err
    assert main([*args, "--output", str(tmp_path / "fsdp"), "--fsdp"]) == 0  # one process: nothing to shard
    assert "warning: --fsdp shards the model over the processes of a data-parallel run; in one process it changes " \
           "nothing" in capsys.readouterr().err


def test_bad_token_in_training_data_names_file_and_offset(tmp_path, dataset_dir, capsys):
    data = np.fromfile(dataset_dir / "train.bin", dtype="<u2")
    data[:] = 399
    data[::7] = 401  # beyond the 400-token vocab, everywhere a window can land
    data.tofile(dataset_dir / "train.bin")
    (dataset_dir / "meta.json").unlink()  # older layout: only the quick scan and the batch checks
    tokenizer = dataset_dir / "tokenizer.json"
    code = main(["train", "--output", str(tmp_path / "run"), "--data", str(dataset_dir), "--tokenizer",
                 str(tokenizer), "--model-size", "tiny", "--seq-len", "16", "--max-steps", "1", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 3
    assert err.startswith("error: train.bin holds token id 401 >= vocab size 400 at token offset 0:")



@pytest.mark.parametrize("part", ["val", "train"])
def test_bad_data_found_before_the_first_step_leaves_no_run_directory_behind(tmp_path, dataset_dir, capsys, part):
    """val.bin's windows are checked after run_config.json is written, the first batch of train.bin
    (a dataset with meta.json) after the metrics files are made: the directory the refused run made
    held those besides its log, read as a run that had started, and stayed."""
    data = np.fromfile(dataset_dir / f"{part}.bin", dtype="<u2")
    data[::7] = 401  # wherever a window lands
    data.tofile(dataset_dir / f"{part}.bin")
    args = ["train", "--data", str(dataset_dir), "--model-size", "tiny", "--seq-len", "16", "--max-steps", "1",
            "--device", "cpu"]
    assert main([*args, "--output", str(tmp_path / "run")]) == 3
    assert f"token id 401 >= vocab size 400 ({dataset_dir / part}.bin at token offset" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    if part == "train":
        return
    # the parents it made on the way go too; a folder of the user's stays, even empty
    assert main([*args, "--output", str(tmp_path / "new" / "a" / "run")]) == 3
    (tmp_path / "mine").mkdir()
    assert main([*args, "--output", str(tmp_path / "mine" / "run")]) == 3
    assert not (tmp_path / "new").exists() and (tmp_path / "mine").is_dir()
    (tmp_path / "kept").mkdir()  # a directory the user made: theirs, with what the run wrote in it
    assert main([*args, "--output", str(tmp_path / "kept")]) == 3
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [".ptbr.lock", "run_config.json", "train.log"]

def test_a_run_closes_its_processes_world_when_it_ends_well_or_is_stopped(tmp_path, monkeypatch):
    """The process group of a data-parallel run is destroyed at its end (else gloo's threads run on
    while the process exits), and after a stop by a signal (every rank stops at the same step
    boundary); never after a failure, when other ranks may still be inside a collective. Checked
    on the single-process world, which takes the same path."""
    from ptbr.backends.world import SingleProcess
    from ptbr.errors import Interrupted
    from ptbr.runs import common

    closed = []
    monkeypatch.setattr(SingleProcess, "close", lambda self: closed.append(self))
    train(tmp_path / "run", "--max-steps", "2")
    assert len(closed) == 1
    assert main(["train", "--output", str(tmp_path / "other"), "--model-size", "tiny", "--seq-len", "32",
                 "--resume", str(tmp_path / "missing"), "--device", "cpu"]) != 0
    assert len(closed) == 1
    world = SingleProcess()
    with pytest.raises(Interrupted), common.closing_world(world):
        raise Interrupted("stopped by SIGTERM at step 3")
    assert closed == [closed[0], world]
    with pytest.raises(ValueError), common.closing_world(world):
        raise ValueError("a bug")
    assert len(closed) == 2


def test_the_progress_bar_shows_on_a_terminal_that_reports_no_size(monkeypatch):
    """A pty nobody sized (`script`, some CI and container consoles) reports 0 x 0: tqdm's dynamic
    size drew nothing there, so a run showed no progress at all."""
    import os
    import pty
    import select
    import sys

    from ptbr.train.progress import Progress

    master, slave = pty.openpty()
    assert os.get_terminal_size(slave).columns == 0
    with os.fdopen(slave, "w", buffering=1) as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        progress = Progress(10, 0, 1)
        for step in range(1, 11):
            progress.update(step, 5.0, 1e-3, 1000.0)
        progress.close()
        stream.flush()
        shown = b""
        while select.select([master], [], [], 0.5)[0]:
            shown += os.read(master, 1 << 16)
    os.close(master)
    assert b"10/10" in shown and b"loss 5.0000" in shown


def test_every_file_a_run_writes_is_readable_as_any_new_file_is(tmp_path):
    """safetensors writes its files 0600 (through a private temporary file): a model beside 0644
    configs that another user, or the host's user of a container's output, could not read. The
    writer gives them the permissions of any new file (the umask's)."""
    import os
    import stat

    umask = os.umask(0o022)
    os.umask(umask)
    usual = 0o666 & ~umask
    train(tmp_path / "run", "--max-steps", "3")
    written = [p for folder in ("final", "checkpoints") for p in (tmp_path / "run" / folder).rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in written)
    private = [f"{p.relative_to(tmp_path)}: {stat.S_IMODE(p.stat().st_mode):o}" for p in written
               if stat.S_IMODE(p.stat().st_mode) & usual != usual]
    assert not private


def test_a_run_whose_peak_is_beyond_the_ram_is_refused_before_its_model_is_built(tmp_path, capsys, monkeypatch):
    """On a CPU the kernel kills a run that runs out of memory: exit 137, no line, a dead-looking
    run directory (a --batch-size 100000 predicted 92 GiB on a 23 GiB machine and started)."""
    import psutil

    real, swap = psutil.virtual_memory(), psutil.swap_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2**30))
    monkeypatch.setattr(psutil, "swap_memory", lambda: swap._replace(free=0))
    args = ["train", "--model-size", "tiny", "--seq-len", "32", "--device", "cpu", "--max-steps", "1"]
    assert main([*args, "--output", str(tmp_path / "run"), "--batch-size", "4096"]) == 5
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: the memory model predicts a peak of ") and "GiB more than this process holds, " \
        "and 1.0 GiB is free (RAM and swap): the kernel would kill the run (--batch-size 4096); fix: run with " \
        "--auto-fit" in line, line
    assert not (tmp_path / "run").exists()
    assert main([*args, "--output", str(tmp_path / "fits"), "--batch-size", "2"]) == 0
