"""Resuming never continues another run: one check of the checkpoint against the requested run
(mode, model, data, batching, schedule) before any model is built; starting over moves the old run
aside; corrupt checkpoints are detected by their hashes and passed over; --max-steps on resume
continues the same schedule. Real runs of the tiny preset on the bundled sample, through the CLI."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ptbr.cli import main
from ptbr.train.schedule import lr_at

TINY = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--eval-every", "0",
        "--eval-batches", "1"]


def train(out: Path, *extra: str) -> int:
    return main(["train", "--output", str(out), *TINY, *extra])


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_resume_never_then_auto_never_revives_the_old_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "12", "--save-every", "4") == 0
    assert train(out, "--max-steps", "3", "--save-every", "3", "--resume", "never") == 0
    err = capsys.readouterr().err
    assert "--resume never: starting over; the previous run's files were moved to" in err
    # the 12-step run is out of reach: only the new run's checkpoint is left where --resume auto looks
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003"]
    (previous,) = (out / "previous").iterdir()
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == [
        "step_000004", "step_000008", "step_000012"]
    assert (previous / "final").is_dir() and not (previous / "train.log").exists()

    fresh = tmp_path / "fresh"
    assert train(fresh, "--max-steps", "3", "--save-every", "3") == 0
    assert train(out, "--max-steps", "3", "--save-every", "3", "--resume", "auto") == 0
    assert "the run already reached its last step, 3" in capsys.readouterr().err
    assert same_weights(out / "final", fresh / "final")  # the new run's weights, not step 12's
    assert "--resume never: starting over" in (out / "train.log").read_text()


@pytest.mark.parametrize("change, differs", [
    (["--seq-len", "64"], "seq_len is 32 in the checkpoint, 64 now"),
    (["--model-size", "85m"], "model_size is 'tiny' in the checkpoint, '85m' now"),
    (["--batch-size", "8"], "effective_batch is 4 in the checkpoint, 8 now"),
    (["--seed", "7"], "seed is 1337 in the checkpoint, 7 now"),
    (["--learning-rate", "0.001"], "learning_rate is 0.003 in the checkpoint, 0.001 now"),
    # torch's optimizer state brought back the checkpoint's: recorded in run_config.json, never used
    (["--weight-decay", "0.9"], "weight_decay is 0.1 in the checkpoint, 0.9 now"),
    (["--beta1", "0.5", "--beta2", "0.6"], "beta1 is 0.9 in the checkpoint, 0.5 now; beta2 is 0.95 in the checkpoint, "
                                          "0.6 now"),
    pytest.param(["--backend", "mlx"], "backend is 'torch' in the checkpoint, 'mlx' now (--backend torch resumes it)",
                 marks=pytest.mark.skipif(find_spec("mlx") is None, reason="mlx is not installed")),
])
def test_a_checkpoint_of_another_run_is_refused_before_any_model_is_built(tmp_path, capsys, monkeypatch, change,
                                                                           differs):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2") == 0
    capsys.readouterr()
    built = []
    from ptbr.backends.torch import TorchBackend

    monkeypatch.setattr(TorchBackend, "pretrain_step", lambda *a, **k: built.append(1))
    assert train(out, "--max-steps", "4", *change) == 2
    line = last_error(capsys)
    assert line.startswith("error: the checkpoint belongs to another run: ") and differs in line
    assert "--resume never" in line and "another --output" in line
    assert not built
    assert differs in (out / "train.log").read_text()  # the error line is in the log too


def test_other_data_or_tokenizer_is_refused(tmp_path, capsys, dataset_dir):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2") == 0  # the bundled sample
    capsys.readouterr()
    assert train(out, "--max-steps", "4", "--data", str(dataset_dir)) == 2
    line = last_error(capsys)
    assert "vocab_size is 2048 in the checkpoint, 400 now" in line
    assert "tokenizer_sha256 is" in line and "train_data is" in line


def test_the_same_data_under_another_path_resumes(tmp_path, capsys, dataset_dir):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2", "--data", str(dataset_dir)) == 0
    moved = tmp_path / "moved"
    shutil.copytree(dataset_dir, moved)
    assert train(out, "--max-steps", "3", "--data", str(moved)) == 0
    assert "resuming from" in capsys.readouterr().err


def test_a_finetuning_checkpoint_given_to_train_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "1", "--save-every", "1") == 0
    state_file = out / "checkpoints" / "step_000001" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["run"]["identity"] = {"mode": "finetune", "backend": "torch"}
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert train(out, "--max-steps", "2", "--resume", str(state_file.parent)) == 2
    assert "it is a fine-tuning (ptbr finetune) checkpoint and this is a pretraining (ptbr train) run" in \
        last_error(capsys)


def test_a_corrupt_checkpoint_of_the_right_size_falls_back_to_the_previous_one(tmp_path, capsys):
    straight = tmp_path / "straight"
    assert train(straight, "--max-steps", "4", "--save-every", "2") == 0
    out = tmp_path / "run"
    assert train(out, "--max-steps", "4", "--save-every", "2") == 0
    shutil.rmtree(out / "final")
    newest = out / "checkpoints" / "step_000004" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside a weight, the size unchanged
    newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert train(out, "--max-steps", "4", "--save-every", "2") == 0
    err = capsys.readouterr().err
    assert "checkpoint step_000004 is corrupt (model.safetensors does not match the sha256" in err
    assert "resuming from" in err and "step_000002" in err
    assert "weights_only" not in err
    assert same_weights(out / "final", straight / "final")  # redone from step 2, exactly


def test_a_named_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2") == 0
    optimizer = out / "checkpoints" / "step_000002" / "optimizer.pt"
    optimizer.write_bytes(b"\0" * optimizer.stat().st_size)
    capsys.readouterr()
    assert train(out, "--max-steps", "3", "--resume", str(optimizer.parent)) == 4
    line = last_error(capsys)
    assert line.startswith("error: the checkpoint is corrupt: optimizer.pt does not match") and "weights_only" not in line


def test_a_mistyped_resume_keyword_is_a_setting_error_not_a_missing_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train(tmp_path / "run", "--max-steps", "1", "--resume", "nevr") == 2
    assert last_error(capsys) == ("error: --resume nevr: no such checkpoint, and not auto or never (--resume); "
                                  "fix: did you mean --resume never?")
    assert train(tmp_path / "run", "--max-steps", "1", "--resume", "runs/x/checkpoints/step_000002") == 4
    assert last_error(capsys).startswith("error: checkpoint not found (runs/x/checkpoints/step_000002)")
    (tmp_path / "a_file").write_text("x")
    assert train(tmp_path / "run", "--max-steps", "1", "--resume", "a_file") == 4
    assert last_error(capsys).startswith("error: a file, not a checkpoint directory (a_file)")


def test_a_checkpoint_that_cannot_be_loaded_never_suggests_unsafe_loading(tmp_path, capsys):
    """A state file with the right hash but not a tensor file (written by something else): one line,
    exit 4, and never torch's advice to load with weights_only=False."""
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2") == 0
    checkpoint = out / "checkpoints" / "step_000002"
    import pickle

    (checkpoint / "rng.pt").write_bytes(pickle.dumps(object()))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    from ptbr.files import file_sha256

    state["files"]["rng.pt"] = {"size": (checkpoint / "rng.pt").stat().st_size,
                                "sha256": file_sha256(checkpoint / "rng.pt")}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    capsys.readouterr()
    assert train(out, "--max-steps", "3") == 4
    line = last_error(capsys)
    assert line.startswith("error: cannot load the checkpoint") and "weights_only" not in line


def test_resume_from_an_earlier_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "6", "--save-every", "2") == 0
    capsys.readouterr()
    assert train(out, "--max-steps", "6", "--save-every", "2", "--resume",
                 str(out / "checkpoints" / "step_000002")) == 0
    assert "the 2 newer checkpoint(s) were moved to" in capsys.readouterr().err
    # the run went on from step 2 and wrote its own 4 and 6; the abandoned ones are in previous/
    (previous,) = (out / "previous").iterdir()
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    # the abandoned steps' metrics too: the resumed run cut its own back to step 2 before it went on
    assert [r["step"] for r in metrics(previous)] == [1, 2, 3, 4, 5, 6]
    assert metrics(previous) != metrics(out) and (previous / "metrics.csv").is_file()


def test_a_resume_at_another_micro_batch_evaluates_the_same_windows(tmp_path, capsys):
    """batch 4 x grad_accum 1, resumed as 2 x 2 (the same effective batch, allowed): the validation
    windows are the 8 the run started with (--eval-batches 2 x 4), not 2 x 2, so val_loss stays
    comparable with the best one so far."""
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2", "--eval-every", "2", "--eval-batches", "2") == 0
    assert "evaluation: 8 windows of val.bin (256 target tokens of its " in capsys.readouterr().err
    shutil.rmtree(out / "final")
    assert main(["train", "--output", str(out), *TINY[:4], "--batch-size", "2", "--grad-accum", "2", *TINY[6:],
                 "--max-steps", "3", "--eval-every", "2", "--eval-batches", "2"]) == 0
    err = capsys.readouterr().err
    assert ("evaluation: 8 windows of val.bin (256 target tokens of its " in err
            and "(as the run started; --eval-batches x the global micro-batch is 4 now)" in err), err


def test_max_steps_on_resume_continues_the_same_schedule(tmp_path, capsys):
    """The schedule is fixed when the run starts (warmup 1 and cosine over 4 steps here): resumed
    with --max-steps 6, steps 5-6 train at the floor; the learning rate never jumps."""
    out = tmp_path / "run"
    assert train(out, "--max-steps", "4", "--save-every", "2") == 0
    capsys.readouterr()
    assert train(out, "--max-steps", "6", "--save-every", "2") == 0
    assert "training to step 6 goes past the 4 steps the schedule was planned for: steps 5-6 train at its final " \
           "learning rate 3.00e-04" in capsys.readouterr().err
    lrs = [row["lr"] for row in metrics(out)]
    expected = [lr_at(step, 3e-3, 1, 4, 0.1) for step in range(6)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[4] == lrs[5] == pytest.approx(3e-4)
    # a smaller --max-steps than the checkpoint's step is refused, not silently "done"
    assert train(out, "--max-steps", "3") == 2
    assert "the checkpoint is at step 6, past --max-steps 3" in last_error(capsys)


def test_run_config_records_the_schedule_a_resumed_run_follows(tmp_path):
    """Resumed with a longer --max-steps, the default warmup (5% of it) is not what the run uses:
    run_config.json (and the report's settings) showed 2 where the checkpoint's schedule, 1, ruled."""
    out = tmp_path / "run"
    assert train(out, "--max-steps", "4", "--save-every", "4") == 0
    assert train(out, "--max-steps", "30", "--save-every", "0") == 0
    config = json.loads((out / "run_config.json").read_text())
    assert config["settings"]["warmup_steps"] == 1 and config["settings"]["max_steps"] == 30
    assert config["schedule"] == {"peak_lr": 3e-3, "warmup_steps": 1, "horizon": 4, "min_lr_ratio": 0.1}
    fresh = tmp_path / "fresh"
    assert train(fresh, "--max-steps", "3") == 0
    assert json.loads((fresh / "run_config.json").read_text())["schedule"] == {
        "peak_lr": 3e-3, "warmup_steps": 1, "horizon": 3, "min_lr_ratio": 0.1}


def test_a_damaged_metrics_line_costs_that_line_only(tmp_path, capsys):
    """A line of metrics.jsonl that is not a row (edited, damaged): monitor says so, and a resume
    keeps every other row up to its checkpoint (it used to keep only those before the damage)."""
    out = tmp_path / "run"
    assert train(out, "--max-steps", "4", "--save-every", "4") == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[1] = "{not json"
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["monitor", str(out), "--once"]) == 0
    assert "warning: metrics.jsonl: line 2 is not a metrics row (left out)" in capsys.readouterr().out
    assert train(out, "--max-steps", "5", "--save-every", "5") == 0
    assert "1 line(s) that are not metrics rows left out on resume (line 2); the other rows are kept" \
        in capsys.readouterr().err
    assert [row["step"] for row in metrics(out)] == [1, 3, 4, 5]
    assert (out / "metrics.csv").read_text().count("\n") == 5  # its header and the same 4 rows


def test_error_lines_and_the_stop_line_reach_train_log(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "2", "--save-every", "2") == 0
    assert train(out, "--max-steps", "1") == 2
    log = (out / "train.log").read_text()
    assert "error: the checkpoint is at step 2, past --max-steps 1" in log
