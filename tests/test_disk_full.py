"""A full disk, a file-size limit or a quota while ptbr writes: one line, exit 6, and what was saved
before is intact — for every writer (checkpoint weights and states, metrics, final/, adapters, merged
models, prepare's token files, preflight reports).

The limit is real: RLIMIT_FSIZE makes the kernel refuse writes past N bytes with EFBIG, whichever
library writes (Python, safetensors' Rust, torch's C++). Python ignores SIGXFSZ, so the write fails
instead of the process dying. Runs through the CLI use a subprocess with the limit; in-process
writers lower the limit around one call and restore it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

import tests.test_finetune as finetune_tests
from ptbr.errors import OutputError
from ptbr.train.checkpoint import read_state

toy = finetune_tests.toy
TINY = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--eval-every", "0",
        "--eval-batches", "1"]
MB = 1024 * 1024


@contextmanager
def file_size_limit(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def ptbr_limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    def limit_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return subprocess.run([sys.executable, "-m", "ptbr", *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_files)


def assert_disk_full_line(run: subprocess.CompletedProcess, what: str) -> None:
    assert run.returncode == 6, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the disk filled up (or a file size limit or quota was hit) while writing " + what)
    assert "what was saved before is intact" in line
    assert "Traceback" not in run.stderr and "Logging error" not in run.stderr


def ptbr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ptbr", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("limit, broken", [
    (1 * MB, "model.safetensors"),  # the tiny model's weights (4.3 MB) do not fit: safetensors (Rust) fails
    (6 * MB, "optimizer.pt"),  # the weights fit, AdamW's state (8.5 MB) does not: torch.save (C++) fails
])
def test_checkpoint_writers_keep_the_previous_checkpoint(tmp_path, limit, broken):
    out = tmp_path / "run"
    assert ptbr("train", "--output", str(out), *TINY, "--max-steps", "2", "--save-every", "2").returncode == 0
    run = ptbr_limited(limit, "train", "--output", str(out), *TINY, "--max-steps", "4", "--save-every", "2")
    assert_disk_full_line(run, "the checkpoint of step 4")
    # a lower --keep-last alone frees nothing before the save that failed: the line says what can go
    assert (f"fix: free space (older checkpoints in {out / 'checkpoints'} can go: a run resumes from its newest), or "
            "keep fewer with a lower --keep-last (they are removed after each save, so N holds N + 1 for a moment)"
            in run.stderr)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]  # no half-written one
    assert read_state(out / "checkpoints" / "step_000002")["step"] == 2
    assert not list(out.glob(".tmp-*")) and not list((out / "checkpoints").glob(".tmp-*"))
    # and the run resumes from it once there is room again
    again = ptbr("train", "--output", str(out), *TINY, "--max-steps", "4", "--save-every", "2")
    assert again.returncode == 0 and "resuming from" in again.stderr


def test_metrics_rows(tmp_path):
    from ptbr.train.metrics import MetricsLog, read_metrics

    log = MetricsLog(tmp_path)
    log.write({"step": 1, "loss": 2.0})
    with file_size_limit((tmp_path / "metrics.jsonl").stat().st_size + 10), pytest.raises(OutputError) as caught:
        log.write({"step": 2, "loss": 1.5})
    assert "while writing metrics.jsonl" in caught.value.one_line()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # the cut line is not read


def _tiny_model():
    from ptbr.backends.torch.models import build_model
    from ptbr.config import PRESETS

    return build_model(PRESETS["tiny"], 300, eos_id=0, seed=0)


def test_final_model(tmp_path):
    from ptbr.files import write_directory

    model = _tiny_model()
    final = tmp_path / "final"
    write_directory(final, lambda d: model.save_pretrained(str(d)), "the final model")
    before = load_file(str(final / "model.safetensors"))
    with file_size_limit(MB), pytest.raises(OutputError) as caught:
        write_directory(final, lambda d: _tiny_model().save_pretrained(str(d)), "the final model")
    assert "while writing the final model" in caught.value.one_line()
    after = load_file(str(final / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_adapter_and_merged_model(toy, tmp_path):
    """`ptbr finetune` (the adapter) and `ptbr merge` (the merged model) under a limit below their
    largest file: exit 6, the previous adapter and merged model untouched."""
    out = tmp_path / "run"

    def finetune(max_steps: int) -> list[str]:
        return ["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(out), "--quant", "none",
                "--lora-r", "8", "--batch-size", "8", "--max-steps", str(max_steps), "--eval-every", "1"]

    assert ptbr(*finetune(2)).returncode == 0
    adapter = (out / "adapters" / "adapter_model.safetensors").read_bytes()
    # room for metrics, logs and JSON, not for an adapter (nor a checkpoint, which holds it too)
    run = ptbr_limited(len(adapter) // 2, *finetune(4))
    assert run.returncode == 6, run.stderr
    assert "what was saved before is intact" in run.stderr.splitlines()[-1] and "Traceback" not in run.stderr
    assert (out / "adapters" / "adapter_model.safetensors").read_bytes() == adapter

    merged = tmp_path / "merged"
    assert ptbr("merge", "--base", str(toy.base), "--adapter", str(out / "adapters"), "--output",
                str(merged)).returncode == 0
    weights = (merged / "model.safetensors").read_bytes()
    run = ptbr_limited(len(weights) // 2, "merge", "--base", str(toy.base), "--adapter", str(out / "adapters"),
                       "--output", str(merged))
    assert_disk_full_line(run, "the merged model")
    assert (merged / "model.safetensors").read_bytes() == weights


def test_prepare_never_leaves_a_dataset_that_looks_complete(tmp_path, corpus_dir):
    data = tmp_path / "data"
    assert ptbr("prepare", "--input", str(corpus_dir), "--output", str(data), "--vocab-size", "400").returncode == 0
    meta = (data / "meta.json").read_text()
    train = (data / "train.bin").read_bytes()
    files = sorted(p.name for p in data.iterdir())
    # a bigger corpus whose token file cannot be written whole
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(f"Parágrafo {i}: " + "palavra " * 40 for i in range(4000)), encoding="utf-8")
    run = ptbr_limited(200_000, "prepare", "--input", str(big), "--output", str(data), "--vocab-size", "400")
    assert_disk_full_line(run, "the dataset")
    # the previous dataset is intact and nothing half-written is left
    assert (data / "meta.json").read_text() == meta and (data / "train.bin").read_bytes() == train
    assert sorted(p.name for p in data.iterdir()) == files
    # into a new directory: nothing that a run would take for a dataset
    fresh = tmp_path / "fresh"
    run = ptbr_limited(200_000, "prepare", "--input", str(big), "--output", str(fresh), "--vocab-size", "400")
    assert run.returncode == 6
    assert not (fresh / "train.bin").exists() and not (fresh / "meta.json").exists()


def test_an_interrupted_swap_is_refused_as_incomplete(tmp_path, corpus_dir):
    """The moment between moving the token files in and meta.json: a crash there leaves the
    marker, and every command refuses the directory instead of training on it."""
    from ptbr.data.tokens import INCOMPLETE_MARKER

    data = tmp_path / "data"
    assert ptbr("prepare", "--input", str(corpus_dir), "--output", str(data), "--vocab-size", "400").returncode == 0
    (data / INCOMPLETE_MARKER).write_text("")
    (data / "meta.json").unlink()
    run = ptbr("train", "--data", str(data), "--output", str(tmp_path / "run"), *TINY, "--max-steps", "1")
    assert run.returncode == 3 and "did not finish" in run.stderr.splitlines()[-1]
    # a first prepare cut right after moving tokenizer.json in: its marker and that file only; the
    # same prepare again (what the message says) completes it, not refused as a tokenizer's folder
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / INCOMPLETE_MARKER).write_text("")
    (cut / "tokenizer.json").write_bytes((data / "tokenizer.json").read_bytes())
    again = ptbr("prepare", "--input", str(corpus_dir), "--output", str(cut), "--vocab-size", "400")
    assert again.returncode == 0, again.stderr
    assert (cut / "meta.json").is_file() and not (cut / INCOMPLETE_MARKER).exists()


def test_preflight_report(tmp_path):
    run = ptbr_limited(2000, "preflight", "--model-size", "tiny", "--seq-len", "64", "--output", str(tmp_path))
    assert_disk_full_line(run, "preflight_report.json")
    assert [p.name for p in tmp_path.iterdir()] == []  # no half-written report, and no config without its report


def test_run_config_and_summary_json(tmp_path):
    from ptbr.files import write_json

    write_json(tmp_path / "training_summary.json", {"steps": 1})
    with file_size_limit(20), pytest.raises(OutputError):
        write_json(tmp_path / "training_summary.json", {"steps": 2, "padding": "x" * 100})
    assert json.loads((tmp_path / "training_summary.json").read_text()) == {"steps": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["training_summary.json"]


def test_a_write_torch_fails_without_a_reason_is_a_full_disk_only_where_it_can_be(tmp_path, monkeypatch):
    """torch.save's C++ writer hides the errno ("PytorchStreamWriter failed ..."). Where the disk
    has room and no file size limit is set, "the disk filled up; free space" would send the user
    the wrong way (an I/O error, a read-only file system, a quota): the message says what is known."""
    import ptbr.files as files

    failed = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                          "data/0: file write failed")
    monkeypatch.setattr(files, "_file_size_limited", lambda: False)
    error = files.write_error(failed, "the checkpoint of step 4", tmp_path)
    assert error.what.startswith("cannot write the checkpoint of step 4: ") and "torch gives no reason" in error.what
    assert error.fix.startswith("check the output's disk: a quota, an I/O error, or a file system gone read-only")
    monkeypatch.setattr(files, "_free_bytes", lambda path: 10 * MB)  # nearly full: that is the likely cause
    assert files.write_error(failed, "the checkpoint of step 4", tmp_path).what.startswith("the disk filled up")
    monkeypatch.setattr(files, "_free_bytes", lambda path: 10**12)
    monkeypatch.setattr(files, "_file_size_limited", lambda: True)  # ulimit -f: the limit is the likely cause
    assert files.write_error(failed, "the checkpoint of step 4", tmp_path).what.startswith("the disk filled up")


# ---- MLX: mx.save_safetensors says only "[write] Unable to write N bytes to file." ----------------


def needs_mlx() -> None:
    """Skip where MLX or mlx-lm is missing (mlx-lm imported through ptbr, which keeps the open-file
    limit: see tests/conftest.py)."""
    pytest.importorskip("mlx.core")
    from ptbr.backends.mlx.file_limit import load_mlx_lm

    try:
        load_mlx_lm()
    except ImportError:
        pytest.skip("mlx_lm is not installed")


@pytest.mark.slow
def test_mlx_checkpoint_writers_keep_the_previous_checkpoint(tmp_path):
    """An MLX run's checkpoint (model.safetensors, optimizer.safetensors: MLX's C++ writer, which
    hides the errno): the full-disk line and exit 6, as on torch, not "unexpected RuntimeError ...
    bug in ptbr" (exit 1)."""
    needs_mlx()
    out = tmp_path / "run"
    mlx = ["train", "--backend", "mlx", "--output", str(out), *TINY, "--save-every", "2"]
    assert ptbr(*mlx, "--max-steps", "2").returncode == 0
    weights = (out / "checkpoints" / "step_000002" / "model.safetensors").read_bytes()
    # 6 MB: the weights (4.3 MB) fit, AdamW's state (8.5 MB) does not; 1 MB: the weights do not
    for limit in (6 * MB, 1 * MB):
        run = ptbr_limited(limit, *mlx, "--max-steps", "4")
        assert_disk_full_line(run, "the checkpoint of step 4: [write] Unable to write ")
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]
        assert (out / "checkpoints" / "step_000002" / "model.safetensors").read_bytes() == weights
        assert not list(out.glob(".tmp-*")) and not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_mlx_final_model_adapter_and_merged_model(toy, tmp_path):
    """The other MLX writers (write_hf_model, write_adapter, merge_into) under a limit below their
    weights: the full-disk OutputError, the previous version untouched."""
    needs_mlx()
    from ptbr.backends.mlx import MlxBackend
    from ptbr.backends.mlx.models import build_model, hf_config, write_hf_model
    from ptbr.config import PRESETS
    from ptbr.files import write_directory
    from ptbr.finetune.merge import _merge_with_mlx
    from ptbr.runs.finetune import run_finetune

    def refused(limit: int, write, what: str) -> None:
        with file_size_limit(limit), pytest.raises(OutputError) as caught:
            write()
        line = caught.value.one_line()
        assert line.startswith(f"error: the disk filled up (or a file size limit or quota was hit) while writing "
                               f"{what}: [write] Unable to write "), line
        assert line.endswith("; fix: free space where the output goes; what was saved before is intact")

    final = tmp_path / "final"
    model = build_model(PRESETS["tiny"], 300, seed=0, pad_id=None)
    config = hf_config(PRESETS["tiny"], 300, eos_id=0, pad_id=None)
    write_directory(final, lambda d: write_hf_model(model, config, d), "the final model")
    before = (final / "model.safetensors").read_bytes()
    refused(MB, lambda: write_directory(final, lambda d: write_hf_model(model, config, d), "the final model"),
            "the final model")
    assert (final / "model.safetensors").read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["final"]

    run = tmp_path / "run"
    result = run_finetune(finetune_tests.settings(toy, run, backend="mlx", device="cpu", max_steps=1, eval_every=0,
                                                  save_every=0))
    adapters = run / "adapters"
    adapter = (adapters / "adapters.safetensors").read_bytes()
    backend = MlxBackend.create("cpu", "fp32")
    refused(len(adapter) // 2, lambda: write_directory(adapters, lambda d: backend.write_adapter(result.adapted, d),
                                                       "the adapter"), "the adapter")
    assert (adapters / "adapters.safetensors").read_bytes() == adapter

    merged = tmp_path / "merged"
    _merge_with_mlx(str(toy.base), adapters, merged, "auto", False, False)
    weights = (merged / "model.safetensors").read_bytes()
    refused(len(weights) // 2, lambda: _merge_with_mlx(str(toy.base), adapters, merged, "auto", False, False),
            "the merged model")
    assert (merged / "model.safetensors").read_bytes() == weights


def test_mlx_writes_that_fail_without_a_reason_are_said_as_torch_ones_are(tmp_path, monkeypatch):
    """MLX's writer hides the errno as torch.save's does: a full disk where little space is left or
    a size limit is set; elsewhere what is known, naming MLX."""
    import ptbr.files as files

    failed = RuntimeError("[write] Unable to write 29776 bytes to file.")
    monkeypatch.setattr(files, "_file_size_limited", lambda: False)
    monkeypatch.setattr(files, "_free_bytes", lambda path: 100 * 1024**3)
    error = files.write_error(failed, "the adapter", tmp_path)
    assert error.one_line() == (f"error: cannot write the adapter: [write] Unable to write 29776 bytes to file. (MLX "
                                f"gives no reason; 100.0 GiB are free there) ({tmp_path}); fix: check the output's "
                                "disk: a quota, an I/O error, or a file system gone read-only; what was saved before "
                                "is intact")
    opened = RuntimeError(f"[save_safetensors] Failed to open file {tmp_path}/adapters.safetensors")
    assert "(MLX gives no reason; " in files.write_error(opened, "the adapter", tmp_path).what
    monkeypatch.setattr(files, "_file_size_limited", lambda: True)
    for exc in (failed, opened):
        assert files.write_error(exc, "the adapter", tmp_path).what.startswith(
            "the disk filled up (or a file size limit or quota was hit) while writing the adapter: ")
    assert files.write_error(RuntimeError("[load] something else"), "the adapter", tmp_path) is None
