"""`ptbr train --compile`: the forward pass and the loss through torch.compile. The compiled step
trains the model the eager one does (to float rounding), resumes bit for bit, accumulates like
one big batch, and is refused in one line where it cannot run."""

from __future__ import annotations

import shutil

import pytest
import torch

from ptbr.cli import main
from tests.test_training import metrics, train, weights


def compiled_train(output, *extra) -> dict:
    """`ptbr train --compile`; returns dynamo's counters for that run (graphs made, graph breaks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    train(output, "--compile", *extra)
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"])}


def assert_same_training(a: dict, b: dict) -> None:
    """Weights of two runs that differ only in float summation order. AdamW normalises each update,
    so a weight whose gradient is ~0 can move by a visible fraction of the learning rate (3e-3)
    one way or the other: a few such weights are allowed 1e-4, the whole model is 1e-7 on average.
    A wrong step (a missing micro-batch, a wrong scale) moves every weight by about the learning rate."""
    assert a.keys() == b.keys()
    differences = torch.cat([(a[name] - b[name]).abs().flatten() for name in a])
    assert differences.max() < 1e-4 and differences.mean() < 1e-7, (differences.max(), differences.mean())


@pytest.mark.slow
def test_compiled_training_is_eager_training_and_resumes_bit_for_bit(tmp_path, capsys):
    eager, once, twice = tmp_path / "eager", tmp_path / "once", tmp_path / "twice"
    train(eager, "--max-steps", "6", "--save-every", "3")
    made = compiled_train(once, "--max-steps", "6", "--save-every", "3")
    # the step really ran compiled: one graph (forward and loss, its backward with it), no break
    assert made == {"graphs": 1, "breaks": {}}
    assert "--compile: the first step compiles" in capsys.readouterr().err
    # the same training to float rounding (fused kernels sum in another order)
    assert [r["loss"] for r in metrics(once)] == pytest.approx([r["loss"] for r in metrics(eager)], rel=1e-5)
    validated = [[r["val_loss"] for r in metrics(run) if r["val_loss"] is not None] for run in (once, eager)]
    assert len(validated[0]) == 2 and validated[0] == pytest.approx(validated[1], rel=1e-5)
    assert_same_training(weights(once / "final"), weights(eager / "final"))

    # a compiled run that died after step 3 resumes to the uninterrupted compiled run, bit for bit
    compiled_train(twice, "--max-steps", "6", "--save-every", "3")
    shutil.rmtree(twice / "checkpoints" / "step_000006")
    shutil.rmtree(twice / "final")
    compiled_train(twice, "--max-steps", "6", "--save-every", "3")
    a, b = weights(once / "final"), weights(twice / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert [r["loss"] for r in metrics(twice)] == [r["loss"] for r in metrics(once)]


@pytest.mark.slow
def test_compiled_accumulation_is_one_big_batch(tmp_path):
    compiled_train(tmp_path / "big", "--batch-size", "8", "--grad-accum", "1", "--max-steps", "3")
    compiled_train(tmp_path / "acc", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "3")
    assert_same_training(weights(tmp_path / "acc" / "final"), weights(tmp_path / "big" / "final"))
    assert [r["loss"] for r in metrics(tmp_path / "acc")] == pytest.approx(
        [r["loss"] for r in metrics(tmp_path / "big")], rel=1e-5)


def test_compile_is_refused_in_one_line_where_it_cannot_run(tmp_path, capsys, monkeypatch):
    def refused(*args: str) -> str:
        assert main(["train", "--output", str(tmp_path / "run"), "--compile", "--max-steps", "1", *args]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert not (tmp_path / "run").exists()  # refused before the run directory is made
        return line

    assert refused("--backend", "mlx") == (
        "error: --compile: a torch backend option (the MLX backend always compiles its step) (--backend mlx); "
        "fix: leave these options out with --backend mlx (it trains in one process), or use --backend torch")
    # refused before any worker is started
    assert refused("--num-processes", "2", "--device", "cpu") == (
        "error: --compile: a run of 2 data-parallel processes (--compile is tested in one process only); "
        "fix: leave --compile out")
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert refused("--device", "cpu") == (
        "error: --compile: no C++ compiler found, which torch.compile needs on cpu (none of g++, c++, clang++ on "
        "PATH, nor $CXX); fix: leave --compile out, or install one (e.g. apt install g++)")
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    assert "no C++ compiler found" in refused("--device", "cpu")


def test_the_mlx_backend_refuses_compile_when_called_as_a_library(tmp_path):
    pytest.importorskip("mlx.core")
    from ptbr.config import PretrainConfig
    from ptbr.errors import ConfigError
    from ptbr.runs.pretrain import run_pretrain

    with pytest.raises(ConfigError, match="--compile: a torch backend option"):
        run_pretrain(PretrainConfig(output=str(tmp_path / "run"), backend="mlx", device="cpu", compile=True))
    assert not (tmp_path / "run").exists()
