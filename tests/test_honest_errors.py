"""Off the happy path, one verdict per question and messages that say what happened: data checks
shared by validate-data and finetune, a missing base refused at once, every bad setting of a config
file in one message, prepare on inputs with nothing usable, and the README's exit codes = the code's."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

import tests.test_finetune as finetune_tests
from ptbr.cli import main
from ptbr.errors import EXIT_CODES, PtbrError
from tests.conftest import run_cli

toy = finetune_tests.toy
REPO = Path(__file__).resolve().parents[1]


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_validate_data_and_finetune_give_one_verdict(toy, tmp_path, capsys):
    """At --max-seq-len 8 every example's answer is cut off: both refuse with the same problem."""
    assert main(["validate-data", str(toy.data), "--base", str(toy.base), "--max-seq-len", "8"]) == 3
    out = capsys.readouterr().out
    assert "no example is left within max_seq_len 8" in out and "\n  ok" not in out
    assert main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(tmp_path / "run"),
                 "--quant", "none", "--max-seq-len", "8"]) == 3
    error = last_error(capsys)
    assert "no example is left within max_seq_len 8" in error
    assert error.endswith("; fix: raise --max-seq-len (the longest example has 49 tokens)"), error
    assert main(["validate-data", str(toy.data), "--base", str(toy.base), "--max-seq-len", "8"]) == 3
    assert last_error(capsys).endswith("; fix: raise --max-seq-len (the longest example has 49 tokens)")
    # and a length both accept
    assert main(["validate-data", str(toy.data), "--base", str(toy.base), "--max-seq-len", "64"]) == 0
    assert "40 usable within max_seq_len 64" in capsys.readouterr().out


def test_a_missing_base_is_refused_at_once_without_asking_a_hub(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "Olá"}\n', encoding="utf-8")
    for base, hint in (("mistralai/Mistral-7B-v0.1x", "add --download"), (str(tmp_path / "no_such_dir"), None)):
        started = time.monotonic()
        code = main(["finetune", "--base", base, "--data", str(data), "--output", str(tmp_path / "run")])
        line = last_error(capsys)
        assert code == 4 and time.monotonic() - started < 10
        assert line.startswith("error: base model directory not found")
        assert (hint in line) if hint else ("--download" not in line)


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub's answers about model ids: someone/gated (public card, files behind its terms),
    someone/locked (this token may not read it), any other id unknown."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.startswith("/api/models/someone/gated/auth-check"):
            self.answer(403, b'{"error": "Access to model someone/gated is restricted."}', "GatedRepo")
        elif self.path.startswith("/api/models/someone/gated"):
            self.answer(200, b'{"id": "someone/gated", "_id": "1", "gated": "auto", "sha": "abc123"}')
        elif self.path.startswith("/api/models/someone/locked"):
            self.answer(403, b'{"error": "Your token lacks the read permission."}')
        else:
            self.answer(404, b'{"error": "Repository not found"}', "RepoNotFound")

    def answer(self, status: int, body: bytes, code: str | None = None):
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_download_asks_the_hub_once_and_says_at_once_what_it_answered(toy, tmp_path):
    """--download with an id: a Hub that cannot be reached, an id it does not know and HF_HUB_OFFLINE
    without a cached copy are one line at once (transformers alone retries every file for about a
    minute, printing each retry); a copy in the local cache is used, with a warning, without retries."""
    home = tmp_path / "hf"
    no_proxy = {name: "" for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                      "all_proxy")} | {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    unreachable = {"HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", **no_proxy}
    generate = ("generate", "--model", "someone/some-model", "--download", "--max-new-tokens", "2", "Olá")
    started = time.monotonic()
    done = run_cli(*generate, env=unreachable)
    assert time.monotonic() - started < 30 and "Retrying" not in done.stderr
    assert (done.returncode, done.stderr.strip().splitlines()[-1].split(":")[:2]) == (
        4, ["error", " cannot reach the Hugging Face Hub"]), done.stderr
    assert "check the network" in done.stderr
    done = run_cli(*generate, env={**unreachable, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 4 and done.stderr.strip() == (
        "error: the model is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set (someone/some-model); "
        "fix: unset HF_HUB_OFFLINE to download it, or give a local model directory"), done.stderr
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub = {**unreachable, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
    try:
        answers = {model: run_cli("validate-data", str(toy.data), "--base", f"someone/{model}", "--download", env=hub)
                   for model in ("some-model", "gated", "locked")}
    finally:
        server.shutdown()
    assert {model: (done.returncode, done.stderr.strip().splitlines()[-1]) for model, done in answers.items()} == {
        "some-model": (4, "error: the Hugging Face Hub has no model someone/some-model (or it is private and you are "
                          "not logged in) (someone/some-model); fix: check the id on https://huggingface.co "
                          "(ORG/NAME), or log in (`hf auth login`, or set HF_TOKEN) for a private model"),
        "gated": (4, "error: someone/gated is a gated model: its files need its terms accepted (someone/gated); fix: "
                     "accept them on https://huggingface.co/someone/gated, then log in (`hf auth login`, or set "
                     "HF_TOKEN)"),
        "locked": (4, answers["locked"].stderr.strip().splitlines()[-1])}
    assert answers["locked"].stderr.strip().startswith(
        "error: the Hugging Face Hub refused this token for someone/locked (HTTP 403): "), answers["locked"].stderr
    assert answers["locked"].stderr.strip().endswith(
        "fix: log in (`hf auth login`, or set HF_TOKEN) again with a token that may read it")
    # a cached copy without its weights (a download cut short) is no copy to fall back on
    partial = home / "hub" / "models--someone--partial"
    (partial / "snapshots" / "abc123").mkdir(parents=True)
    shutil.copy(toy.base / "config.json", partial / "snapshots" / "abc123" / "config.json")
    (partial / "refs").mkdir()
    (partial / "refs" / "main").write_text("abc123")
    done = run_cli("generate", "--model", "someone/partial", "--download", "Olá", env=unreachable)
    assert done.returncode == 4 and re.search(
        r"^error: cannot reach the Hugging Face Hub: .*Connection refused.* \(the local cache holds someone/partial "
        r"without its weights\) \(someone/partial\); fix: check the network", done.stderr.strip()), done.stderr
    # the same id in the local cache (the Hub's layout): loaded from there, the Hub still unreachable
    repo = home / "hub" / "models--someone--some-model"
    shutil.copytree(toy.base, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    done = run_cli(*generate, env=unreachable)
    assert done.returncode == 0 and "Retrying" not in done.stderr, done.stderr
    assert re.search(r"warning: cannot reach the Hugging Face Hub \(.*Connection refused\): using the copy of "
                     r"someone/some-model in the local cache", done.stderr), done.stderr


def test_a_config_file_reports_every_bad_value_at_once(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("batch_size: many\nlearning_rate: -1\nhang_action: shout\nseq_len: 99999\nwarmup: 3\n")
    assert main(["train", "--config", str(config)]) == 2
    line = last_error(capsys)
    for fragment in ("5 problems", "unknown key 'warmup'", "batch_size must be of type int, got 'many'",
                     "learning_rate must be a finite number > 0, got -1.0", "hang_action must be exit or warn",
                     "seq_len 99999 exceeds the tiny model's maximum"):
        assert fragment in line, fragment
    assert "above" not in line and "--help" in line


def test_prepare_on_inputs_without_text_fails_and_a_small_vocabulary_is_a_warning(tmp_path, capsys, corpus_dir):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n\n", encoding="utf-8")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "  "}\n', encoding="utf-8")
    for source in (blank, empty):
        assert main(["prepare", "--input", str(source), "--output", str(tmp_path / "data")]) == 3
        assert "the inputs hold no text" in last_error(capsys)
        assert not (tmp_path / "data" / "train.bin").exists()
    assert main(["prepare", "--input", str(corpus_dir), "--output", str(tmp_path / "data"), "--vocab-size",
                 "70000"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"warning: the trained vocabulary has [\d,]+ tokens, far fewer than the 70,000 asked", err)


def test_the_readme_exit_code_table_is_the_code_s():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## When something goes wrong", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", section, flags=re.M))
    assert {int(code) for code in rows} == set(EXIT_CODES)
    # every error class's code is in the table, and no code is documented without a class or a rule
    classes = {cls.exit_code for cls in _subclasses(PtbrError)}
    assert classes <= set(EXIT_CODES) and set(EXIT_CODES) - classes == {0, 1, 137, 141}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_help_lists_the_same_exit_codes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code, meaning in EXIT_CODES.items():
        assert f"{code:<4} {meaning}" in out


def test_the_readme_s_what_ptbr_does_list_matches_the_code():
    """Each promise of "What ptbr does" with a number or a name in it, against the constant the code uses."""
    from ptbr.errors import HangDetected, Interrupted, OutputError, TrainingDiverged
    from ptbr.lock import LOCK_FILE
    from ptbr.runs.common import PREVIOUS
    from ptbr.train import watchdog
    from ptbr.train.loop import MAX_BAD_STEPS_IN_A_ROW

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("What ptbr does so that no failure is silent", 1)[1].split("\n## ", 1)[0]
    promises = {
        f"`OUTPUT/{LOCK_FILE}` is held (flock)": True,
        f"moves the old run's files to `OUTPUT/{PREVIOUS}/`": True,
        f"exits with {HangDetected.exit_code}": True,
        f"{watchdog.BEFORE_FIRST_STEP_S / 60:.0f} minutes until the first": True,
        f"then {watchdog.AFTER_FIRST_STEP_FACTOR:.0f} times the first step's time": True,
        f"(at least {watchdog.AFTER_FIRST_STEP_MIN_S / 60:.0f} minutes)": True,
        f"and exits with {Interrupted.exit_code}": True,
        f"is exit {OutputError.exit_code}": True,
        f"after {MAX_BAD_STEPS_IN_A_ROW} in a row the run stops": True,
    }
    missing = [promise for promise in promises if promise not in " ".join(section.split())]
    assert not missing, missing
    table = readme.split("| exit code | meaning |", 1)[1]
    assert f"| {TrainingDiverged.exit_code} | training diverged: loss or gradients non-finite for " \
           f"{MAX_BAD_STEPS_IN_A_ROW} steps in a row |" in table


ABORT_IN_INFO = """
import os
import ptbr.commands.info


def abort_in_native_code(args):
    os.abort()  # as a C++ library's std::terminate or a failed assertion does


ptbr.commands.info.main = abort_in_native_code
"""


def test_a_native_crash_prints_every_thread_s_python_stack(tmp_path):
    """A process killed by a signal from native code (here SIGABRT) runs no Python handler and leaves
    one word from the shell; ptbr turns on faulthandler, which prints the Python stacks first."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(ABORT_IN_INFO)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    crashed = subprocess.run([sys.executable, "-m", "ptbr", "info", "--model-size", "tiny"], capture_output=True,
                             text=True, timeout=120, cwd=REPO, env=env)
    assert crashed.returncode == -6
    assert "Fatal Python error: Aborted" in crashed.stderr
    assert "in abort_in_native_code" in crashed.stderr and re.search(r"ptbr[/\\]cli\.py\", line \d+ in _run",
                                                                   crashed.stderr)


def test_out_of_memory_without_auto_fit_is_exit_5_not_a_crash(tmp_path, capsys, oom_above):
    oom_above(limit=2)
    code = main(["train", "--output", str(tmp_path / "run"), "--model-size", "tiny", "--seq-len", "32",
                 "--batch-size", "4", "--max-steps", "2", "--device", "cpu"])
    line = last_error(capsys)
    assert code == 5 and line.startswith("error: out of memory on cpu: CUDA out of memory")
    assert "--auto-fit" in line and not (tmp_path / "run" / "crash_report.txt").exists()


def _small_vocab_base(toy, tmp_path) -> Path:
    """The toy base's files with config.json claiming a vocabulary smaller than its tokenizer's."""
    import shutil

    base = tmp_path / "small_vocab"
    shutil.copytree(toy.base, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    return base


def test_a_tokenizer_that_does_not_belong_to_the_model_is_refused_before_training(toy, tmp_path, capsys):
    base = _small_vocab_base(toy, tmp_path)
    for args in (["finetune", "--base", str(base), "--data", str(toy.data), "--output", str(tmp_path / "run"),
                  "--quant", "none"],
                 ["validate-data", str(toy.data), "--base", str(base)]):
        assert main(args) == 4
        assert "the tokenizer has 384 tokens but the model's vocabulary (config.json vocab_size) has 100" in \
            last_error(capsys)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert main(["preflight", "--mode", "finetune", "--base", str(base), "--data", str(toy.data), "--quant", "none",
                 "--output", str(tmp_path / "plan")]) == 10
    report = json.loads((tmp_path / "plan" / "preflight_report.json").read_text())
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["model.tokenizer"]
    # a failed preflight recommends nothing: no config to run into the same failure, no "next:" line
    assert not (tmp_path / "plan" / "recommended_config.json").exists()
    assert "next: ptbr finetune" not in capsys.readouterr().out


def test_examples_longer_than_the_model_are_one_verdict(toy, tmp_path, capsys):
    """The toy base has 256 positions; --max-seq-len 1024 keeps a 300-token example whole."""
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"text": " ".join(["Porto"] * 300)}) + "\n", encoding="utf-8")
    assert main(["validate-data", str(long), "--base", str(toy.base)]) == 3
    assert "1 examples are longer than the base model's 256 positions" in capsys.readouterr().out
    assert main(["finetune", "--base", str(toy.base), "--data", str(long), "--output", str(tmp_path / "run"),
                 "--quant", "none"]) == 3
    error = last_error(capsys)
    assert "longer than the base model's 256 positions" in error
    assert error.endswith("; fix: give --max-seq-len 256 or less (the base model's positions)"), error
    # a GPT-2-style config.json names them n_positions (the run crashed in the position embedding)
    gpt2_style = tmp_path / "gpt2-style"
    shutil.copytree(toy.base, gpt2_style)
    config = json.loads((gpt2_style / "config.json").read_text())
    config["n_positions"] = config.pop("max_position_embeddings")
    (gpt2_style / "config.json").write_text(json.dumps(config))
    assert main(["validate-data", str(long), "--base", str(gpt2_style), "--max-seq-len", "1024"]) == 3
    assert "1 examples are longer than the base model's 256 positions" in capsys.readouterr().out


def test_smoke_never_writes_into_someone_else_s_directory(tmp_path, capsys):
    run = tmp_path / "my_run"
    run.mkdir()
    (run / "train.log").write_text("a user's run\n")
    assert main(["smoke", "--output", str(run)]) == 9
    assert "already holds other files" in last_error(capsys)
    assert [p.name for p in run.iterdir()] == ["train.log"]
    shown = tmp_path / "shown-in-finder"  # a folder Finder showed is still an empty one
    shown.mkdir()
    (shown / ".DS_Store").write_bytes(b"\0")
    assert main(["smoke", "--output", str(shown)]) == 0
    # a check, not a run to study: no report.md and no "no report" line (in ptbr's images, which have
    # no matplotlib, that line sent users to a temporary folder "in the /out volume")
    assert not (shown / "report.md").exists() and not (shown / "plots").exists()
    assert "report" not in capsys.readouterr().err


def test_inputs_this_user_cannot_read_are_one_line_not_a_crash(toy, dataset_dir, monkeypatch, capsys):
    """A dataset's or a base's files that this user may not read (transformers saves weights 0600:
    another user's, or a host user's in ptbr's image, which runs as uid 1000) were "unexpected
    PermissionError ... a bug in ptbr" (exit 1), or "No such file" from safetensors. (Root reads
    anything: the denial is os.access's here; tests/test_image.py meets it for real.)"""
    import os

    denied: set[str] = set()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: str(path) not in denied and real_access(path, mode))
    denied.add(str(dataset_dir / "train.bin"))
    assert main(["info", "--data", str(dataset_dir)]) == 3
    assert last_error(capsys) == (f"error: cannot read train.bin: permission denied ({dataset_dir}); fix: make them "
                                  "readable by this user (chmod a+r FILE, chmod a+rx FOLDER)")
    denied.add(str(dataset_dir))  # a folder it cannot enter: the folder alone
    assert main(["train", "--data", str(dataset_dir), "--output", str(dataset_dir.parent / "run")]) == 3
    assert last_error(capsys).startswith(f"error: cannot read {dataset_dir}: permission denied ({dataset_dir}); ")
    denied.add(str(toy.base / "model.safetensors"))
    monkeypatch.setenv("PTBR_IMAGE_VARIANT", "cpu")
    for command in (["generate", "--model", str(toy.base), "Oi"],
                    ["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output",
                     str(dataset_dir.parent / "tuned")]):
        assert main(command) == 4
        assert last_error(capsys) == (
            f"error: cannot read the {'model' if command[0] == 'generate' else 'base model'}'s model.safetensors: "
            f"permission denied ({toy.base}); fix: the ptbr-cpu image runs as uid {os.getuid()}: on the host, make "
            'the files readable by it (chmod -R a+rX FOLDER), or run the container as yourself (--user "$(id -u):$(id '
            '-g)")'), command


def test_smoke_without_a_writable_temporary_directory_says_so(tmp_path, monkeypatch, capsys):
    """It said "unexpected FileNotFoundError ... report it": the machine's to fix, not a bug."""
    import tempfile

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))
    monkeypatch.setenv("TMPDIR", str(blocked))
    assert main(["smoke"]) == 9
    line = last_error(capsys)
    assert line.startswith("error: smoke failed: no writable temporary directory: ") and line.endswith(
        f"({blocked}); fix: set TMPDIR to a writable directory, or give --output DIR"), line


def test_a_run_that_fails_before_it_starts_leaves_no_directory_it_made(toy, tmp_path, capsys):
    """A run refused for its data (or a checkpoint, a setting found late) made its --output only to
    hold its log and lock: left behind, `ptbr monitor` read it as a run that had started. A
    directory that was there before keeps its train.log, with the error line in it."""
    new = tmp_path / "new"
    assert main(["train", "--data", str(tmp_path / "nope"), "--output", str(new), "--model-size", "tiny"]) == 3
    assert not new.exists()
    assert main(["finetune", "--base", str(toy.base), "--data", str(tmp_path / "nope.jsonl"), "--output",
                 str(new)]) == 3
    assert not new.exists()
    there = tmp_path / "there"
    there.mkdir()
    assert main(["train", "--data", str(tmp_path / "nope"), "--output", str(there), "--model-size", "tiny"]) == 3
    assert "error: data directory not found" in (there / "train.log").read_text()


def test_a_ctrl_c_between_making_the_directory_and_holding_its_lock_leaves_none(tmp_path, monkeypatch):
    """A Ctrl-C at the start, after the run made its --output and opened its lock file but before
    it held the lock, left that directory (with a lock naming a dead PID) for monitor to call a
    dead run (a run that holds the lock keeps its directory: test_parallel's failed launch)."""
    import os

    from ptbr.config import PretrainConfig
    from ptbr.lock import RunLock
    from ptbr.runs.common import open_run

    def interrupted(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, f"pid={os.getpid()}\n".encode())
        os.close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunLock, "acquire", interrupted)
    new = tmp_path / "new"
    with pytest.raises(KeyboardInterrupt), open_run(PretrainConfig(output=str(new), model_size="tiny")):
        pass
    assert not new.exists()
    monkeypatch.undo()
