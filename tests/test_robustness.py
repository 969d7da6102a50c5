"""Never die silently: one-line errors, locks, the hang watchdog, signals, safe checkpoints, NaN.

Every test here runs the real CLI in a subprocess, as a user (or Kaggle, or `docker stop`) would.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli

TINY = ["--model-size", "tiny", "--seq-len", "64", "--batch-size", "8", "--device", "cpu"]


def train_cmd(output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ptbr", "train", "--output", str(output), *TINY, *extra]


def metric_lines(output: Path) -> int:
    try:
        return len((output / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_for(predicate, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ---- bad input: one line, a documented exit code, no traceback -------------------------------


def _bad_inputs(tmp: Path, dataset: Path) -> dict[str, tuple[list[str], int, str]]:
    empty = tmp / "empty"
    empty.mkdir()
    odd = tmp / "odd"
    odd.mkdir()
    (odd / "train.bin").write_bytes(b"\x01\x00\x02")
    short = tmp / "short"
    short.mkdir()
    (short / "train.bin").write_bytes(np.array([1, 2, 3], dtype="<u2").tobytes())
    corrupt_tok = tmp / "corrupt.json"
    corrupt_tok.write_text('{"not": "a tokenizer"')
    unknown_keys = tmp / "unknown.yaml"
    unknown_keys.write_text("batch_size: 2\nlearnig_rate: 0.1\n")
    blocker = tmp / "a_file"
    blocker.write_text("x")
    model = tmp / "final"  # an earlier run's finished model
    model.mkdir()
    (model / "model.safetensors").write_text("x")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "not_json.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp / "schema.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    (tmp / "latin1.jsonl").write_bytes('{"text": "ação"}\n'.encode("latin-1"))
    (tmp / "roles.jsonl").write_text('{"messages": [{"role": "assistant", "content": "oi"}, '
                                     '{"role": "user", "content": "tudo bem?"}]}\n')
    (tmp / "no_config").mkdir()
    (tmp / "no_weights").mkdir()
    (tmp / "no_weights" / "config.json").write_text('{"model_type": "mistral"}')
    tok = str(dataset / "tokenizer.json")
    sentencepiece = tmp / "tokenizer.model"
    sentencepiece.write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")  # a protobuf's first bytes
    out = str(tmp / "out")
    good = str(tmp / "not_json.jsonl")
    return {
        "missing data dir": (["train", "--data", str(tmp / "nope"), "--output", out], 3, "data directory not found"),
        "empty data dir": (["train", "--data", str(empty), "--output", out], 3, "no train.bin"),
        "odd byte count": (["train", "--data", str(odd), "--tokenizer", tok, "--output", out], 3, "not a multiple of 2"),
        "shorter than seq_len + 1": (["train", "--data", str(short), "--tokenizer", tok, "--output", out, "--seq-len",
                                      "16"], 3, "fewer than seq_len + 1"),
        "missing tokenizer": (["train", "--data", str(odd), "--tokenizer", str(tmp / "none.json"), "--output", out], 3,
                              "tokenizer not found"),
        "tokenizer a directory": (["train", "--data", str(odd), "--tokenizer", str(tmp), "--output", out], 3,
                                  f"tokenizer is a directory, not a tokenizer.json: {tmp}"),
        "corrupt tokenizer": (["train", "--data", str(odd), "--tokenizer", str(corrupt_tok), "--output", out], 3,
                              "tokenizer.json is corrupt"),
        # a model's folder: the file in it is named; a SentencePiece model is another format, not a corrupt file
        "tokenizer a dataset's folder": (["train", "--data", str(odd), "--tokenizer", str(dataset), "--output", out], 3,
                                         f"fix: give the file in it: --tokenizer {dataset / 'tokenizer.json'}"),
        "tokenizer.model": (["train", "--data", str(odd), "--tokenizer", str(sentencepiece), "--output", out], 3,
                            "not a tokenizer.json (a SentencePiece tokenizer.model or another format): --tokenizer takes "
                            "the tokenizers library's JSON"),
        "seq_len above max positions": (["train", "--seq-len", "4096", "--output", out], 2, "exceeds the tiny model"),
        "batch size 0": (["train", "--batch-size", "0", "--output", out], 2, "batch_size must be a positive integer"),
        "grad accum negative": (["train", "--grad-accum", "-2", "--output", out], 2, "grad_accum must be a positive"),
        "steps 0": (["train", "--max-steps", "0", "--output", out], 2, "max_steps must be a positive integer"),
        "learning rate 0": (["train", "--learning-rate", "0", "--output", out], 2, "learning_rate must be a finite"),
        "learning rate nan": (["train", "--learning-rate", "nan", "--output", out], 2, "learning_rate must be a finite"),
        "unknown preset": (["train", "--model-size", "7b", "--output", out], 2, "unknown model size '7b'"),
        "output cannot be created": (["train", "--output", str(blocker / "run"), "--max-steps", "1"], 6,
                                     "cannot create or write the output directory"),
        "output is a file": (["train", "--output", str(blocker), "--max-steps", "1"], 6,
                             "the output path is a file, not a directory"),
        "output is a model's folder": (["train", "--output", str(model), "--max-steps", "1"], 6,
                                       "the output directory holds a model (model.safetensors), not a run"),
        "config with unknown keys": (["train", "--config", str(unknown_keys), "--output", out], 2,
                                     "unknown key 'learnig_rate'"),
        "prepare on nothing": (["prepare", "--input", str(tmp / "none.txt"), "--output", out], 3, "input not found"),
        "jsonl empty": (["validate-data", str(tmp / "empty.jsonl")], 3, "1 problem found"),
        "jsonl not json": (["validate-data", str(tmp / "not_json.jsonl")], 3, "1 problem found"),
        "jsonl wrong schema": (["validate-data", str(tmp / "schema.jsonl")], 3, "1 problem found"),
        "jsonl not utf-8": (["validate-data", str(tmp / "latin1.jsonl")], 3, "1 problem found"),
        "jsonl roles out of order": (["validate-data", str(tmp / "roles.jsonl")], 3, "problems found"),
        "base without config": (["finetune", "--base", str(tmp / "no_config"), "--data", good, "--output", out], 4,
                                "no config.json in the base model directory"),
        "base without weights": (["finetune", "--base", str(tmp / "no_weights"), "--data", good, "--output", out], 4,
                                 "no weights"),
    }


CASES = ["missing data dir", "empty data dir", "odd byte count", "shorter than seq_len + 1", "missing tokenizer",
         "corrupt tokenizer", "seq_len above max positions", "batch size 0", "grad accum negative", "steps 0",
         "learning rate 0", "learning rate nan", "unknown preset", "output cannot be created",
         "config with unknown keys", "prepare on nothing", "jsonl empty", "jsonl not json", "jsonl wrong schema",
         "jsonl not utf-8", "jsonl roles out of order", "base without config", "base without weights"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_with_a_documented_code(case, tmp_path, dataset_dir):
    args, code, fragment = _bad_inputs(tmp_path, dataset_dir)[case]
    run = run_cli(*args)
    assert run.returncode == code, run.stderr
    line = last_line(run.stderr)
    assert line.startswith("error: ") and fragment in line and "; fix: " in line
    assert "Traceback" not in run.stderr


def test_validate_data_lists_every_problem_with_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "assistant", "content": "oi"}, {"role": "user", "content": "x"}]}\n'
                   'not json\n{"foo": 1}\n{"prompt": "", "completion": "b"}\n')
    run = run_cli("validate-data", str(bad))
    assert run.returncode == 3
    for line in (1, 2, 3):
        assert f"line {line}: " in run.stdout
    assert "invalid JSON" in run.stdout and "unknown schema" in run.stdout


# ---- one run per output directory ------------------------------------------------------------


def test_a_run_that_loses_the_lock_of_a_new_directory_leaves_the_winner_s_directory(tmp_path, monkeypatch):
    """Two runs started at once on a new --output: both saw it missing; the one that lost the lock
    failed (exit 6) and, taking the directory for one it had made, deleted the winner's (which
    held only its log and lock yet), so both failed. Only a run that held the lock removes."""
    import ptbr.runs.common as common
    from ptbr.config import PretrainConfig
    from ptbr.errors import OutputError
    from ptbr.lock import RunLock

    out = tmp_path / "run"
    real_create = common.create_run_dir
    winner: dict = {}

    def the_other_run_first(output: str) -> Path:  # the winner creates and locks between our two looks
        made = real_create(output)
        winner["lock"] = RunLock(made).acquire()
        (made / "train.log").write_text("the winner's log\n")
        return made

    monkeypatch.setattr(common, "create_run_dir", the_other_run_first)
    try:
        with pytest.raises(OutputError, match="another ptbr run"):
            with common.open_run(PretrainConfig(output=str(out))):
                pass
        assert (out / "train.log").read_text() == "the winner's log\n" and (out / ".ptbr.lock").exists()
        assert not list(out.glob(".tmp-*"))  # the probe of writability, removed
    finally:
        winner["lock"].release()


@pytest.mark.slow
def test_a_second_run_on_the_same_output_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(train_cmd(out, "--max-steps", "100000", "--save-every", "0"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: metric_lines(out) >= 1, what="the first run's first step")
        second = run_cli("train", "--output", str(out), *TINY, "--max-steps", "2")
        assert second.returncode == 6
        assert f"another ptbr run (PID {first.pid} on " in last_line(second.stderr)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = run_cli("train", "--output", str(out), *TINY, "--max-steps", "2", "--resume", "never")
    assert third.returncode == 0, third.stderr
    assert f"taking over a stale lock from PID {first.pid}" in third.stderr


# ---- hang watchdog ---------------------------------------------------------------------------

STALL_SCRIPT = textwrap.dedent("""
    import sys, time
    from ptbr.data import tokens
    stall_at, stall_s = int(sys.argv[1]), float(sys.argv[2])
    original = tokens.PretrainBatches.cycle
    def stalled(self, step):
        if step == stall_at:
            time.sleep(stall_s)  # a data source that stops answering (a dead network mount, say)
        return original(self, step)
    tokens.PretrainBatches.cycle = stalled
    from ptbr.cli import main
    raise SystemExit(main(sys.argv[3:]))
""")


def run_stalled(output: Path, stall_at: int, stall_s: float, *extra: str) -> subprocess.CompletedProcess:
    # 15 s: longer than start-up (imports, model build) on a busy 2-core machine, which the
    # watchdog also covers
    args = ["train", "--output", str(output), *TINY, "--max-steps", "4", "--hang-timeout", "15", *extra]
    return subprocess.run([sys.executable, "-c", STALL_SCRIPT, str(stall_at), str(stall_s), *args],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("stall_at,phase", [(0, "before the first step"), (2, "training after step 2")])
def test_a_stalled_data_source_is_reported_and_the_run_exits(tmp_path, stall_at, phase):
    out = tmp_path / "run"
    started = time.monotonic()
    run = run_stalled(out, stall_at, 600)
    assert run.returncode == 8, run.stderr
    assert time.monotonic() - started < 90
    report = (out / "hang_report.txt").read_text()
    assert "no progress for" in report and phase in report
    assert "process RSS" in report and "last log lines:" in report
    assert " in stalled" in report  # the stuck frame, in the main thread's stack
    assert "Thread 0x" in report and "ptbr/train/watchdog.py" in report  # every thread is dumped
    assert f"hang report in {out / 'hang_report.txt'}" in run.stderr


@pytest.mark.slow
def test_hang_action_warn_reports_and_keeps_waiting(tmp_path):
    out = tmp_path / "run"
    run = run_stalled(out, 1, 20, "--hang-action", "warn")
    assert run.returncode == 0, run.stderr
    assert (out / "hang_report.txt").is_file() and "still waiting" in run.stderr
    # the run went on and succeeded: the report is a warning, not an error
    assert "warning: no progress for" in run.stderr and "error:" not in run.stderr
    assert metric_lines(out) == 4


# ---- crash capture ---------------------------------------------------------------------------


def test_an_unexpected_exception_leaves_a_crash_report(tmp_path):
    script = textwrap.dedent("""
        import sys
        from ptbr.backends.torch import step
        def broken(self, micro_batches, lr):
            raise RuntimeError("simulated bug inside the step")
        step.TorchStep.train_step = broken
        from ptbr.cli import main
        raise SystemExit(main(sys.argv[1:]))
    """)
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-c", script, "train", "--output", str(out), *TINY, "--max-steps", "2"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 1
    report = out / "crash_report.txt"
    assert last_line(run.stderr) == (f"error: unexpected RuntimeError: simulated bug inside the step "
                                     f"(details in {report}); fix: this is a bug in ptbr, please report it with "
                                     "that file")
    text = report.read_text()
    assert "Traceback" in text and "simulated bug inside the step" in text and "'max_steps': 2" in text
    assert "versions: {'python'" in text


def test_an_unexpected_exception_without_a_run_points_to_its_traceback(monkeypatch, capsys):
    """A command with no run directory writes no crash report: the line asks for the traceback
    (--debug), and under --debug says it is above, never "rerun with --debug"."""
    from ptbr.cli import main
    from ptbr.commands import info

    def broken(args):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(info, "main", broken)
    assert main(["info", "--model-size", "tiny"]) == 1
    assert last_line(capsys.readouterr().err) == (
        "error: unexpected RuntimeError: simulated bug (rerun with --debug for the traceback); fix: this is a bug "
        "in ptbr, please report it with that traceback")
    assert main(["info", "--model-size", "tiny", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and last_line(err) == ("error: unexpected RuntimeError: simulated bug (traceback above); "
                                                     "fix: this is a bug in ptbr, please report it with the traceback "
                                                     "above")


# ---- graceful stop, SIGKILL, safe checkpoints --------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_within_seconds_and_the_next_run_resumes(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(out, "--max-steps", "100000", "--save-every", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: metric_lines(out) >= 3, what="three steps")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 130
    line = last_line(err)
    assert line.startswith("error: stopped by SIGTERM at step ") and "run the same command again to resume" in line
    step = int(line.split("at step ")[1].split()[0])
    assert line in (out / "train.log").read_text()  # the stop line is in the run's log too
    checkpoint = out / "checkpoints" / f"step_{step:06d}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    again = run_cli("train", "--output", str(out), *TINY, "--max-steps", str(step + 2), "--save-every", "0")
    assert again.returncode == 0, again.stderr
    assert f"resuming from {checkpoint} (step {step})" in again.stderr
    assert metric_lines(out) == step + 2


def test_a_stop_signal_during_a_checkpoint_save_stops_at_that_checkpoint(tmp_path, monkeypatch, capsys):
    """A SIGTERM that lands while a due checkpoint is written (the longest moment of a step for a
    big model) was seen only after one more step and a second full save: seconds to minutes more
    under `docker stop` or Kaggle's grace period, and the risk of a SIGKILL mid-save."""
    import ptbr.train.loop as loop
    from ptbr.cli import main

    real = loop.save_checkpoint

    def save_and_signal(run_dir, step, *args, **kwargs):
        path = real(run_dir, step, *args, **kwargs)
        if step == 2:
            signal.raise_signal(signal.SIGTERM)  # as if it arrived while the files were written
        return path

    monkeypatch.setattr(loop, "save_checkpoint", save_and_signal)
    out = tmp_path / "run"
    assert main(["train", "--output", str(out), *TINY, "--max-steps", "6", "--save-every", "2"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM at step 2 ")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"] and metric_lines(out) == 2


@pytest.mark.parametrize("own_session", [True, False], ids=["launcher's worker", "terminal's process"])
def test_a_sigterm_after_a_ctrl_c_stops_at_once_only_where_a_launcher_passed_both_on(monkeypatch, own_session):
    """torch's launcher (torchrun, --num-processes) starts each worker in a session of its own and
    passes a first Ctrl-C on as SIGINT, a second as SIGTERM: that SIGTERM is the second Ctrl-C and
    stops at once (it went on to write the checkpoint, up to the launcher's 600 s). A process in
    the terminal's session gets a Ctrl-C itself, and a launcher's SIGTERM a moment later may be
    that same Ctrl-C passed on: the checkpoint is still saved. The stop is named for the first
    signal (the SIGTERM renamed a Ctrl-C's stop)."""
    import ptbr.train.loop as loop

    monkeypatch.setattr(loop, "_in_a_session_of_its_own", lambda: own_session)
    with loop.GracefulStop() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        if own_session:
            with pytest.raises(KeyboardInterrupt, match="^SIGTERM$"):
                signal.raise_signal(signal.SIGTERM)
        else:
            signal.raise_signal(signal.SIGTERM)
            assert stop.signal_name == "SIGINT"
            with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C stops at once everywhere
                signal.raise_signal(signal.SIGINT)


def test_only_a_launchers_worker_takes_a_sigterm_after_a_ctrl_c_for_a_second_one(monkeypatch):
    """Any session leader did: `ptbr train` as a container's PID 1, a systemd service, a Slurm task
    (--signal=INT@60 to save before the limit, a SIGTERM at it) had its checkpoint cut short."""
    import os

    import ptbr.train.loop as loop

    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid())  # a session leader
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not loop._in_a_session_of_its_own()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "ptbr-1")  # what torch's launcher sets for its workers
    assert loop._in_a_session_of_its_own()
    monkeypatch.setattr(os, "getsid", lambda pid: 1)  # in another's session (a terminal's)
    assert not loop._in_a_session_of_its_own()


def test_sigterm_before_training_starts_is_exit_130_with_a_line(tmp_path):
    """Before the graceful stop is in place (imports, data checks, building the model), SIGTERM
    stops a run as Ctrl-C does: exit 130 and one line, not the shell's silent 143."""
    ready = tmp_path / "building"
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        import ptbr.runs.pretrain as pretrain
        def slow_start(*args, **kwargs):
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(120)  # a model that takes long to build
        pretrain._run = slow_start
        from ptbr.cli import main
        raise SystemExit(main(sys.argv[1:]))
    """)
    out = tmp_path / "run"
    out.mkdir()  # the user's: kept, with the run's log (a directory the run made would go, holding only that)
    proc = subprocess.Popen([sys.executable, "-c", script, "train", "--output", str(out), *TINY, "--max-steps", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(ready.exists, what="the run to start")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert last_line(err) == ("error: stopped by SIGTERM (ptbr train); fix: run the same command again (a training "
                              "run resumes from its last checkpoint, where it saved one)")
    assert not (out / "checkpoints").exists() and "Traceback" not in err
    # train.log ends with the same line (it had only "error: stopped by SIGTERM")
    assert (out / "train.log").read_text().splitlines()[-1].endswith(last_line(err))


def test_a_stopped_run_whose_stderr_reader_has_gone_still_ends_with_130(tmp_path):
    """`ptbr train ... 2>&1 | head -8`, then a stop signal: the checkpoint is saved and the exit
    code is 130, as a script that resumes on 130 expects (writing the stop line to the closed pipe
    made it 141)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(out, "--max-steps", "100000", "--save-every", "0"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    proc.stderr.close()  # the reader is gone before the run writes anything
    wait_for(lambda: metric_lines(out) >= 2 or proc.poll() is not None, what="two steps")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    assert len(list((out / "checkpoints").iterdir())) == 1


@pytest.mark.slow
def test_sigkill_at_several_moments_then_resume_gives_the_uninterrupted_weights(tmp_path):
    settings = ["--max-steps", "12", "--save-every", "2"]
    reference = tmp_path / "reference"
    assert subprocess.run(train_cmd(reference, *settings), capture_output=True).returncode == 0
    expected = load_file(str(reference / "final" / "model.safetensors"))
    for kill_after in (1, 5, 9):
        out = tmp_path / f"killed_after_{kill_after}"
        proc = subprocess.Popen(train_cmd(out, *settings), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda out=out, proc=proc, k=kill_after: metric_lines(out) >= k or proc.poll() is not None,
                 what=f"step {kill_after}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (out / "final").exists(), "the run finished before it could be killed"
        resumed = subprocess.run(train_cmd(out, *settings), capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr
        got = load_file(str(out / "final" / "model.safetensors"))
        assert all(torch.equal(got[name], expected[name]) for name in expected), f"killed after {kill_after}"


def test_incomplete_checkpoints_are_skipped_with_a_message(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "--output", str(out), *TINY, "--max-steps", "4", "--save-every", "2").returncode == 0
    newest = out / "checkpoints" / "step_000004"
    with open(newest / "optimizer.pt", "r+b") as f:
        f.truncate(100)  # what a kill in the middle of a non-atomic write would leave
    run = run_cli("train", "--output", str(out), *TINY, "--max-steps", "4", "--save-every", "2")
    assert run.returncode == 0, run.stderr
    assert f"skipping incomplete or corrupt checkpoint {newest}" in run.stderr
    assert f"resuming from {out / 'checkpoints' / 'step_000002'} (step 2)" in run.stderr
    # named with --resume, it is refused, with the file that is short or missing (the run above
    # wrote step 4 again)
    with open(newest / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    listed = json.loads((newest / "trainer_state.json").read_text())["files"]["optimizer.pt"]
    size = listed["size"] if isinstance(listed, dict) else listed
    named = run_cli("train", "--output", str(tmp_path / "other"), *TINY, "--max-steps", "4", "--resume", str(newest))
    assert named.returncode == 4
    assert (f"error: the checkpoint is incomplete or malformed: optimizer.pt holds 100 bytes, trainer_state.json "
            f"lists {size:,} ({newest})") in named.stderr
    (newest / "optimizer.pt").unlink()
    named = run_cli("train", "--output", str(tmp_path / "other"), *TINY, "--max-steps", "4", "--resume", str(newest))
    assert "error: the checkpoint is incomplete or malformed: optimizer.pt is missing" in named.stderr


def test_keep_last_prunes_old_checkpoints(tmp_path):
    out = tmp_path / "run"
    run = run_cli("train", "--output", str(out), *TINY, "--max-steps", "5", "--save-every", "1", "--keep-last", "2")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004", "step_000005"]


def _limit_file_size():
    # any single file over 6 MB fails to write (EFBIG), like a disk that fills up mid-save:
    # the tiny model's weights (4.3 MB) fit, its AdamW state (8.5 MB) does not
    resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 1024 * 1024, resource.RLIM_INFINITY))


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "--output", str(out), *TINY, "--max-steps", "2", "--save-every", "2").returncode == 0
    run = subprocess.run(train_cmd(out, "--max-steps", "4", "--save-every", "2"), capture_output=True, text=True,
                         preexec_fn=_limit_file_size, timeout=180)
    assert run.returncode == 6, run.stderr
    assert last_line(run.stderr).startswith("error: the disk filled up (or a file size limit or quota was hit) while "
                                            "writing the checkpoint of step 4")
    assert "what was saved before is intact" in last_line(run.stderr) and "Traceback" not in run.stderr
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_000002"]  # nothing half-written left behind
    from ptbr.train.checkpoint import read_state

    assert read_state(out / "checkpoints" / "step_000002")["step"] == 2


# ---- NaN / inf ---------------------------------------------------------------------------------


def test_non_finite_steps_are_skipped_then_the_run_stops_with_a_diagnosis(tmp_path):
    out = tmp_path / "run"
    run = run_cli("train", "--output", str(out), *TINY, "--max-steps", "20", "--save-every", "1",
                  "--learning-rate", "1e9", "--warmup-steps", "0")
    assert run.returncode == 7
    line = last_line(run.stderr)
    assert line.startswith("error: loss or gradients not finite for 5 steps in a row (last: step 6, lr ")
    precision = json.loads((out / "run_config.json").read_text())["precision"]  # auto: bf16 or fp32 on CPU
    assert f"precision {precision}, batch " in line and "train.bin at token offsets [" in line
    assert run.stderr.count("skipped: loss nan") == 5
    # skipped steps never touch the weights: the checkpoints stay finite and loadable
    weights = load_file(str(out / "checkpoints" / "step_000001" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_checkpoint_states_load_without_unpickling_code(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "--output", str(out), *TINY, "--max-steps", "1").returncode == 0
    for name in ("optimizer.pt", "scaler.pt", "rng.pt"):
        torch.load(out / "checkpoints" / "step_000001" / name, weights_only=True)
    assert os.path.getsize(out / "checkpoints" / "step_000001" / "model.safetensors") > 4_000_000


def test_a_previous_run_is_moved_aside_across_file_systems(tmp_path, monkeypatch):
    """OUTPUT/previous on another file system (a link or a mount there): a rename across file
    systems fails (EXDEV), and --resume never (or a corrupt newest checkpoint) stopped with "cannot
    move the previous run's files aside". They are copied across, then removed."""
    import errno as errors

    from ptbr.runs.common import move_previous_run

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "model.safetensors").write_bytes(b"weights")
    (run / "metrics.jsonl").write_text("{}\n")
    real_rename = Path.rename

    def across(self, target):
        if self.name == "checkpoints":
            raise OSError(errors.EXDEV, "Invalid cross-device link")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", across)
    moved = move_previous_run(run)
    assert (moved / "checkpoints" / "step_000002" / "model.safetensors").read_bytes() == b"weights"
    assert (moved / "metrics.jsonl").is_file() and not (run / "checkpoints").exists()


def test_a_lock_taken_on_a_file_that_was_just_removed_is_no_lock(tmp_path, monkeypatch):
    """A run giving up on a new directory removes it (lock file and all) while holding its lock; a
    run that opened that lock file a moment before gets the lock of an unlinked file, and a third
    run would lock a new one beside it. The lock is checked to be the file at its path."""
    import fcntl

    import ptbr.lock as lock
    from ptbr.errors import OutputError

    real_flock = fcntl.flock
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def removed_meanwhile(fd, operation):
        real_flock(fd, operation)
        if operation & fcntl.LOCK_EX:
            (run_dir / lock.LOCK_FILE).unlink()

    monkeypatch.setattr(lock.fcntl, "flock", removed_meanwhile)
    with pytest.raises(OutputError, match="the output directory was removed as this run started"):
        lock.RunLock(run_dir).acquire()
    monkeypatch.setattr(lock.fcntl, "flock", real_flock)
    shutil_gone = tmp_path / "gone"
    with pytest.raises(OutputError, match="removed as this run started"):
        lock.RunLock(shutil_gone).acquire()  # its directory no longer exists at all
    held = lock.RunLock(run_dir).acquire()  # and with nothing in between, it locks
    held.release()
