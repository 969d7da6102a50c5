"""The MLX path without torch: a virtual environment holding only what locks/ci.txt pins for it
(no torch, peft, bitsandbytes or accelerate) fine-tunes, pretrains, generates, converts and merges
adapters; and `nox -s mac`, which installs the same subset of locks/macos.txt on Apple Silicon."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tests.test_finetune as finetune_tests
import tests.test_locks as lock_tests

pytest.importorskip("mlx.core")
pytest.importorskip("nox")

toy = finetune_tests.toy
noxfile = lock_tests.noxfile  # noxfile.py loaded as nox loads it
SessionQuit = lock_tests.SessionQuit
REPO = Path(__file__).resolve().parents[1]
# downloaded once per checkout (ignored by git), then every install reads it with --no-index
WHEELS = REPO / ".cache" / "mlx-path-wheels"


class Recorder:
    """Takes a nox session's place: records what it would install and run, runs nothing."""

    def __init__(self, tmp: Path):
        self.tmp, self.posargs, self.installs, self.runs = tmp, [], [], []

    def install(self, *args, **_):
        self.installs.append(args)

    def run(self, *args, **_):
        self.runs.append(args)

    def create_tmp(self):
        return str(self.tmp)

    def error(self, message):
        raise SessionQuit(message)


def test_the_mlx_path_packages_leave_torch_out(noxfile):
    for lock, build in (("ci", "mlx-cpu"), ("macos", "mlx-metal")):
        found = noxfile.mlx_packages(REPO / "locks" / f"{lock}.txt")
        assert {"mlx", build, "mlx-lm", "transformers", "tokenizers", "safetensors", "numpy", "jinja2"} <= found
        assert not found & {"torch", "peft", "bitsandbytes", "accelerate", "nvidia-cublas-cu12", "sympy", "pytest"}


def test_mac_session_says_where_it_runs_and_installs_mlx_without_torch(noxfile, tmp_path, monkeypatch):
    session = noxfile.sessions["mac"]
    assert session.python == noxfile.LOCK_PYTHON
    monkeypatch.setattr(noxfile.platform, "system", lambda: "Linux")
    monkeypatch.setattr(noxfile.platform, "machine", lambda: "x86_64")
    with pytest.raises(SessionQuit, match="macOS on Apple Silicon.*this is Linux x86_64"):
        session.func(Recorder(tmp_path))

    monkeypatch.setattr(noxfile.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(noxfile.platform, "machine", lambda: "arm64")
    recorded = Recorder(tmp_path)
    session.func(recorded)
    (*flags, requirements), checkout = recorded.installs
    assert flags == ["--require-hashes", "--no-deps", "-r"] and checkout == ("--no-deps", "--no-build-isolation", "-e", ".")
    text = Path(requirements).read_text()
    assert "mlx-metal==" in text and "mlx-lm==" in text and "--hash=sha256:" in text
    assert "torch==" not in text and "peft==" not in text
    assert [run[:2] for run in recorded.runs] == [("ptbr", "preflight"), ("ptbr", "smoke")]
    assert recorded.runs[1] == ("ptbr", "smoke", "--backend", "mlx")


def clean_env(**extra: str) -> dict:
    """No pip configuration (extra indexes, find-links) and no PIP_* variables reach the install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"PIP_CONFIG_FILE": os.devnull} | extra


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_mlx_path_runs_in_an_environment_without_torch(noxfile, toy, tmp_path):
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("locks/ci.txt pins MLX's CPU build for Linux x86_64")
    lock = REPO / "locks" / "ci.txt"
    requirements = tmp_path / "mlx-path.txt"
    requirements.write_text(noxfile.lock_entries(lock, noxfile.mlx_packages(lock) | {"setuptools"}))
    WHEELS.mkdir(parents=True, exist_ok=True)
    # the wheels, hash-checked, from wherever pip is configured to look (once per checkout)
    run(sys.executable, "-m", "pip", "download", "--require-hashes", "--no-deps", "--only-binary", ":all:",
        "-r", requirements, "-d", WHEELS, timeout=900)

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    env = clean_env()
    run(python, "-m", "pip", "install", "--no-index", "--find-links", WHEELS, "--require-hashes", "--no-deps",
        "-r", requirements, env=env, timeout=900)
    source = tmp_path / "src"  # ptbr itself, built from a copy: the checkout stays as it is
    shutil.copytree(REPO / "ptbr", source / "ptbr", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    run(python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", source, env=env, timeout=600)
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, env=env).returncode != 0

    ptbr = venv / "bin" / "ptbr"
    cwd = tmp_path  # not the checkout: the installed ptbr is the one that runs
    out = tmp_path / "ft"
    run(ptbr, "finetune", "--backend", "mlx", "--base", toy.base, "--data", toy.data, "--output", out, "--quant", "4bit",
        "--lora-r", "8", "--batch-size", "4", "--max-steps", "3", "--eval-every", "3", env=env, cwd=cwd, timeout=600)
    assert json.loads((out / "training_summary.json").read_text())["backend"] == "mlx"
    versions = json.loads((out / "run_config.json").read_text())["versions"]
    assert versions["mlx"] and versions["mlx-lm"]
    run(ptbr, "train", "--backend", "mlx", "--output", tmp_path / "pt", "--seq-len", "32", "--batch-size", "2",
        "--max-steps", "2", "--eval-batches", "1", env=env, cwd=cwd, timeout=600)
    assert (tmp_path / "pt" / "final" / "model.safetensors").is_file()
    answer = run(ptbr, "generate", "--backend", "mlx", "--model", toy.base, "--adapter", out / "adapters",
                 "Qual é o número 3 do Porto?", "--temperature", "0", "--max-new-tokens", "4", env=env, cwd=cwd)
    assert answer.stdout.strip()
    run(ptbr, "export-adapter", out / "adapters", "--to", "peft", "--output", tmp_path / "peft", env=env, cwd=cwd)
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    run(ptbr, "merge", "--base", toy.base, "--adapter", out / "adapters", "--output", tmp_path / "merged", env=env,
        cwd=cwd)  # MLX merges where torch is missing
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    smoke = run(ptbr, "smoke", "--backend", "mlx", env=env, cwd=cwd, timeout=600)
    assert "smoke ok" in smoke.stdout
    refused = subprocess.run([ptbr, "train", "--backend", "torch", "--output", tmp_path / "t"], capture_output=True,
                             text=True, env=env, cwd=cwd)
    assert refused.returncode == 5 and "needs torch, which is not installed" in refused.stderr
