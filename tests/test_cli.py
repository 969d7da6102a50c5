"""The CLI as a user meets it: fast help without torch, one-line errors, `ptbr smoke`."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import run_cli


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


def test_debug_shows_the_traceback(tmp_path):
    run = run_cli("train", "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "out"),
                  env={"PTBR_DEBUG": "1"})
    assert run.returncode != 0 and "Traceback" in run.stderr


def test_smoke_passes_in_a_subprocess():
    run = run_cli("smoke", timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("smoke ok: one step of tiny, loss ")


def test_test_gpu_without_a_gpu_says_so_and_probes_on_cpu():
    import torch

    run = run_cli("test-gpu", "--model-size", "tiny", "--vocab-size", "2048", "--seq-len", "64", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    if not torch.cuda.is_available():
        assert "no CUDA GPU found: running the probe on the CPU" in run.stdout
    assert "one training step of tiny (1,066,112 parameters) on cpu in fp32: batch 1 x 64, loss " in run.stdout
