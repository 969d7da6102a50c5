"""`ptbr monitor`: a finished run, a running one, one killed with SIGKILL, one that stalls and is
ended by the watchdog, one that diverged, one that crashed, and one copied from another machine,
each read without writing to the run directory or touching its lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptbr.cli import main
from ptbr.lock import LOCK_FILE
from ptbr.monitor import (
    STALL_FACTOR,
    STALL_FLOOR_S,
    STALL_LONGEST_FACTOR,
    Owner,
    assess,
    read_run,
    smoothed,
    stall_threshold,
)
from ptbr.train.metrics import read_metrics
from tests.conftest import REPO, run_cli, shown_size

TINY = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "4", "--device", "cpu"]


def train(output: Path, *extra: str) -> int:
    """`ptbr train` in-process (a few seconds for the tiny model)."""
    return main(["train", "--output", str(output), *TINY, *extra])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("monitor") / "run"
    assert train(out, "--max-steps", "8", "--eval-every", "4", "--eval-batches", "2", "--save-every", "4") == 0
    return out


def monitor(*args: str) -> subprocess.CompletedProcess:
    return run_cli("monitor", *map(str, args), timeout=60)


def field(output: str, name: str) -> str:
    """The text after `name` on the monitor's line for it."""
    [line] = [line for line in output.splitlines() if line.startswith(f"{name} ")]
    return line[len(name):].strip()


def snapshot(folder: Path) -> dict:
    """Every file and folder below `folder` with its size, modification time and inode."""
    found = {}
    for path in [folder, *folder.rglob("*")]:
        info = path.lstat()
        found[str(path.relative_to(folder))] = (info.st_size, info.st_mtime_ns, info.st_ino)
    return found


def wait_for(predicate, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def rows(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


# ---- a finished run --------------------------------------------------------------------------


def test_a_finished_run_is_shown_with_the_numbers_of_its_files(finished_run):
    before = snapshot(finished_run)
    shown = monitor(finished_run, "--once")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    metrics = rows(finished_run)
    config = json.loads((finished_run / "run_config.json").read_text())
    last = metrics[-1]
    assert text.splitlines()[0] == f"ptbr monitor  {finished_run}  (train: tiny, torch on cpu, {config['precision']})"
    assert field(text, "status") == "finished: 8 steps (training_summary.json)"
    assert field(text, "step") == "8 / 8 (100.0%)"
    assert field(text, "loss").startswith(f"{last['loss']:.4f}; smoothed "
                                          f"{smoothed([r['loss'] for r in metrics])[-1]:.4f}")
    vals = [(r["step"], r["val_loss"]) for r in metrics if r["val_loss"] is not None]
    assert [s for s, _ in vals] == [4, 8]
    best_step, best = min(vals, key=lambda v: v[1])
    import math

    assert field(text, "val_loss") == (f"{vals[-1][1]:.4f} at step 8, perplexity {math.exp(vals[-1][1]):.2f} "
                                       f"(best {best:.4f} at step {best_step})")
    assert field(text, "lr") == f"{last['lr']:.2e}"
    # each row's mem_bytes is the process's peak so far: the largest is the run's peak
    assert [r["mem_bytes"] for r in metrics] == sorted(r["mem_bytes"] for r in metrics)
    peak = max(r["mem_bytes"] for r in metrics)
    by_step = next(r["step"] for r in metrics if r["mem_bytes"] == peak)
    predicted = config["predicted_peak_bytes"]
    assert field(text, "memory") == (f"peak {shown_size(peak)}, reached by step {by_step}; predicted peak "
                                     f"{shown_size(predicted)} ({100 * peak / predicted:.0f}%)")
    assert field(text, "checkpoint").startswith("step_000008, written ")
    assert "warning" not in text and "ETA" not in text
    assert snapshot(finished_run) == before  # nothing written, nothing touched


def test_monitor_reads_without_torch_or_mlx(finished_run):
    script = textwrap.dedent(f"""
        import sys
        from ptbr.cli import main
        assert main(["monitor", {str(finished_run)!r}, "--once"]) == 0
        loaded = [m for m in ("torch", "mlx") if m in sys.modules]
        assert not loaded, loaded
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 0, run.stderr


def test_refreshing_stops_by_itself_once_the_run_has_ended(finished_run):
    started = time.monotonic()
    shown = monitor(finished_run, "--refresh", "0.2")
    assert shown.returncode == 0 and shown.stdout.count("ptbr monitor  ") == 1
    assert time.monotonic() - started < 30


def test_on_a_terminal_each_screen_is_redrawn_in_place(finished_run):
    import pty

    leader, follower = pty.openpty()
    try:
        run = subprocess.run([sys.executable, "-m", "ptbr", "monitor", str(finished_run), "--refresh", "0.2"],
                             stdout=follower, stderr=subprocess.PIPE, timeout=60, cwd=REPO)
        os.close(follower)
        screen = b""
        while chunk := _read(leader):
            screen += chunk
    finally:
        os.close(leader)
    assert run.returncode == 0, run.stderr
    assert screen.startswith(b"\x1b[H\x1b[2Jptbr monitor  ")  # cursor home, clear, then the screen


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the terminal closed: everything was read
        return b""


def test_a_run_still_building_its_model_is_starting(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    with open(copy / "train.log", "a") as log:
        log.write("2026-01-01 00:00:00 resuming from somewhere (step 8)\n"
                  "2026-01-01 00:00:01 model tiny: 1,066,112 parameters, vocab 2048, seq_len 32\n")
    # a live process (this one) took the lock after the metrics were last written
    (copy / LOCK_FILE).write_text(f"pid={os.getpid()}\nhost={socket.gethostname()}\n")
    status = assess(read_run(copy))
    assert status.state == "starting"
    assert status.headline == (f"starting (PID {os.getpid()} on {socket.gethostname()}): model tiny: 1,066,112 "
                               "parameters, vocab 2048, seq_len 32")


@pytest.mark.parametrize("args, problem", [
    (["--refresh", "0"], "--refresh must be a number of seconds > 0, got 0.0"),
    (["--stall-after", "nan"], "--stall-after must be a number of seconds > 0, got nan"),
])
def test_wrong_timings_are_refused(finished_run, capsys, args, problem):
    assert main(["monitor", str(finished_run), *args]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {problem}")


def test_a_folder_that_holds_no_run_is_refused(tmp_path, capsys):
    assert main(["monitor", str(tmp_path), "--once"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: not a ptbr run directory (no train.log, metrics.jsonl or run_config.json)")
    assert not list(tmp_path.iterdir())
    assert main(["monitor", str(tmp_path / "runs" / "ptbr"), "--once"]) == 2  # a run not started yet
    assert capsys.readouterr().err.strip() == (
        f"error: no such directory ({tmp_path / 'runs' / 'ptbr'}); fix: give the --output directory of a `ptbr "
        "train` or `ptbr finetune` run (by default runs/ptbr and runs/finetune; a run makes it within seconds of "
        "starting)")
    assert not list(tmp_path.iterdir())


def test_the_help_states_the_stall_rule_of_the_code():
    from ptbr.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["monitor"].format_help().split())
    assert (f"the largest of {STALL_FACTOR:g}x the median step time, {STALL_LONGEST_FACTOR:g}x the longest step "
            f"and {STALL_FLOOR_S:g} s") in text


# ---- a running run, then killed with SIGKILL -------------------------------------------------


def flock_holders(path: Path) -> set[int]:
    """PIDs holding an flock on `path`, from /proc/locks (Linux)."""
    inode = path.stat().st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "FLOCK" in parts and parts[-3].endswith(f":{inode}"):
            holders.add(int(parts[-4]))
    return holders


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads the kernel's lock table (Linux)")
def test_a_running_run_is_live_and_its_lock_untouched_then_dead_after_sigkill(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "ptbr", "train", "--output", str(out), *TINY,
                                "--max-steps", "5000", "--save-every", "3", "--keep-last", "2"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_for(lambda: len(rows(out)) >= 4 and (out / "checkpoints" / "step_000003").is_dir(),
                 what="four steps and a checkpoint")
        lock = out / LOCK_FILE
        lock_before = (lock.read_bytes(), lock.stat().st_mtime_ns, lock.stat().st_ino)
        assert lock_before[0] == f"pid={process.pid}\nhost={socket.gethostname()}\n".encode()
        assert flock_holders(lock) == {process.pid}
        done_before = len(rows(out))

        shown = monitor(out, "--once")
        done_after = len(rows(out))
        assert shown.returncode == 0, shown.stderr
        status = field(shown.stdout, "status")
        assert status.startswith(f"running (PID {process.pid} on {socket.gethostname()}), ")
        step, total = field(shown.stdout, "step").split(" (")[0].split(" / ")
        assert done_before <= int(step) <= done_after and total == "5000"
        assert "; ETA " in field(shown.stdout, "time")
        assert field(shown.stdout, "checkpoint").startswith("step_0000")
        # the monitor neither wrote the lock file nor took or disturbed the run's flock
        assert (lock.read_bytes(), lock.stat().st_mtime_ns, lock.stat().st_ino) == lock_before
        assert flock_holders(lock) == {process.pid}
        wait_for(lambda: len(rows(out)) > done_after + 2, what="the run to go on after the monitor")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()

    last = rows(out)[-1]["step"]
    shown = monitor(out, "--once")
    assert shown.returncode == 0, shown.stderr
    status = field(shown.stdout, "status")
    assert status.startswith(f"dead: the run's process (PID {process.pid} on {socket.gethostname()}) is gone without "
                             f"a final summary; last step {last} of 5000, written ")
    newest = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert f"warning: running the same command resumes from step_{newest:06d} (step {newest})" in shown.stdout


# ---- a run that stalls, then is ended by the hang watchdog --------------------------------

STALL_SCRIPT = textwrap.dedent("""
    import sys, time
    from ptbr.data import tokens
    original = tokens.PretrainBatches.cycle
    def stalled(self, step):
        if step == 4:
            time.sleep(600)  # a data source that stops answering (a dead network mount, say)
        return original(self, step)
    tokens.PretrainBatches.cycle = stalled
    from ptbr.cli import main
    raise SystemExit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_stalled_run_is_reported_stalled_then_dead_with_its_hang_report(tmp_path):
    out = tmp_path / "run"
    # 15 s: start-up on a busy 2-core machine must fit in it (the watchdog covers it too)
    process = subprocess.Popen([sys.executable, "-c", STALL_SCRIPT, "train", "--output", str(out), *TINY,
                                "--max-steps", "50", "--hang-timeout", "15"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_for(lambda: len(rows(out)) == 4, what="four steps")
        written = (out / "metrics.jsonl").stat().st_mtime
        wait_for(lambda: time.time() - max(written, (out / "train.log").stat().st_mtime) > 2.5,
                 what="2.5 s of silence")
        stalled = monitor(out, "--once", "--stall-after", "2")
        # the same run under the default threshold (at least 60 s): still running
        default = monitor(out, "--once")
        assert process.poll() is None, "the watchdog ended the run before the monitor looked"
    finally:
        assert process.wait(timeout=120) == 8  # the hang watchdog's exit

    status = field(stalled.stdout, "status")
    assert status.startswith(f"stalled (PID {process.pid} on {socket.gethostname()}): no progress for "), status
    assert status.endswith(", at step 4")
    assert "warning: stalled: no new metrics, log line or checkpoint file for " in stalled.stdout
    assert "(threshold 2 s; a step usually takes " in stalled.stdout
    assert field(default.stdout, "status").startswith(f"running (PID {process.pid} on ")
    assert "warning" not in default.stdout

    dead = monitor(out, "--once")
    assert field(dead.stdout, "status").startswith(f"dead: the run's process (PID {process.pid} on ")
    assert "last step 4 of 50" in field(dead.stdout, "status")
    assert "warning: train.log ends with: error: no progress for " in dead.stdout
    assert f"warning: see {out / 'hang_report.txt'}" in dead.stdout.splitlines()


# ---- runs that ended with an error ---------------------------------------------------------


def test_a_diverged_run_is_named_with_its_skipped_steps(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--max-steps", "20", "--learning-rate", "1e9", "--warmup-steps", "0") == 7
    error = capsys.readouterr().err.strip().splitlines()[-1]
    # the fifth non-finite step in a row stops the run before its row is written
    skipped = [r["step"] for r in rows(out) if r["loss"] is None]
    assert skipped == [2, 3, 4, 5] and rows(out)[-1]["step"] == 5
    ended = (out / "train.log").read_text().splitlines()[-1][:19]
    shown = monitor(out, "--once").stdout
    assert field(shown, "status") == f"diverged at {ended}: {error}"
    assert field(shown, "skipped") == "4 step(s) with non-finite loss: 2, 3, 4, 5"
    assert "warning: start over (--resume never) with a lower --learning-rate, or with --precision bf16 (or fp32) if it ran in fp16" in shown


def test_a_crashed_run_is_stopped_and_its_crash_report_named(tmp_path, capsys, monkeypatch):
    from ptbr.backends.torch.step import TorchStep

    real = TorchStep.train_step

    def fails_at_step_3(self, micro_batches, lr):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("injected by the test")
        return real(self, micro_batches, lr)

    monkeypatch.setattr(TorchStep, "train_step", fails_at_step_3)
    out = tmp_path / "run"
    assert train(out, "--max-steps", "6") == 1
    shown = monitor(out, "--once").stdout
    assert rows(out)[-1]["step"] == 2
    assert field(shown, "status").startswith("stopped at 20")
    assert ": error: unexpected RuntimeError: injected by the test (details in crash_report.txt" in shown
    assert f"warning: see {out / 'crash_report.txt'}" in shown.splitlines()
    assert "warning: no checkpoint was saved: running the same command starts the run again" in shown.splitlines()


# ---- a run directory from elsewhere, and a lock whose PID was reused ------------------------


def test_a_run_copied_from_another_machine_cannot_be_checked(finished_run, tmp_path):
    copy = tmp_path / "from-kaggle"
    shutil.copytree(finished_run, copy)
    (copy / "training_summary.json").unlink()
    (copy / LOCK_FILE).write_text("pid=4242\nhost=kaggle-5c1d\n")
    old = time.time() - 3600  # the copy's files keep their times: the last row is an hour old
    for path in (copy / "metrics.jsonl", copy / "train.log"):
        os.utime(path, (old, old))
    shown = monitor(copy, "--once").stdout
    assert field(shown, "status").startswith("unknown: cannot be checked from this machine, the lock names PID 4242 "
                                             "on kaggle-5c1d")
    assert ("warning: no new metrics for 60 min, at step 8: if the run still lives on kaggle-5c1d, it looks stalled; "
            "if not, it ended without a final summary") in shown.splitlines()


def test_a_pid_reused_by_a_later_process_is_not_the_run(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    (copy / "training_summary.json").unlink()
    lock = copy / LOCK_FILE
    # this test's own PID, in a lock taken a day before this process started
    lock.write_text(f"pid={os.getpid()}\nhost={socket.gethostname()}\n")
    day_before = time.time() - 86400
    os.utime(lock, (day_before, day_before))
    assert Owner(os.getpid(), socket.gethostname(), day_before).alive() is False
    assert Owner(os.getpid(), socket.gethostname(), time.time()).alive() is True
    assert assess(read_run(copy)).state == "dead"


def test_every_rank_s_hang_report_is_named_and_an_older_one_is_told_apart(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    (copy / "hang_report.rank1.txt").write_text("ptbr hang report: rank 1: ...\n")
    (copy / "crash_report.txt").write_text("ptbr crash report\n")
    earlier = (copy / "metrics.jsonl").stat().st_mtime - 60  # written before the run's last step
    os.utime(copy / "crash_report.txt", (earlier, earlier))
    warnings = assess(read_run(copy)).warnings
    assert warnings == [f"see {copy / 'hang_report.rank1.txt'}",
                        f"{copy / 'crash_report.txt'} predates the last step: the run went on after it"]


# ---- the numbers behind the warnings ----------------------------------------------------------


def test_stall_threshold_is_the_largest_of_its_three_terms():
    def with_times(*seconds):
        elapsed, out = 0.0, [{"step": 1, "elapsed_s": 0.0}]
        for step, s in enumerate(seconds, 2):
            elapsed += s
            out.append({"step": step, "elapsed_s": elapsed})
        return out

    assert stall_threshold([]) == STALL_FLOOR_S == 60
    assert stall_threshold(with_times(1, 1, 1, 1)) == 60  # fast steps: the floor
    assert stall_threshold(with_times(20, 20, 30, 20)) == 100  # 5 x the median
    assert stall_threshold(with_times(1, 1, 1, 45)) == 90  # 2 x the longest (an evaluation step)
    # a gap in the steps (a resume that dropped rows) is not a step time
    assert stall_threshold([{"step": 1, "elapsed_s": 0.0}, {"step": 5, "elapsed_s": 500.0}]) == 60


def test_the_smoothed_loss_is_a_debiased_moving_average():
    assert smoothed([4.0]) == [4.0]
    first, second = smoothed([1.0, 2.0])
    assert first == 1.0 and second == pytest.approx((0.9 * 0.1 * 1.0 + 0.1 * 2.0) / (1 - 0.81))


def test_sizes_switch_from_mib_to_gib_at_one_gib():
    from ptbr.monitor import format_bytes

    assert format_bytes(558_787_584) == "532.9 MiB"
    assert format_bytes(1024**3 - 1) == "1024.0 MiB"
    assert format_bytes(1024**3) == "1.00 GiB"
    assert format_bytes(1_082_126_336) == "1.01 GiB"


def test_a_checkpoint_being_written_is_named_by_what_ptbr_writes_aside(tmp_path):
    """ptbr writes a checkpoint (or final/, adapters/) under `.tmp-NAME.ptbr-PID` first: monitor
    names it; a hidden folder of the user's that merely starts with .tmp- is not a write."""
    from ptbr.files import aside
    from ptbr.monitor import _in_progress

    (tmp_path / "checkpoints" / ".tmp-notes-1").mkdir(parents=True)
    assert _in_progress(tmp_path) == (None, None)
    writing = aside(tmp_path / "checkpoints" / "step_000004", "tmp")
    writing.mkdir()
    (writing / "model.safetensors").write_bytes(b"x")
    what, when = _in_progress(tmp_path)
    assert what == "step_000004" and when == pytest.approx((writing / "model.safetensors").stat().st_mtime)
