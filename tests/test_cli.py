"""The CLI as a user meets it: fast help without torch, one-line errors, --debug anywhere, every
default in --help, output piped into `head`, `ptbr info`, `ptbr test-gpu` and `ptbr smoke`."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

import pytest

from ptbr.cli import COMMANDS, build_parser, main
from tests.conftest import REPO, nan_model, run_cli

SAMPLE = str(REPO / "ptbr" / "data" / "sample")  # the bundled dataset: 2,048-token vocabulary


def test_help_does_not_import_torch_and_is_fast():
    code = ("import sys, time; t = time.perf_counter(); from ptbr.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('ELAPSED', time.perf_counter() - t); print('TORCH', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "TORCH False" in result.stdout
    started = time.perf_counter()
    run = run_cli("--help")
    elapsed = time.perf_counter() - started
    assert run.returncode == 0 and "prepare" in run.stdout and "train" in run.stdout
    assert elapsed < 0.5, f"`ptbr --help` took {elapsed:.2f} s"


def test_train_help_lists_every_setting_with_its_default():
    run = run_cli("train", "--help")
    for flag in ("--data", "--tokenizer", "--output", "--model-size", "--batch-size", "--grad-accum", "--seq-len",
                 "--max-steps", "--learning-rate", "--warmup-steps", "--save-every", "--eval-every", "--seed",
                 "--device", "--precision", "--config", "--resume"):
        assert flag in run.stdout
    assert "(default: 8)" in run.stdout


def test_errors_are_one_line_with_an_exit_code(tmp_path):
    run = run_cli("train", "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "out"))
    assert run.returncode == 3
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("error: data directory not found") and "; fix: " in lines[-1]
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(("argv", "unknown", "where"), [
    (["train", "--chunked"], "--chunked", "ptbr train"),  # argparse would take it for --chunked-loss
    (["finetune", "--save", "5"], "--save 5", "ptbr finetune"),  # and this for --save-every
    (["kaggle", "bundle", "--output", "b", "--owner", "o", "--slug", "s", "--resume"], "--resume",
     "ptbr kaggle bundle"),  # --resume-from-previous
    (["--bogus"], "--bogus", "ptbr"),
])
def test_flags_are_spelled_out_and_an_unknown_one_names_its_command(argv, unknown, where, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"error: unrecognized arguments: {unknown} ({where}); "
                                               f"fix: see `{where} --help`")


def test_debug_shows_the_traceback(tmp_path):
    run = run_cli("train", "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "out"),
                  env={"PTBR_DEBUG": "1"})
    assert run.returncode == 3 and "Traceback" in run.stderr


# every command with the arguments it requires, to show that each takes --debug
REQUIRED = {"prepare": ["--input", "x", "--output", "y"], "generate": ["--model", "m", "hello"],
            "validate-data": ["data.jsonl"], "merge": ["--base", "b", "--adapter", "a", "--output", "o"],
            "export-adapter": ["a", "--to", "peft", "--output", "o"], "monitor": ["run"], "report": ["run"],
            "kaggle": ["status", "BUNDLE"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_debug_is_accepted_before_and_after_every_command(command):
    parser = build_parser()
    required = REQUIRED.get(command, [])
    assert parser.parse_args([command, *required]).debug is False
    assert parser.parse_args(["--debug", command, *required]).debug is True
    assert parser.parse_args([command, *required, "--debug"]).debug is True


@pytest.mark.parametrize("where", ["before", "after", "environment", "environment-true"])
def test_debug_shows_the_traceback_and_keeps_the_exit_code(tmp_path, capsys, monkeypatch, where):
    args = ["train", "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]
    if where.startswith("environment"):
        monkeypatch.setenv("PTBR_DEBUG", "1" if where == "environment" else "True")  # (true/yes/on did nothing)
    assert main({"before": ["--debug", *args], "after": [*args, "--debug"]}.get(where, args)) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ptbr.errors.DataError" in err
    assert err.strip().splitlines()[-1].startswith("error: data directory not found")


@pytest.mark.parametrize("debug", [False, True])
def test_an_unexpected_exception_is_exit_1_with_or_without_debug(capsys, monkeypatch, debug):
    import ptbr.commands.info

    def crash(*args, **kwargs):
        raise RuntimeError("injected by the test")

    monkeypatch.setattr(ptbr.commands.info, "model_info", crash)
    assert main(["info", "--model-size", "tiny", *(["--debug"] if debug else [])]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: unexpected RuntimeError: injected by the test")
    assert ("Traceback" in err) is debug


def _options(parser: argparse.ArgumentParser):
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        for action in command._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield name, action


def test_every_option_of_every_command_has_help_that_shows_its_default():
    from ptbr.config import FinetuneConfig, PretrainConfig, settings_fields

    settings = {"train": [PretrainConfig], "finetune": [FinetuneConfig], "preflight": [PretrainConfig, FinetuneConfig]}
    problems, checked = [], set()
    for command, action in _options(build_parser()):
        flag = f"{command} {action.option_strings[0]}"
        checked.add(command)
        if not action.help:
            problems.append(f"{flag}: no help")
            continue
        if isinstance(action, argparse._StoreTrueAction):
            continue  # a switch: off unless given
        if action.default is argparse.SUPPRESS:  # a settings flag: its default lives in the dataclass
            defaults = [f.default for cls in settings[command] for f, _ in settings_fields(cls)
                        if f.name == action.dest]
        else:
            defaults = [action.default]
        for default in defaults:
            if default is not None and f"(default: {default}" not in action.help:
                problems.append(f"{flag}: default {default!r} not shown in {action.help!r}")
    assert checked == set(COMMANDS)
    assert not problems, "\n".join(problems)


def test_help_lists_each_default_as_the_user_reads_it():
    run = run_cli("test-gpu", "--help")
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    for shown in ("--model-size MODEL_SIZE the preset to run one step of: tiny, 85m, 400m, 800m (default: 400m)",
                  "--batch-size BATCH_SIZE sequences in the step (default: 1)", "(default: 32000)"):
        assert shown in text


def _help_bytes(args: list[str]) -> bytes:
    return subprocess.run([sys.executable, "-m", "ptbr", *args], capture_output=True, check=True, timeout=120).stdout


def _into_a_closed_pipe(*args: str, buffered: bool) -> subprocess.CompletedProcess:
    """`ptbr ARGS | head -0`, deterministically: stdout is a pipe whose reader has already gone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "ptbr", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)
    finally:
        os.close(write)


@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.parametrize("args", [["info", "--data", SAMPLE, "--model-size", "tiny"],
                                  ["info", "--data", SAMPLE, "--json"], ["train", "--help"], ["--help"]],
                         ids=["info", "info-json", "train-help", "help"])
def test_output_into_a_reader_that_stopped_ends_quietly_with_141(args, buffered):
    # buffered: the failing write is the interpreter's last flush; unbuffered: a print() mid-command
    run = _into_a_closed_pipe(*args, buffered=buffered)
    assert run.stderr == ""
    chunk = io.TextIOWrapper(io.BytesIO())._CHUNK_SIZE  # what stdout's text layer holds back before writing
    if "--help" in args and (not buffered or len(_help_bytes(args)) >= chunk):
        # argparse's own write swallows the error (a help of stdout's chunk or more is written
        # through at once by argparse's write, as unbuffered): nothing is left to fail
        assert run.returncode == 0
    else:
        assert run.returncode == 141


def test_info_sizes_the_model_at_the_datasets_vocabulary(capsys):
    def model_of(*args: str) -> dict:
        assert main(["info", *args, "--model-size", "tiny", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["model"]

    assert model_of("--data", SAMPLE)["vocab_size"] == 2048
    assert model_of("--data", SAMPLE)["parameters"] == 1_066_112  # what `ptbr train` builds on it
    assert model_of("--data", SAMPLE, "--vocab-size", "32000")["parameters"] == 4_899_968
    assert model_of()["vocab_size"] == 32000


@pytest.mark.parametrize("command", ["info", "test-gpu"])
def test_bad_sizes_are_one_line_and_exit_2_before_anything_is_built(capsys, command):
    code = main([command, "--model-size", "tiny", "--seq-len", "513", "--batch-size", "0", "--vocab-size", "-1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip() == (f"error: 3 problems: --batch-size must be > 0, got 0; --vocab-size must be > 0, got -1; "
                           f"--seq-len 513 exceeds the tiny model's maximum of 512 positions (ptbr {command}); "
                           f"fix: give a listed model size and sizes within its limits (`ptbr {command} --help`)")
    assert main([command, "--model-size", "huge"]) == 2
    assert "unknown model size 'huge' (valid: tiny, 85m, 400m, 800m)" in capsys.readouterr().err


def test_smoke_passes_in_a_subprocess_and_says_its_directory_is_gone():
    run = run_cli("smoke", timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("smoke ok: one step of tiny, loss ")
    assert run.stdout.rstrip().endswith("the temporary run directory was removed (--output DIR keeps a run)")
    [announced] = [line for line in run.stderr.splitlines() if line.startswith("smoke: running in a temporary")]
    temporary = announced.split(": ")[-1]
    assert "removed at the end" in announced and not os.path.exists(temporary)


def test_smoke_failures_are_exit_9_and_keep_the_cause(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert main(["smoke", "--output", str(tmp_path / "file" / "run")]) == 9
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: smoke failed: cannot create or write the output directory: Not a directory (")
    assert "; fix: " in line


def test_a_stopped_smoke_does_not_offer_to_resume_from_its_removed_directory(capsys, monkeypatch):
    """Stopped at its step, smoke's run saved a checkpoint into the temporary directory it then
    removed, and the line said to run again to resume from it."""
    import ptbr.commands.smoke
    from ptbr.errors import Interrupted

    def stopped(output, backend=None):
        raise Interrupted("stopped by SIGINT at step 1", f"checkpoint {output}/checkpoints/step_000001",
                          "run the same command again to resume")

    monkeypatch.setattr(ptbr.commands.smoke, "run_smoke", stopped)
    assert main(["smoke"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: stopped by SIGINT at step 1, and the temporary run directory was removed with its checkpoint "
        "(ptbr smoke); fix: run `ptbr smoke` again")


def test_test_gpu_without_a_gpu_says_so_and_probes_on_cpu():
    import torch

    run = run_cli("test-gpu", "--model-size", "tiny", "--vocab-size", "2048", "--seq-len", "64", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    if not torch.cuda.is_available():
        assert "no CUDA GPU found: running the probe on the CPU" in run.stdout
    assert "one training step of tiny (1,066,112 parameters) on cpu in fp32: batch 1 x 64, loss " in run.stdout


def test_test_gpu_out_of_memory_on_a_cpu_is_one_line_and_exit_5(monkeypatch, capsys):
    """A probe on a CPU without the memory for it was "a bug in ptbr" (exit 1) where the allocation
    failed, and where it would not fail (a container's limit, overcommit) the kernel killed it."""
    from collections import namedtuple

    import psutil

    import ptbr.commands.test_gpu as test_gpu

    memory = namedtuple("memory", "total available percent used free")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(2 << 30, 1 << 30, 50.0, 0, 0))
    monkeypatch.setattr(psutil, "swap_memory", lambda: namedtuple("swap", "total used free percent")(0, 0, 0, 0.0))
    assert main(["test-gpu", "--model-size", "400m", "--device", "cpu", "--precision", "fp32"]) == 5
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: the probe step of 400m (batch 1 x 256, fp32) needs about 6.0 GiB, and 1.0 GiB is free (RAM): the "
        "kernel would kill it (ptbr test-gpu); fix: give a smaller --model-size (85m, tiny) or --batch-size")

    def allocation_failed(*args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 4194304 bytes")

    monkeypatch.setattr(test_gpu, "run_probe_step", allocation_failed)
    assert main(["test-gpu", "--model-size", "tiny", "--device", "cpu", "--precision", "fp32"]) == 5
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: out of memory on cpu in the probe step of tiny (batch 1 x 256): [enforce fail at alloc_cpu.cpp:127] "
        "DefaultCPUAllocator: can't allocate memory")


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_test_gpu_on_a_missing_device_is_one_line_and_exit_5(device, capsys):
    import torch

    if device == "cuda" and torch.cuda.is_available() or device == "mps" and torch.backends.mps.is_available():
        pytest.skip(f"this machine has {device}")
    assert main(["test-gpu", "--model-size", "tiny", "--device", device]) == 5
    out, err = capsys.readouterr()
    assert out == ""  # never "running the probe on the CPU" when it will not
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: --device {device} but ") and line.endswith("use --device cpu")


@pytest.mark.parametrize("debug", [False, True])
def test_torch_s_attention_determinism_notice_is_hidden_unless_debugging(debug):
    """Under --compile, torch's deterministic mode makes torch say once a run on a GPU that cuDNN's
    attention backward "defaults to a non-deterministic algorithm": hidden (--debug shows it);
    other UserWarnings stay."""
    import warnings

    from ptbr.cli import filter_third_party_noise

    notice = ("cuDNN Attention defaults to a non-deterministic algorithm. To explicitly enable determinism call "
              "torch.use_deterministic_algorithms(True, warn_only=False).")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_third_party_noise(debug)
        warnings.warn(notice, UserWarning, stacklevel=1)
        warnings.warn("Flash Attention defaults to a non-deterministic algorithm.", UserWarning, stacklevel=1)
        warnings.warn("something a run should show", UserWarning, stacklevel=1)
    shown = [str(w.message) for w in caught]
    assert shown == ([notice, "Flash Attention defaults to a non-deterministic algorithm.",
                      "something a run should show"] if debug else ["something a run should show"])


def test_a_failed_rank_of_several_ends_at_once_with_its_code_and_its_logs_flushed(tmp_path, monkeypatch, capsys,
                                                                                   request):
    """A failing rank keeps its process group open (another rank may wait in a collective for it), and
    gloo's threads could then abort the interpreter at exit (SIGABRT: the launcher saw -6 and the run
    ended with 1, not the rank's code). The `ptbr` command (`python -m ptbr` too) ends such a rank with
    os._exit(its code) after its error line and logs are out; main() always returns, for callers from
    Python; one process, or a group of one, exits as before."""
    import logging

    import torch.distributed as dist

    from ptbr.cli import command

    calls = []

    class Exited(BaseException):
        pass

    def exit_now(code):
        calls.append(("exit", code, capsys.readouterr().err.strip().splitlines()[-1]))
        raise Exited

    monkeypatch.setattr(logging, "shutdown", lambda *a: calls.append(("logs flushed",)))
    monkeypatch.setattr(os, "_exit", exit_now)
    import signal  # command() is the process's entry point: it leaves SIGINT/SIGTERM ending the process

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # this one's again after
    request.addfinalizer(lambda: [signal.signal(sig, handler) for sig, handler in handlers.items()])
    args = ["train", "--output", str(tmp_path / "run"), "--data", str(tmp_path / "nope"), "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", ["ptbr", *args])
    assert command() == 3 and calls == []  # no group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    size = [1]
    monkeypatch.setattr(dist, "get_world_size", lambda *a: size[0])
    assert command() == 3 and calls == []  # a group of one process
    size[0] = 2
    assert main(args) == 3 and calls == []  # main() returns
    capsys.readouterr()
    with pytest.raises(Exited):
        command()
    assert calls[0] == ("logs flushed",)
    assert calls[1][:2] == ("exit", 3) and calls[1][2].startswith("error: data directory not found")


@pytest.mark.parametrize("delay", [0.5, 1.0, 1.5, 2.5])
def test_ctrl_c_at_any_moment_of_start_up_is_exit_130_without_a_traceback(tmp_path, delay):
    """SIGINT while `ptbr train` is still importing torch (the first seconds) ended with exit 1 and a
    traceback: the failed-rank exit re-imported torch.distributed from torch's half-made modules.
    Whenever it lands, the command stops with its one-line message and 130 (at 2.5 s it may be
    training already: the same code, after a checkpoint)."""
    import signal

    process = subprocess.Popen([sys.executable, "-m", "ptbr", "train", "--output", str(tmp_path / "run"),
                                "--model-size", "tiny", "--seq-len", "32", "--batch-size", "2", "--max-steps",
                                "100000", "--device", "cpu", "--eval-every", "0"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, (delay, err[-3000:])
    assert "Traceback" not in err and "stopped by SIGINT" in err, err[-3000:]


def test_ctrl_c_while_the_cli_itself_loads_is_one_line_and_130(tmp_path):
    """The half second before the CLI's modules are loaded and its arguments parsed (where the test
    above's 0.5 s lands on a fast machine) ended with Python's KeyboardInterrupt traceback and -2:
    the entry point catches it there (and clears CPython's record of it, see the test above), and
    main() while it builds the parser."""
    script = ("import sys\n"
              "class Interrupting:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'ptbr.cli':  # raised in code exec() runs, as in dataclasses' methods\n"
              "            exec('raise KeyboardInterrupt', {})\n"
              "sys.meta_path.insert(0, Interrupting())\n"
              "sys.argv = ['ptbr', '--debug', 'train', '--output', 'run']\n"
              "from ptbr.__main__ import run\n"
              "raise SystemExit(run())\n")
    (tmp_path / "launch.py").write_text(script)  # run with -m, as `python -m ptbr` is (-c exits before the record counts)
    done = subprocess.run([sys.executable, "-m", "launch"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    assert (done.returncode, done.stderr) == (130, "error: stopped by SIGINT (ptbr train); fix: run the same command "
                                                   "again (a training run resumes from its last checkpoint, where it "
                                                   "saved one)\n")


def test_ctrl_c_while_the_parser_is_built_is_one_line_and_130(monkeypatch, capsys):
    import ptbr.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["info", "--output", "run"]) == 130
    assert capsys.readouterr().err == "error: stopped by SIGINT (ptbr info); fix: run the same command again\n"
    assert cli.main(["--debug"]) == 130
    assert capsys.readouterr().err == "error: stopped by SIGINT (ptbr); fix: run the same command again\n"


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_after_the_command_ended_keeps_its_exit_code(stop):
    """A signal in the second after a run's `done:` line (the interpreter's teardown) ended the
    process by that signal (-2, -15), with no line, though the run had finished."""
    script = ("import os, signal, sys, time\n"
              "import ptbr.cli as cli\n"
              "cli.main = lambda argv=None: 0  # a command that finished\n"
              "code = cli.command()\n"
              f"os.kill(os.getpid(), signal.{stop})  # in the teardown that follows\n"
              "time.sleep(30)\n"
              "sys.exit(99)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "") and time.monotonic() - started < 20


def held_by_a_module(expression: str) -> str:
    """Script lines: an object (`expression`) that only a module holds, so that the interpreter's
    exit frees it as it tears the modules down (its `__del__` then runs there)."""
    return ("module = type(sys)('held_at_exit')\n"
            f"module.held = {expression}\n"
            "sys.modules['held_at_exit'] = module\n"
            "del module\n")


def test_the_exit_leaves_the_libraries_objects_out_of_its_garbage_collections():
    """After the command, the interpreter's exit collected garbage over every object torch and
    transformers had made: about a second between a run's `done:` line and the prompt. Those are
    frozen once the command has returned (the exit's collections skip them), and only then: a
    module's objects are still torn down, their `__del__` run."""
    script = ("import atexit, gc, sys\n"
              "import ptbr.cli as cli\n"
              "class Held:\n"
              "    def __del__(self):\n"
              "        print('torn down', flush=True)\n"
              + held_by_a_module("Held()") +
              "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0, flush=True))\n"
              "def finished(argv=None):\n"
              "    print('frozen in the command:', gc.get_freeze_count() > 0, flush=True)\n"
              "    return 0\n"
              "cli.main = finished\n"
              "sys.exit(cli.command())\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == ["frozen in the command: False", "frozen at exit: True", "torn down"]


def test_a_sigterm_in_the_interpreters_module_teardown_keeps_the_exit_code():
    """The interpreter's teardown puts the signals' defaults back before it tears modules down
    (torch's take most of a second): a SIGTERM then ended a finished `ptbr smoke` or `ptbr train`
    with the shell's 143 (3 of 3 tries by hand, helper 66). Here a module's teardown sends it."""
    script = ("import os, signal, sys, time\n"
              "import ptbr.cli as cli\n"
              "cli.main = lambda argv=None: 0  # a command that finished\n"
              "class Slow:\n"
              "    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGTERM, sleep=time.sleep):\n"
              "        kill(pid, sig)\n"
              "        sleep(1)\n"
              + held_by_a_module("Slow()") +
              "sys.exit(cli.command())\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_stop_signal_still_ends_an_exit_hook_that_hangs():
    """The signals are ignored only after every library's exit hook (torch's, multiprocessing's):
    ignored from the first hook on, one that hung could be ended by SIGKILL alone (a data-parallel
    rank waited out the launcher's 600 s)."""
    script = ("import atexit, os, signal, sys, time\n"
              "import ptbr.cli as cli\n"
              "def hangs():\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n"
              "def finished(argv=None):\n"
              "    atexit.register(hangs)  # as a library imported by the command registers its own\n"
              "    return 0\n"
              "cli.main = finished\n"
              "sys.exit(cli.command())\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "") and time.monotonic() - started < 15


def test_a_sigterm_between_the_result_and_the_exit_keeps_the_exit_code():
    """main() put SIGTERM's default back as the command returned, before command() made a signal
    keep the result: a SIGTERM in between (here: while main() flushes stdout) ended the process
    with the shell's 143 after `smoke ok` (3 of 3 tries by hand)."""
    script = ("import os, signal, sys\n"
              "import ptbr.cli as cli\n"
              "cli._command = lambda args: 0  # a command that finished\n"
              "class Out:\n"
              "    def write(self, text): return len(text)\n"
              "    def flush(self): os.kill(os.getpid(), signal.SIGTERM)  # main() flushes after the command\n"
              "sys.stdout = Out()\n"
              "sys.argv = ['ptbr', 'info']\n"
              "sys.exit(cli.command() + 99)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_ctrl_c_caught_inside_code_run_from_a_string_still_ends_with_130(tmp_path):
    """CPython ends a `python -m` program with SIGINT at exit (the shell sees -2, not 130) once a
    KeyboardInterrupt escaped code that exec() ran from a string, even where the program caught it:
    a Ctrl-C landing while a dataclass of torch's is made at import did that now and then in the
    test above. Here the interrupt comes from such an exec every time."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "__main__.py").write_text(
        "import sys\n"
        "import ptbr.cli as cli\n"
        "def interrupted(args):\n"
        "    exec(\"raise KeyboardInterrupt('SIGINT')\", {})\n"
        "sys.modules['probe_commands'] = sys.modules[__name__]\n"
        "cli.COMMANDS['info'] = ('probe_commands:interrupted', cli.COMMANDS['info'][1])\n"
        "sys.argv = ['ptbr', 'info']\n"
        "raise SystemExit(cli.command())\n")
    done = subprocess.run([sys.executable, "-m", "probe"], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    assert (done.returncode, done.stderr) == (
        130, "error: stopped by SIGINT (ptbr info); fix: run the same command again\n")


def test_generate_on_a_pretraining_run_without_its_final_model_says_how_to_get_it(tmp_path, capsys):
    """A stopped run (checkpoints, no final/ yet) was told to 'give a Hugging Face model directory'."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "run_config.json").write_text("{}")
    assert main(["generate", "Oi", "--model", str(run)]) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: no config.json in the model directory ({run}); fix: this is a pretraining run's directory without "
        f"its final model yet (final/ is written at its last step): run the same `ptbr train` command again to "
        f"finish it, then give {run / 'final'}")
    tuned = tmp_path / "tuned"  # a fine-tuning run without validation writes adapters/ at its end
    (tuned / "checkpoints").mkdir(parents=True)
    (tuned / "run_config.json").write_text('{"command": "finetune"}')
    assert main(["generate", "Oi", "--model", str(tuned)]) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "fix: this is a fine-tuning run's directory without its adapter yet (adapters/ is written at its last step "
        "when it has no validation set): run the same `ptbr finetune` command again to finish it, then give --model "
        f"BASE --adapter {tuned / 'adapters'}")


def test_the_error_line_comes_after_what_stdout_still_buffered():
    """With stdout and stderr on one pipe (`2>&1 | tee`), stdout's block buffer was written after
    the error line, once cut mid-line: '...take one chunkerror: stopped by SIGTERM'."""
    script = ("import sys\n"
              "from ptbr.cli import _say\n"
              "print('a line of output ' * 3)\n"
              "_say('error: it failed (x); fix: y')\n")
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout as a user's pipe has it
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60, env=buffered)
    assert done.stdout == "a line of output " * 3 + "\nerror: it failed (x); fix: y\n"


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_generate_from_a_model_with_nan_weights_says_so_in_one_line(tmp_path, capsys, temperature):
    """A NaN in the weights (a damaged file, a diverged run's model): sampling failed inside torch,
    reported as a bug in ptbr (exit 1), and greedy decoding printed the prompt alone (exit 0)."""
    model_dir = nan_model(tmp_path / "nan-model")
    assert main(["generate", "Era uma vez", "--model", str(model_dir), "--max-new-tokens", "5",
                 "--temperature", temperature]) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: the model's output is not finite (NaN or infinite logits): its weights are damaged, or the run that "
        "made them diverged (ptbr generate); fix: use another checkpoint of the run (OUTPUT/checkpoints/step_*), "
        "or copy the model's files again")


def test_a_damaged_ptbr_adapter_json_is_warned_of_once_not_silently_ignored(tmp_path, capsys):
    """merge and generate read the data format from ptbr_adapter.json: a damaged one was taken as
    "no record" without a word (a chat adapter then generated as plain text)."""
    from ptbr.finetune.adapter import read_adapter_meta
    from ptbr.log import setup_console

    setup_console()
    (tmp_path / "ptbr_adapter.json").write_text("{bad")
    assert read_adapter_meta(tmp_path) == {} and read_adapter_meta(tmp_path) == {}
    assert read_adapter_meta(tmp_path / "none") == {}
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and f"warning: {tmp_path / 'ptbr_adapter.json'} cannot be read (Expecting " in err
    assert "is unknown; copy the adapter directory again" in err
