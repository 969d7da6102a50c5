"""Data-parallel training on CPU with gloo, through the real launchers: `torchrun --standalone
--nproc-per-node 2 -m ptbr ...` and ptbr's own `--num-processes 2`. Two processes with batch 2 train
the model one process trains with batch 4 (pretraining, LoRA fine-tuning, FSDP); a 2-process run
resumes in 1 process; SIGTERM to the launcher stops both ranks with one checkpoint.

Pretraining runs at learning rate 1e-4 here: ranks sum their gradients in another order than one
process does, and AdamW turns that float noise into weight differences that scale with the learning
rate and depend on the CPU's kernels (after three steps: 2.3e-5 at 1e-3 on an Intel Xeon with AMX,
about 5e-6 on an AMD EPYC; 2.3e-6 at 1e-4). The 1e-5 bound still catches a wrong gradient:
three steps on half the tokens move the weights 5e-4 away at 1e-4.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tests.test_finetune as finetune_tests
from tests.conftest import REPO

toy = finetune_tests.toy
pytestmark = pytest.mark.slow
TINY = ["--model-size", "tiny", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "2", "--device", "cpu",
        "--learning-rate", "1e-4", "--precision", "fp32"]  # equal to 1e-5: an fp32 claim (bf16 rounds per shape)


def torchrun(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "ptbr", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def with_startup_code(tmp_path: Path, code: str, env: dict | None = None) -> dict:
    """`env` (os.environ by default) with tmp_path/hooks on PYTHONPATH, whose sitecustomize module
    runs `code` at the start of every Python process (added to what earlier calls put there)."""
    import os

    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    site = hooks / "sitecustomize.py"
    site.write_text((site.read_text() if site.exists() else "") + code)
    env = dict(env or os.environ)
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(paths if str(hooks) in paths else filter(None, [str(hooks), *paths]))
    return env


def chunks_of(tmp_path: Path, tokens: int, vocab: int) -> dict:
    """An environment in which every process's chunked loss takes chunks of `tokens` tokens."""
    return with_startup_code(tmp_path, f"import ptbr.memory\nptbr.memory.CHUNK_BYTES = 4 * {vocab} * {tokens}\n"
                                       "ptbr.memory.CHUNK_TOKENS_PER_HIDDEN = 0\n")


THREADS_AT_EXIT = """
import atexit, os


def _record_threads_at_exit():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            pass  # a thread that ended meanwhile
    with open(os.path.join(FOLDER, "rank" + os.environ.get("RANK", "-") + ".txt"), "w") as out:
        out.write("\\n".join(sorted(names)))


atexit.register(_record_threads_at_exit)
"""


def recording_threads_at_exit(tmp_path: Path, env: dict | None = None) -> dict:
    """An environment (added to `env`, e.g. chunks_of's) in which every process writes the names of
    its threads as it exits (Linux's /proc/self/task) to tmp_path/threads/rankN.txt."""
    folder = tmp_path / "threads"
    folder.mkdir()
    return with_startup_code(tmp_path, f"\nFOLDER = {str(folder)!r}\n" + THREADS_AT_EXIT, env)


def gloo_threads_at_exit(tmp_path: Path) -> dict[int, list[str]]:
    """Each rank's gloo threads alive as it exited (none where the process group was destroyed)."""
    recorded = {int(f.stem[4:]): f.read_text().split("\n") for f in (tmp_path / "threads").glob("rank[0-9]*.txt")}
    assert sorted(recorded) == [0, 1], recorded
    return {rank: [name for name in names if "gloo" in name] for rank, names in recorded.items()}


def ptbr(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ptbr", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """one_process(COMMAND, *ARGS): the output directory of `ptbr COMMAND --output DIR *ARGS` in one
    process, run once for every test of this module that compares against the same run."""
    made: dict[tuple[str, ...], Path] = {}

    def run(command: str, *args: str) -> Path:
        if (command, *args) not in made:
            output = tmp_path_factory.mktemp("one-process") / "run"
            done = ptbr(command, "--output", str(output), *args)
            assert done.returncode == 0, done.stderr
            made[(command, *args)] = output
        return made[(command, *args)]

    return run


def max_difference(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_the_model_one_process_trains_with_twice_the_batch(tmp_path):
    """torchrun, 2 x batch 2 x grad_accum 2 (the ranks' last micro-batches synchronise), against
    1 x batch 4 x grad_accum 2: the same windows, the same losses, the same weights."""
    common = [*TINY, "--grad-accum", "2", "--max-steps", "3", "--save-every", "3"]
    two = torchrun("train", "--output", str(tmp_path / "two"), "--batch-size", "2", *common)
    assert two.returncode == 0, two.stderr[-8000:]  # a native abort: every thread's Python stack (faulthandler)
    one = ptbr("train", "--output", str(tmp_path / "one"), "--batch-size", "4", *common)
    assert one.returncode == 0, one.stderr
    assert max_difference(tmp_path / "two" / "final" / "model.safetensors",
                          tmp_path / "one" / "final" / "model.safetensors") < 1e-5
    two_rows, one_rows = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [r["loss"] for r in two_rows] == pytest.approx([r["loss"] for r in one_rows], rel=1e-6)
    assert two_rows[-1]["val_loss"] == pytest.approx(one_rows[-1]["val_loss"], rel=1e-6)
    config = json.loads((tmp_path / "two" / "run_config.json").read_text())
    assert config["processes"] == 2 and config["effective_batch"] == 8
    # one rank wrote the run's files: one set of metrics rows, one checkpoint
    assert [r["step"] for r in two_rows] == [1, 2, 3]
    assert "data parallel over 2 processes: batch 2 x grad_accum 2 x 2 processes = 8 per step" in two.stderr


@pytest.mark.parametrize("chunked", [False, True])
def test_lora_fine_tuning_in_two_processes_equals_one(toy, tmp_path, chunked, one_process):
    """40 examples, 2 x batch 3 against 1 x batch 6: the epoch's last global micro-batch has 4
    examples (3 on rank 0, 1 on rank 1); dropout 0 so that both runs draw nothing at random.
    chunked: the two ranks' loss in chunks of 10 tokens (the frozen output layer's input taken
    inside DDP's forward pass); else their whole logits (--no-chunked-loss); against one process
    with the whole logits."""
    common = ["--base", str(toy.base), "--data", str(toy.data), "--quant", "none", "--lora-r", "8",
              "--lora-dropout", "0", "--max-steps", "7", "--eval-every", "7", "--learning-rate", "1e-3",
              "--device", "cpu"]
    vocab = json.loads((toy.base / "config.json").read_text())["vocab_size"]
    two = torchrun("finetune", "--output", str(tmp_path / "two"), "--batch-size", "3", *common,
                   *([] if chunked else ["--no-chunked-loss"]),
                   env=recording_threads_at_exit(tmp_path, chunks_of(tmp_path, 10, vocab) if chunked else None))
    assert two.returncode == 0, two.stderr[-8000:]  # a native abort: every thread's Python stack (faulthandler)
    assert gloo_threads_at_exit(tmp_path) == {0: [], 1: []}  # see test_accelerate_launch_is_a_launcher_too
    assert ("chunked loss: 10 tokens per chunk" in two.stderr) == chunked
    assert ("chunked loss:" in two.stderr) == chunked
    one = one_process("finetune", "--batch-size", "6", *common, "--no-chunked-loss")
    assert max_difference(tmp_path / "two" / "adapters" / "adapter_model.safetensors",
                          one / "adapters" / "adapter_model.safetensors") < 1e-5
    assert [r["loss"] for r in metrics(tmp_path / "two")] == pytest.approx([r["loss"] for r in metrics(one)], rel=1e-5)


def test_a_two_process_checkpoint_resumes_in_one_process(tmp_path, one_process):
    common = [*TINY, "--save-every", "2"]
    straight = one_process("train", "--batch-size", "4", *TINY, "--max-steps", "4", "--save-every", "2")
    run = tmp_path / "run"
    first = ptbr("train", "--output", str(run), "--batch-size", "2", "--num-processes", "2", "--max-steps", "4",
                 *common)
    assert first.returncode == 0, first.stderr[-3000:]
    for later in ("step_000004",):
        import shutil

        shutil.rmtree(run / "checkpoints" / later)
    # the same global batch of 4, now as 1 process x batch 4
    resumed = ptbr("train", "--output", str(run), "--batch-size", "4", "--max-steps", "4", *common)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "step_000002" in resumed.stderr
    assert max_difference(run / "final" / "model.safetensors", straight / "final" / "model.safetensors") < 1e-5


def test_fsdp_shards_and_gives_the_same_model(tmp_path, one_process):
    common = [*TINY, "--max-steps", "4", "--save-every", "2"]
    fsdp = ptbr("train", "--output", str(tmp_path / "fsdp"), "--batch-size", "2", "--num-processes", "2", "--fsdp",
                *common, env=recording_threads_at_exit(tmp_path))
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert gloo_threads_at_exit(tmp_path) == {0: [], 1: []}  # see test_accelerate_launch_is_a_launcher_too
    one = one_process("train", "--batch-size", "4", *common)
    assert max_difference(tmp_path / "fsdp" / "final" / "model.safetensors", one / "final" / "model.safetensors") < 1e-5
    # its checkpoints hold the whole state: a single process resumes from one
    resumed = ptbr("train", "--output", str(tmp_path / "single"), "--batch-size", "4", *common, "--resume",
                   str(tmp_path / "fsdp" / "checkpoints" / "step_000002"))
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(tmp_path / "single" / "final" / "model.safetensors", one / "final" / "model.safetensors") < 1e-5
    # and FSDP resumes from its own: the chunked loss's start-up check (one forward pass) left the
    # root unit gathered, and loading the checkpoint failed (exit 4)
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "fsdp", again)
    shutil.rmtree(again / "checkpoints" / "step_000004")
    shutil.rmtree(again / "final")
    fsdp_again = ["train", "--output", str(again), "--batch-size", "2", "--num-processes", "2", "--fsdp", *common,
                  "--hang-timeout", "120"]
    resumed = ptbr(*fsdp_again)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max_difference(again / "final" / "model.safetensors", one / "final" / "model.safetensors") < 1e-5
    # a run resumed at --max-steps trains no step and writes final/ again: the main rank alone asked
    # the sharded model for its weights (a collective) and waited forever (the watchdog: exit 8)
    shutil.rmtree(again / "final")
    rewritten = ptbr(*fsdp_again)
    assert rewritten.returncode == 0, rewritten.stderr[-3000:]
    assert max_difference(again / "final" / "model.safetensors", one / "final" / "model.safetensors") < 1e-5


def test_the_chunked_loss_under_ddp_and_fsdp_gives_the_same_model(tmp_path):
    """The chunked loss takes the output layer's input and weight inside DDP's and FSDP's forward
    pass (FSDP's gathered weight): 2 ranks with chunks of 10 tokens (a sitecustomize module sets
    the chunk size in every process) train the model that one process trains with the whole
    logits."""
    chunked = chunks_of(tmp_path, 10, 2048)
    common = [*TINY, "--max-steps", "3", "--save-every", "3"]
    whole = ptbr("train", "--output", str(tmp_path / "whole"), "--batch-size", "4", "--no-chunked-loss", *common)
    assert whole.returncode == 0, whole.stderr
    for name, flags in (("ddp", []), ("fsdp", ["--fsdp"])):
        run = ptbr("train", "--output", str(tmp_path / name), "--batch-size", "2", "--num-processes", "2", *flags,
                   *common, env=chunked)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "chunked loss: 10 tokens per chunk at vocabulary 2,048; micro-batches of 64 tokens are chunked" \
            in run.stderr
        assert max_difference(tmp_path / name / "final" / "model.safetensors",
                              tmp_path / "whole" / "final" / "model.safetensors") < 1e-5
        losses = [r["loss"] for r in metrics(tmp_path / name)]
        assert losses == pytest.approx([r["loss"] for r in metrics(tmp_path / "whole")], rel=1e-6)


def test_sigterm_to_the_launcher_stops_every_rank_with_one_checkpoint(tmp_path):
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "ptbr", "train", "--output", str(run), "--batch-size", "2",
                                 "--num-processes", "2", *TINY, "--max-steps", "100000", "--save-every", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env=recording_threads_at_exit(tmp_path))
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, err[-8000:]
    assert "death signal" not in err  # torch's launcher's own warning (its loggers keep a level of their own)
    assert gloo_threads_at_exit(tmp_path) == {0: [], 1: []}  # see test_accelerate_launch_is_a_launcher_too
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert len(checkpoints) == 1  # both ranks stopped at the same step boundary: one checkpoint
    step = json.loads((checkpoints[0] / "trainer_state.json").read_text())["step"]
    assert f"stopped by SIGTERM at step {step}" in (run / "train.log").read_text()
    # and the run goes on from there
    again = ptbr("train", "--output", str(run), "--batch-size", "2", "--num-processes", "2", *TINY,
                 "--max-steps", str(step + 1), "--save-every", "0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {checkpoints[0]}" in again.stderr


def test_sigterm_to_one_rank_stops_the_run_with_130_too(tmp_path):
    """A stop signal to one worker (a cluster's scheduler, or `kill` on the wrong PID): every rank
    saves the checkpoint and stops, and the run ends with 130. The launcher then stops the rank that
    is still exiting, which may die of that SIGTERM (-15): that is no failure either (it made the
    run's code 1, "a bug in ptbr")."""
    import psutil

    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "ptbr", "train", "--output", str(run), "--batch-size", "2",
                                 "--num-processes", "2", *TINY, "--max-steps", "100000", "--save-every", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    (rank1,) = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    # the launcher's grace between passing a signal on and killing (torch's 30 s: less than a big save)
    assert rank1.environ()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"
    rank1.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, err[-8000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped by a stop signal to another rank at step ")
    assert len(list((run / "checkpoints").iterdir())) == 1


def test_missing_data_is_refused_before_any_worker_starts(tmp_path):
    """Each worker imported torch and built its backend before finding that --data is not there:
    the same line, seconds later, and a directory made and removed."""
    started = time.monotonic()
    bad = ptbr("train", "--output", str(tmp_path / "run"), "--num-processes", "2", "--data", str(tmp_path / "nope"),
               *TINY)
    assert bad.returncode == 3 and bad.stderr.strip().splitlines()[-1].startswith("error: data directory not found")
    assert "starting 2 data-parallel processes" not in bad.stderr and not (tmp_path / "run").exists()
    assert time.monotonic() - started < 60
    tuned = ptbr("finetune", "--base", str(tmp_path), "--data", str(tmp_path / "nope.jsonl"), "--output",
                 str(tmp_path / "ft"), "--num-processes", "2", "--device", "cpu")
    assert tuned.returncode == 3 and "error: training data not found" in tuned.stderr
    assert "starting 2" not in tuned.stderr
    (tmp_path / "data").mkdir()  # --output the directory of --data
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "oi"}\n')
    inside = ptbr("finetune", "--base", str(tmp_path), "--data", str(tmp_path / "data"), "--output",
                  str(tmp_path / "data"), "--num-processes", "2", "--device", "cpu")
    assert inside.returncode == 6 and "--output is the directory of --data" in inside.stderr
    assert "starting 2" not in inside.stderr


def test_a_failing_rank_s_exit_code_is_the_run_s(tmp_path):
    """A failure found inside the workers (a token id beyond the vocabulary, at the first batch):
    the run's exit code is the rank's."""
    from ptbr.data import SAMPLE_DIR

    data = tmp_path / "data"
    shutil.copytree(SAMPLE_DIR, data)
    tokens = np.fromfile(data / "train.bin", dtype="<u2")
    tokens[::7] = 65000  # wherever a window lands
    tokens.tofile(data / "train.bin")
    bad = ptbr("train", "--output", str(tmp_path / "run"), "--num-processes", "2", "--data", str(data), *TINY)
    assert bad.returncode == 3, bad.stderr[-3000:]
    assert "token id 65000 >= vocab size" in bad.stderr.strip().splitlines()[-1]
    assert "starting 2 data-parallel processes" in bad.stderr and "Traceback" not in bad.stderr
    # the --output it made holds no run (its lock, log, settings and the workers' logs were left behind)
    assert not (tmp_path / "run").exists()
    mine = tmp_path / "mine"  # one that was there before keeps what it held, the error's log included
    mine.mkdir()
    assert ptbr("train", "--output", str(mine), "--num-processes", "2", "--data", str(data), *TINY).returncode == 3
    assert "token id 65000 >= vocab size" in (mine / "train.log").read_text()


def test_a_failed_launch_removes_only_a_directory_no_run_holds_and_keeps_a_crash_s_logs(tmp_path):
    """The launcher removes the --output it made after its workers failed at start-up, as one
    process does; not while another run holds the lock (one started into the same new --output at
    the same moment, which won it: the directory is that run's), and not after a crash or a killed
    rank (exit 1), where the workers' logs are what says why."""
    from ptbr.lock import RunLock
    from ptbr.runs.common import remove_a_launch_that_never_started

    def made() -> Path:
        run = tmp_path / "run"
        (run / "workers" / "launch_1" / "attempt_0" / "1").mkdir(parents=True)
        (run / "train.log").write_text("error: data directory not found\n")
        return run

    run = made()
    with RunLock(run):  # another launch's rank 0, loading its model
        remove_a_launch_that_never_started(run, 6)
    assert (run / "train.log").is_file()
    remove_a_launch_that_never_started(run, 1)
    assert (run / "workers").is_dir()
    remove_a_launch_that_never_started(run, 3)
    assert not run.exists()
    run = made()
    (run / "run_config.json").write_text("{}")  # written before the first step: the run had not trained
    (run / "metrics.jsonl").write_text("")
    remove_a_launch_that_never_started(run, 3)
    assert not run.exists()
    run = made()
    (run / "run_config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # the run had trained a step: kept
    remove_a_launch_that_never_started(run, 130)
    assert (run / "run_config.json").is_file()
    # the parents the launch made on the way go with it, and only those
    deep = tmp_path / "new" / "a" / "run"
    (deep / "workers").mkdir(parents=True)
    remove_a_launch_that_never_started(deep, 3, made=tmp_path / "new")
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()


def test_more_processes_than_cores_is_a_warning(tmp_path):
    import os

    cores = os.cpu_count() or 1
    run = ptbr("train", "--output", str(tmp_path / "run"), "--num-processes", str(cores + 1), "--data",
               str(tmp_path / "nope"), *TINY)
    assert run.returncode == 3
    assert f"warning: {cores + 1} processes on {cores} CPU cores: each rank gets a fraction of a core" in run.stderr


def test_num_processes_auto_on_a_machine_without_gpus_runs_one(tmp_path):
    run = ptbr("train", "--output", str(tmp_path / "run"), "--num-processes", "auto", "--batch-size", "2", *TINY,
               "--max-steps", "1")
    assert run.returncode == 0, run.stderr
    assert "data parallel" not in run.stderr
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["processes"] == 1
    assert torch.cuda.device_count() == 0 or pytest.skip("a GPU machine: auto starts one process per GPU")


STALL_ON_RANK_1 = """
import os, sys, time
from ptbr.data import tokens
original = tokens.PretrainBatches.cycle
def stalled(self, step):
    if step == 2 and os.environ["RANK"] == "1":
        time.sleep(600)  # rank 1's data source stops answering; rank 0 waits for it in a collective
    return original(self, step)
tokens.PretrainBatches.cycle = stalled
from ptbr.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_the_watchdog_names_the_rank_and_step_of_a_stuck_run(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALL_ON_RANK_1)
    run = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), "train", "--output", str(run), "--batch-size", "2", *TINY,
                             "--max-steps", "4", "--hang-timeout", "15"], capture_output=True, text=True,
                            timeout=240, cwd=REPO)
    assert result.returncode != 0 and time.monotonic() - started < 200
    stuck = (run / "hang_report.rank1.txt").read_text()
    assert "rank 1: no progress for" in stuck and "before the first step" not in stuck and " in stalled" in stuck
    waiting = (run / "hang_report.txt").read_text()
    assert "while training after step 2" in waiting  # rank 0 finished step 2 and waits on step 3's collective
    assert "rank 1: no progress for" in result.stderr or "rank 1" in result.stderr


def test_accelerate_launch_is_a_launcher_too(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m ptbr ...` (torchrun underneath) on CPU.

    Every rank exits with its process group destroyed: no gloo thread left. Before, a module that
    takes the default group as a default argument (imported by transformers after the group
    existed) and the DDP wrapper's reference cycle kept it alive, and its threads raced the exit:
    in a few CI runs rank 1 aborted after a finished run ("terminate called without an active
    exception"), and the launch failed."""
    common = [*TINY, "--max-steps", "2", "--save-every", "2"]
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "-m", "ptbr", "train", "--output", str(tmp_path / "two"), "--batch-size", "2", *common],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=recording_threads_at_exit(tmp_path))
    assert two.returncode == 0, two.stderr[-8000:]  # a native abort: every thread's Python stack (faulthandler)
    assert gloo_threads_at_exit(tmp_path) == {0: [], 1: []}
    assert json.loads((tmp_path / "two" / "run_config.json").read_text())["processes"] == 2
    one = ptbr("train", "--output", str(tmp_path / "one"), "--batch-size", "4", *common)
    assert one.returncode == 0, one.stderr
    assert [r["loss"] for r in metrics(tmp_path / "two")] == pytest.approx(
        [r["loss"] for r in metrics(tmp_path / "one")], rel=1e-6)


def test_preflight_s_load_test_under_a_launcher_closes_the_group_it_joined(toy, tmp_path):
    """`ptbr preflight --load-test` under torchrun loads the base through the backend, which joins
    the launcher's process group (every rank runs it); the check closes that group again, so no
    gloo thread is left to race the process's exit (where it could abort a successful run)."""
    two = torchrun("preflight", "--mode", "finetune", "--base", str(toy.base), "--data", str(toy.data), "--quant",
                   "none", "--device", "cpu", "--load-test", "--output", str(tmp_path / "plan"),
                   env=recording_threads_at_exit(tmp_path))
    assert two.returncode == 0, two.stdout[-4000:] + two.stderr[-4000:]
    checks = json.loads((tmp_path / "plan" / "preflight_report.json").read_text())["checks"]
    assert [c["status"] for c in checks if c["name"] == "model.load_test"] == ["pass"]
    assert gloo_threads_at_exit(tmp_path) == {0: [], 1: []}
    assert two.stdout.count("preflight (finetune): ") == 1  # rank 0's report; rank 1 checks, and passed


def start_a_long_launch(run: Path, env: dict | None = None) -> subprocess.Popen:
    """`ptbr train --num-processes 2` of endless tiny steps, returned once it has trained three."""
    launcher = subprocess.Popen([sys.executable, "-m", "ptbr", "train", "--output", str(run), "--batch-size", "2",
                                 "--num-processes", "2", *TINY, "--max-steps", "100000", "--save-every", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    wait_for_steps(run, 3, launcher)
    return launcher


def wait_for_steps(run: Path, steps: int, launcher) -> None:
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < steps:
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)


def end_the_launch(launcher) -> None:
    """A test that failed leaves no worker behind."""
    import psutil

    for process in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)]:
        process.kill()


def rank_process(launcher, rank: int):
    import psutil

    (process,) = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                  if p.environ().get("RANK") == str(rank)]
    return process


def test_a_rank_killed_mid_run_is_named_as_the_cause_not_taken_for_a_crash(tmp_path):
    """Rank 1 killed by SIGKILL (as the out-of-memory killer does): rank 0's collective then fails
    with gloo's "Connection reset by peer", which was "unexpected RuntimeError ... a bug in ptbr"
    with a crash report, and the last line said rank 1 stopped "with exit code -9" pointing to its
    empty log. Now rank 0 just stops, and the last line, also at the end of train.log (what `ptbr
    monitor` shows), names the killed rank and what a SIGKILL usually means."""
    run = tmp_path / "run"
    launcher = start_a_long_launch(run)
    try:
        rank_process(launcher, 1).kill()
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            end_the_launch(launcher)
    assert launcher.returncode == 137, err[-8000:]  # as a shell says of a process the kernel killed
    (log,) = (run / "workers").glob("*/attempt_0/1/stderr.log")
    line = (f"error: rank 1 of 2 was killed by SIGKILL (often the out-of-memory killer: `dmesg` or `journalctl -k` "
            f"says so) ({log}); fix: if memory ran out, lower --batch-size (raising --grad-accum) or ask `ptbr "
            "preflight` for a config that fits; run the same command again to resume from the last checkpoint")
    assert err.strip().splitlines()[-1] == line
    assert "bug in ptbr" not in err and "Traceback" not in err and not (run / "crash_report.txt").exists()
    log = (run / "train.log").read_text()
    assert log.splitlines()[-1].endswith(" " + line) and "bug in ptbr" not in log, log[-3000:]


FAIL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    from ptbr.data import tokens
    from ptbr.errors import DataError
    original = tokens.PretrainBatches.cycle
    def failing(self, step):
        if step == 3:
            raise DataError("a window past the end of the file", "train.bin", "prepare the data again")
        return original(self, step)
    tokens.PretrainBatches.cycle = failing
"""


def test_a_rank_s_own_error_is_the_run_s_last_line_and_ends_its_log(tmp_path):
    """Rank 1 fails with a documented error at step 3: the run's code and last line are its own,
    and rank 0, whose collective failed as rank 1 went away, says only that it stopped (it printed
    "a bug in ptbr", wrote a crash report, and its gloo error was what train.log, and so `ptbr
    monitor`, gave as the cause)."""
    run = tmp_path / "run"
    failed = ptbr("train", "--output", str(run), "--batch-size", "2", "--num-processes", "2", *TINY, "--max-steps",
                  "6", "--save-every", "2", env=with_startup_code(tmp_path, FAIL_ON_RANK_1))
    assert failed.returncode == 3, failed.stderr[-8000:]
    line = "error: rank 1 of 2: a window past the end of the file (train.bin); fix: prepare the data again"
    assert failed.stderr.strip().splitlines()[-1] == line
    assert "bug in ptbr" not in failed.stderr and "Traceback" not in failed.stderr
    assert not (run / "crash_report.txt").exists()
    log = (run / "train.log").read_text()
    assert log.splitlines()[-1].endswith(" " + line) and "bug in ptbr" not in log, log[-3000:]
    status = ptbr("monitor", str(run), "--once").stdout
    assert f": {line}" in next(row for row in status.splitlines() if row.startswith("status")), status


def test_the_launcher_s_line_names_the_rank_whose_error_ended_the_run_and_so_does_its_crash_report(tmp_path, capsys):
    """Rank 1 crashed: the launcher's last line, and so the end of train.log, `ptbr monitor` and
    report.md, was that rank's own line, `error: unexpected RuntimeError: ... (details in
    .../crash_report.txt)`, which named no rank (rank 0's line said the launcher's would), nor did the
    crash report it wrote. A unit test of the launcher's last step, after torch's launcher returned."""
    from types import SimpleNamespace

    from ptbr.backends.torch.distributed import _say_why_a_rank_failed
    from ptbr.monitor import assess, read_run

    run = tmp_path / "run"
    log = run / "workers" / "launch_1" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    crash = (f"error: unexpected RuntimeError: injected crash (details in {run / 'crash_report.txt'}); fix: this is "
             "a bug in ptbr, please report it with that file")
    log.write_text(f"step 5/10 | loss 7.2663\n{crash}\n")
    (run / "crash_report.txt").write_text("ptbr crash report, 2026-11-28T00:19:02+00:00\n\nTraceback ...\n")
    (run / "train.log").write_text("2026-11-28 00:19:01 step 5/10 | loss 7.2663\n")
    failures = {0: SimpleNamespace(exitcode=130, timestamp=2), 1: SimpleNamespace(exitcode=1, timestamp=1)}
    assert _say_why_a_rank_failed(failures, 2, run / "workers", "launch") == 1
    line = (f"error: rank 1 of 2: unexpected RuntimeError: injected crash (details in {run / 'crash_report.txt'}); "
            "fix: this is a bug in ptbr, please report it with that file")
    assert capsys.readouterr().err.strip().splitlines()[-1] == line
    assert (run / "train.log").read_text().splitlines()[-1].endswith(" " + line)
    assert assess(read_run(run)).headline.endswith(f": {line}")
    assert (run / "crash_report.txt").read_text() == ("ptbr crash report of rank 1 of 2, 2026-11-28T00:19:02+00:00\n"
                                                      "\nTraceback ...\n")


def test_a_launch_on_an_output_in_use_is_refused_before_any_worker_starts(tmp_path):
    """Both workers started, and only then was rank 0 refused: a workers/ folder left in the other
    run's directory."""
    import os
    import socket

    from ptbr.lock import RunLock

    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):  # another run
        refused = ptbr("train", "--output", str(run), "--batch-size", "2", "--num-processes", "2", *TINY)
    assert refused.returncode == 6, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: another ptbr run (PID {os.getpid()} on {socket.gethostname()}) is using this output directory "
        f"({run}); fix: wait for it to finish, stop it, or choose another --output")
    assert "starting 2 data-parallel processes" not in refused.stderr and not (run / "workers").exists()


SLOW_SAVES = """
import time
import ptbr.train.loop as loop
real_save = loop.save_checkpoint
def slow_save(*args, **kwargs):
    time.sleep(120)  # a checkpoint that takes long to write
    return real_save(*args, **kwargs)
loop.save_checkpoint = slow_save
"""


def test_a_second_ctrl_c_to_the_launcher_stops_every_rank_at_once(tmp_path):
    """The launcher passed a second SIGINT on as SIGTERM, which the ranks took for a first signal of
    another kind: they finished the checkpoint (up to the launcher's 600 s) and the last line said
    "stopped by SIGTERM". Now the second Ctrl-C reaches them as one, and they stop at once, as one
    process does."""
    run = tmp_path / "run"
    launcher = start_a_long_launch(run, with_startup_code(tmp_path, SLOW_SAVES))
    try:
        launcher.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while "SIGINT received" not in (run / "train.log").read_text():
            assert time.monotonic() < deadline, "the first Ctrl-C did not arrive"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            end_the_launch(launcher)
    assert launcher.returncode == 130 and time.monotonic() - sent < 20, err[-8000:]
    assert err.strip().splitlines()[-1] == ("error: stopped by SIGINT (ptbr train); fix: run the same command again "
                                            "(a training run resumes from its last checkpoint, where it saved one)")
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


WORKER = """
import signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(7))
print("ready", flush=True)
time.sleep(60)
"""


def test_the_launcher_passes_a_second_stop_signal_on_as_it_came():
    """The launcher's first SIGINT or SIGTERM goes to torch's shutdown (which passes it on and waits
    for the checkpoint); a later one goes to every worker's process group as it came, while the
    launcher waits on. Before any worker exists, the launch stops as any command does."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ptbr.backends.torch.distributed import _PassingStopSignalsOn

    before = signal.getsignal(signal.SIGINT)
    with _PassingStopSignalsOn(SignalException), pytest.raises(KeyboardInterrupt, match="^SIGTERM$"):
        signal.raise_signal(signal.SIGTERM)
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # as torch starts one
    try:
        assert worker.stdout.readline() == "ready\n"
        with _PassingStopSignalsOn(SignalException):
            with pytest.raises(SignalException):
                signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert worker.wait(timeout=30) == 7  # the worker's own SIGINT handler ran
    finally:
        worker.kill()
        worker.stdout.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_one_ctrl_c_in_a_terminal_saves_the_checkpoint(tmp_path):
    """A Ctrl-C in a terminal goes to its foreground process group: the launcher, which passes it
    on (torch starts each worker in a session of its own). One press saves the checkpoint; the
    handling of a second press must not take that one press for two."""
    import os
    import pty
    import select

    run = tmp_path / "run"
    pid, terminal = pty.fork()
    if pid == 0:  # the launcher, with the pty as its controlling terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "ptbr", "train", "--output", str(run), "--batch-size", "2",
                                  "--num-processes", "2", *TINY, "--max-steps", "100000", "--save-every", "0"])
    output = b""

    def read_for(seconds: float) -> bool:
        nonlocal output
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([terminal], [], [], 0.1)[0]:
                try:
                    data = os.read(terminal, 65536)
                except OSError:  # the terminal closed: the launcher has ended
                    return False
                if not data:
                    return False
                output += data
        return True

    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
            assert read_for(0.2) and time.monotonic() < deadline, output.decode(errors="replace")[-3000:]
        os.write(terminal, b"\x03")  # Ctrl-C
        deadline = time.monotonic() + 120
        while read_for(0.2):
            assert time.monotonic() < deadline, output.decode(errors="replace")[-3000:]
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(terminal)
    text = output.decode(errors="replace").replace("\r", "")
    assert os.waitstatus_to_exitcode(status) == 130, text[-3000:]
    (checkpoint,) = (run / "checkpoints").iterdir()
    assert text.strip().splitlines()[-1].startswith(f"error: stopped by SIGINT at step {int(checkpoint.name[5:])} ")
