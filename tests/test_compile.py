"""`ptbr train --compile`: the forward pass through torch.compile (with the whole logits' loss, or
the decoder alone with the chunked loss eager). The compiled step
trains the model the eager one does (to float rounding), resumes bit for bit, accumulates like
one big batch, and is refused in one line where it cannot run."""

from __future__ import annotations

import shutil

import pytest
import torch

from ptbr.cli import main
from tests.test_training import metrics, train, weights


def compiled_train(output, *extra) -> dict:
    """`ptbr train --compile` in fp32 (against eager fp32 to float rounding: bf16 autocast, auto on a
    CPU with native bf16, would round each multiply to 8 bits); returns dynamo's counters for that
    run (graphs made, graph breaks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    train(output, "--compile", "--precision", "fp32", *extra)
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
    """--compile with the whole logits (--no-chunked-loss): the forward pass and the loss compiled
    together."""
    eager, once, twice = tmp_path / "eager", tmp_path / "once", tmp_path / "twice"
    whole = ("--max-steps", "6", "--save-every", "3", "--no-chunked-loss")
    train(eager, *whole, "--precision", "fp32")
    made = compiled_train(once, *whole)
    # the step really ran compiled: one graph (forward and loss, its backward with it), no break
    assert made == {"graphs": 1, "breaks": {}}
    assert not torch.are_deterministic_algorithms_enabled()  # the mode was the step's only
    assert "--compile: the first step compiles" in capsys.readouterr().err
    # the same training to float rounding (fused kernels sum in another order)
    assert [r["loss"] for r in metrics(once)] == pytest.approx([r["loss"] for r in metrics(eager)], rel=1e-5)
    validated = [[r["val_loss"] for r in metrics(run) if r["val_loss"] is not None] for run in (once, eager)]
    assert len(validated[0]) == 2 and validated[0] == pytest.approx(validated[1], rel=1e-5)
    assert_same_training(weights(once / "final"), weights(eager / "final"))

    # a compiled run that died after step 3 resumes to the uninterrupted compiled run, bit for bit
    compiled_train(twice, *whole)
    shutil.rmtree(twice / "checkpoints" / "step_000006")
    shutil.rmtree(twice / "final")
    compiled_train(twice, *whole)
    a, b = weights(once / "final"), weights(twice / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert [r["loss"] for r in metrics(twice)] == [r["loss"] for r in metrics(once)]


@pytest.mark.slow
def test_compiled_chunked_loss_is_the_eager_one_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """--compile with the chunked loss (chunks of 40 tokens here: a micro-batch of 4 x 32 makes four):
    the decoder is compiled (one graph, no break) and the loss runs eager on its hidden states;
    the same training as the eager chunked loss to float rounding, and a resumed run is the
    uninterrupted one bit for bit."""
    from ptbr import memory

    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * 2048 * 40)
    eager, once, twice = tmp_path / "eager", tmp_path / "once", tmp_path / "twice"
    train(eager, "--precision", "fp32")
    assert compiled_train(once) == {"graphs": 1, "breaks": {}}
    line = "chunked loss: 40 tokens per chunk at vocabulary 2,048; micro-batches of 128 tokens are chunked"
    assert line in (once / "train.log").read_text() and line in (eager / "train.log").read_text()
    assert [r["loss"] for r in metrics(once)] == pytest.approx([r["loss"] for r in metrics(eager)], rel=1e-5)
    validated = [[r["val_loss"] for r in metrics(run) if r["val_loss"] is not None] for run in (once, eager)]
    assert len(validated[0]) == 2 and validated[0] == pytest.approx(validated[1], rel=1e-5)
    assert_same_training(weights(once / "final"), weights(eager / "final"))

    compiled_train(twice)
    shutil.rmtree(twice / "checkpoints" / "step_000006")
    shutil.rmtree(twice / "final")
    compiled_train(twice)
    a, b = weights(once / "final"), weights(twice / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert [r["loss"] for r in metrics(twice)] == [r["loss"] for r in metrics(once)]


@pytest.mark.slow
def test_compiled_accumulation_is_one_big_batch(tmp_path):
    compiled_train(tmp_path / "big", "--batch-size", "8", "--grad-accum", "1", "--max-steps", "3")
    # with gradient checkpointing too: still one graph, no break
    assert compiled_train(tmp_path / "acc", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "3",
                          "--gradient-checkpointing") == {"graphs": 1, "breaks": {}}
    assert_same_training(weights(tmp_path / "acc" / "final"), weights(tmp_path / "big" / "final"))
    assert [r["loss"] for r in metrics(tmp_path / "acc")] == pytest.approx(
        [r["loss"] for r in metrics(tmp_path / "big")], rel=1e-5)


@pytest.mark.slow
def test_compiled_bf16_autocast_is_one_graph_and_resumes_bit_for_bit(tmp_path):
    """bf16 autocast is what --precision auto trains in on a CPU that computes bf16 natively:
    --compile there is still one graph without a break, and a resumed run is the uninterrupted one."""
    once, twice = tmp_path / "once", tmp_path / "twice"
    bf16 = ("--precision", "bf16", "--max-steps", "4", "--save-every", "2")  # the last --precision given wins
    assert compiled_train(once, *bf16) == {"graphs": 1, "breaks": {}}
    compiled_train(twice, *bf16)
    shutil.rmtree(twice / "checkpoints" / "step_000004")
    shutil.rmtree(twice / "final")
    compiled_train(twice, *bf16)
    a, b = weights(once / "final"), weights(twice / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert [r["loss"] for r in metrics(twice)] == [r["loss"] for r in metrics(once)]


@pytest.mark.slow
def test_compiled_whole_logits_where_the_gpu_rule_takes_them(tmp_path, monkeypatch):
    """On a CUDA GPU in bf16/fp16, --compile takes the whole 16-bit logits, chunked loss or not
    (ptbr.memory.compiled_whole_logits). The rule widened to the CPU here: the start-up line says so,
    the forward pass and the loss are one graph without a break, and the run trains as the eager
    chunked loss does to bf16 rounding; in fp32 the same run keeps the chunked loss."""
    from ptbr import memory
    from ptbr.backends.torch.step import TorchStep

    monkeypatch.setattr(memory, "COMPILED_WHOLE_DEVICES", ("cpu",))
    eager, compiled, fp32 = tmp_path / "eager", tmp_path / "compiled", tmp_path / "fp32"
    decoder_alone = TorchStep._decoder_hidden_states  # what the compiled chunked path runs
    calls = []
    monkeypatch.setattr(TorchStep, "_decoder_hidden_states", lambda *a: calls.append(1) or decoder_alone(*a))
    compiled_train(fp32, "--max-steps", "2")
    assert "micro-batches of 128 tokens take one chunk" in (fp32 / "train.log").read_text() and calls
    calls.clear()
    bf16 = ("--precision", "bf16", "--max-steps", "4")
    train(eager, *bf16)
    counted = compiled_train(compiled, *bf16)
    assert calls == []  # not the decoder alone: the forward pass with the whole logits' loss
    assert counted == {"graphs": 1, "breaks": {}}
    line = ("chunked loss: not under --compile here: micro-batches of 128 tokens take the whole 16-bit logits "
            "(vocabulary 2,048), compiled with the forward pass")
    assert line in (compiled / "train.log").read_text() and line not in (eager / "train.log").read_text()
    # the same training to bf16 rounding (measured: 3e-5 apart)
    assert [r["loss"] for r in metrics(compiled)] == pytest.approx([r["loss"] for r in metrics(eager)], rel=1e-3)


@pytest.mark.slow
def test_a_step_of_one_micro_batch_takes_the_cuda_graphs_path(tmp_path, monkeypatch):
    """--cuda-graphs (the default) under --compile: a step of one micro-batch runs the loss compiled
    in torch.compile's reduce-overhead mode, marking each step's start for its CUDA graphs; a step
    of several micro-batches the plain compiled loss. The CUDA graphs themselves need a GPU
    (tests/test_gpu.py): here their refusal off the GPU is lifted, and inductor, which records no
    CUDA graphs of CPU tensors, runs the same kernels, so the run trains as the plain compiled one."""
    from ptbr.backends.torch import compiled

    plain, graphed, accumulated = tmp_path / "plain", tmp_path / "graphed", tmp_path / "accumulated"
    whole = ("--no-chunked-loss", "--max-steps", "4", "--save-every", "2", "--eval-every", "2")
    compiled_train(plain, *whole, "--no-cuda-graphs")
    monkeypatch.setattr(compiled, "cuda_graphs_refusal", lambda device, checkpointing: None)
    steps, mark = [], torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append("mark") or mark())
    compile_loss = compiled.compile_loss

    def counted(loss, cuda_graphs=False):  # the graphed loss, each call of it counted
        function = compile_loss(loss, cuda_graphs)
        return (lambda *args: steps.append("graphed") or function(*args)) if cuda_graphs else function

    monkeypatch.setattr(compiled, "compile_loss", counted)
    assert compiled_train(graphed, *whole) == {"graphs": 1, "breaks": {}}
    assert steps == ["mark", "graphed"] * 4  # every step through the graphed loss, its start marked first
    assert ("each step's compiled forward and backward passes then replay as CUDA graphs"
            in (graphed / "train.log").read_text())
    assert [r["loss"] for r in metrics(graphed)] == [r["loss"] for r in metrics(plain)]
    assert_same_training(weights(graphed / "final"), weights(plain / "final"))

    steps.clear()
    compiled_train(accumulated, *whole, "--batch-size", "2", "--grad-accum", "2")
    assert steps == []  # two micro-batches a step: the plain compiled loss
    assert ("CUDA graphs: not with 2 micro-batches a step (a second replay would overwrite the first one's "
            "gradients; --grad-accum 1 with a larger --batch-size takes them)" in (accumulated / "train.log").read_text())
    assert [r["loss"] for r in metrics(accumulated)] == pytest.approx([r["loss"] for r in metrics(plain)], rel=1e-5)


@pytest.mark.slow
def test_a_compiled_run_out_of_memory_continues_smaller_without_its_old_graphs(tmp_path, oom_above, monkeypatch):
    """--auto-fit under --compile (CUDA graphs' refusal lifted, as above): an out-of-memory at step 4
    of micro-batches of 4 lets the compiled code and its graphs go (torch._dynamo.reset, which also
    frees CUDA graphs' memory pool) before the run continues from step 2's checkpoint at 2 x 2,
    whose steps take the plain compiled loss (two micro-batches)."""
    from ptbr.backends.torch import compiled

    monkeypatch.setattr(compiled, "cuda_graphs_refusal", lambda device, checkpointing: None)
    events, compile_loss, reset = [], compiled.compile_loss, torch._dynamo.reset

    def counted(loss, cuda_graphs=False):
        function = compile_loss(loss, cuda_graphs)
        return (lambda *args: events.append("graphed") or function(*args)) if cuda_graphs else function

    monkeypatch.setattr(compiled, "compile_loss", counted)
    sizes = oom_above(limit=2, after_calls=5)  # the dry run (2 calls) and steps 1-3 fit at 4 rows
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append(("reset", len(sizes))) or reset())
    run = tmp_path / "run"
    compiled_train(run, "--no-chunked-loss", "--batch-size", "4", "--grad-accum", "1", "--max-steps", "6",
                   "--save-every", "2", "--auto-fit")
    log = (run / "train.log").read_text()
    assert "out of memory during the run" in log and "batch_size 2 x grad_accum 2" in log
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    assert events.count("graphed") == 3  # steps 1-3 at 4 x 1; none at 2 x 2
    assert ("reset", 6) in events  # after the failed 6th call, before the run went on


def test_cuda_graphs_are_torch_compile_s_reduce_overhead_mode(monkeypatch):
    from ptbr.backends.torch.compiled import compile_loss

    asked = []
    monkeypatch.setattr(torch, "compile", lambda function, **options: asked.append(options) or function)
    compile_loss(print), compile_loss(print, cuda_graphs=True)
    assert asked == [{"dynamic": False, "mode": None}, {"dynamic": False, "mode": "reduce-overhead"}]


@pytest.mark.slow
def test_the_start_up_line_says_why_a_step_takes_no_cuda_graphs(tmp_path, monkeypatch):
    """Where the chunked loss runs eager on the compiled decoder (here fp32, on a CPU with the
    refusal lifted), and under accumulation, the --compile line says why the steps take no CUDA
    graphs; off a GPU, or with --no-cuda-graphs, it says nothing of them. The refusal is asked
    with the run's --gradient-checkpointing."""
    from ptbr.backends.torch import compiled

    compiled_train(tmp_path / "cpu", "--max-steps", "1")
    assert "CUDA graphs" not in (tmp_path / "cpu" / "train.log").read_text()
    asked = []
    monkeypatch.setattr(compiled, "cuda_graphs_refusal", lambda device, checkpointing: asked.append(checkpointing))
    compiled_train(tmp_path / "checkpointed", "--max-steps", "1", "--gradient-checkpointing")
    assert asked == [True]
    compiled_train(tmp_path / "chunked", "--max-steps", "1")
    assert asked == [True, False]
    assert ("--compile: the first step compiles the forward pass (with the loss where it takes the whole logits) "
            "with torch.compile (tens of seconds on a CPU; a later run of the same shapes reuses the compiled code); "
            "CUDA graphs: not where the chunked loss runs eager on the compiled decoder (fp32, or 16-bit logits "
            "above 1 GiB; --no-chunked-loss takes them)") in (tmp_path / "chunked" / "train.log").read_text()
    compiled_train(tmp_path / "off", "--max-steps", "1", "--no-cuda-graphs")
    assert "CUDA graphs" not in (tmp_path / "off" / "train.log").read_text()


def test_where_cuda_graphs_cannot_run():
    from ptbr.backends.torch.compiled import cuda_graphs_refusal

    assert cuda_graphs_refusal("cuda", False) is None
    assert cuda_graphs_refusal("cpu", False) == "CUDA graphs are for CUDA GPUs"
    assert cuda_graphs_refusal("cuda", True) == ("not with --gradient-checkpointing (its recomputation under "
                                                 "CUDA graphs is untested)")


def test_compile_is_refused_in_one_line_where_it_cannot_run(tmp_path, capsys, monkeypatch):
    from torch._inductor import config

    def refused(*args: str) -> str:
        assert main(["train", "--output", str(tmp_path / "run"), "--compile", "--max-steps", "1", *args]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert not (tmp_path / "run").exists()  # refused before the run directory is made
        return line

    assert refused("--backend", "mlx") == (
        "error: --compile: a torch backend option (the MLX backend always compiles its step) (--backend mlx); "
        "fix: leave these torch options out with --backend mlx, or use --backend torch")
    # refused before any worker is started
    assert refused("--num-processes", "2", "--device", "cpu") == (
        "error: --compile: a run of 2 data-parallel processes (--compile is tested in one process only); "
        "fix: leave --compile out, or --num-processes 1")
    # the compiler inductor would call ($CXX as one command, read by torch when it is imported)
    with config.patch({"cpp.cxx": (None, "ccache g++")}):
        assert refused("--device", "cpu") == (
            "error: --compile: no C++ compiler found, which torch.compile needs on cpu (tried ccache g++; $CXX "
            "names another); fix: leave --compile out, or install one (e.g. apt install g++)")
        monkeypatch.setenv("PTBR_IMAGE_VARIANT", "cpu")  # ptbr's image: no compiler, no root, no network
        assert refused("--device", "cpu").endswith(
            "fix: leave --compile out, or build an image of your own with one (the ptbr-cpu image holds none, and "
            "has no network or root to add one)")
        monkeypatch.delenv("PTBR_IMAGE_VARIANT")
    with config.patch({"cpp.cxx": (None, "g++")}):
        monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
        assert "no C++ compiler found" in refused("--device", "cpu")


def test_what_stops_compile_on_a_gpu(monkeypatch):
    from ptbr.backends.torch.compiled import c_compilers, cuda_problems

    assert cuda_problems(True, (7, 5)) == []  # a T4
    assert cuda_problems(False, (6, 0)) == [  # Kaggle's P100 without Triton
        "Triton is not installed (torch.compile's GPU kernels; it comes with torch's CUDA wheels)",
        "the GPU's compute capability 6.0 is below the 7.0 that Triton needs"]
    monkeypatch.delenv("CC", raising=False)
    assert c_compilers() == ("gcc", "clang")  # what Triton tries, in its order
    monkeypatch.setenv("CC", "/opt/cc")
    assert c_compilers() == ("/opt/cc",)


def test_the_mlx_backend_refuses_compile_when_called_as_a_library(tmp_path):
    pytest.importorskip("mlx.core")
    from ptbr.config import PretrainConfig
    from ptbr.errors import ConfigError
    from ptbr.runs.pretrain import run_pretrain

    with pytest.raises(ConfigError, match="--compile: a torch backend option"):
        run_pretrain(PretrainConfig(output=str(tmp_path / "run"), backend="mlx", device="cpu", compile=True))
    assert not (tmp_path / "run").exists()


def test_preflight_checks_what_train_would_refuse():
    from torch._inductor import config

    from ptbr.config import PretrainConfig
    from ptbr.preflight.checks import check_compile_request
    from ptbr.preflight.hardware import Hardware

    machine = Hardware("Linux", 2, 8 << 30, 8 << 30)
    asked = PretrainConfig(compile=True)
    assert check_compile_request(PretrainConfig(), "cpu", machine) == []  # not asked for: no check
    with config.patch({"cpp.cxx": (None, "g++")}):
        assert [c.status for c in check_compile_request(asked, "cpu", machine)] == ["pass"]
        (check,) = check_compile_request(PretrainConfig(compile=True, num_processes="2"), "cpu", machine)
        assert check.status == "fail" and "--num-processes 1" in check.fix
    with config.patch({"cpp.cxx": (None, "no-such-compiler")}):
        (check,) = check_compile_request(asked, "cpu", machine)
    assert check.status == "fail" and "no C++ compiler found" in check.message and "install one" in check.fix
    (check,) = check_compile_request(asked, "mlx", machine)
    assert check.status == "fail" and "a torch backend option" in check.message


def test_preflight_says_what_cuda_graphs_will_do_on_a_gpu(monkeypatch):
    """On a CUDA target, preflight's --compile check says whether the steps will replay as CUDA
    graphs, as train's start-up line will (the GPU's own checks are train's, stubbed here)."""
    from ptbr.backends.torch import compiled
    from ptbr.config import PretrainConfig
    from ptbr.preflight.checks import check_compile_request
    from tests.test_preflight import MACHINES

    monkeypatch.setattr(compiled, "check_compile", lambda device, processes: None)
    machine = MACHINES["h100"]  # a GPU to check --compile against

    def said(**settings) -> str:
        (check,) = check_compile_request(PretrainConfig(compile=True, **settings), "cuda", machine)
        assert check.status == "pass"
        return check.message.split("; ", 1)[1] if "; " in check.message else ""

    assert said() == ("steps whose loss is compiled with the forward pass replay as CUDA graphs "
                      "(--no-cuda-graphs: without)")
    assert said(grad_accum=4) == ("CUDA graphs: not with 4 micro-batches a step (a second replay would overwrite "
                                  "the first one's gradients; --grad-accum 1 with a larger --batch-size takes them)")
    assert said(gradient_checkpointing=True) == ("CUDA graphs: not with --gradient-checkpointing (its recomputation "
                                                 "under CUDA graphs is untested)")
    assert said(cuda_graphs=False) == ""
    (check,) = check_compile_request(PretrainConfig(compile=True), "cpu", machine)
    assert "CUDA graphs" not in check.message


def test_preflight_and_train_agree_on_which_steps_replay_as_cuda_graphs(monkeypatch):
    """ptbr.memory.loss_compiled_with_forward is the one rule: preflight's --compile line on a CUDA
    target refuses CUDA graphs for exactly the micro-batches whose loss train's compiled step runs
    eager on the compiled decoder (fp32 under the chunked loss; 16-bit logits above 1 GiB), and says
    the steps replay otherwise (the step built on CPU, with the GPU's rule widened to it)."""
    from ptbr import memory
    from ptbr.backends.torch import compiled
    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import PretrainConfig, get_preset
    from ptbr.preflight.checks import check_compile_request
    from tests.test_preflight import MACHINES

    monkeypatch.setattr(memory, "COMPILED_WHOLE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(compiled, "check_compile", lambda device, processes: None)
    machine = MACHINES["h100"]  # a GPU to check --compile against
    vocab, preset = 32000, get_preset("tiny")
    arch = memory.Architecture.from_preset(preset, vocab)
    refused = {}
    for precision in ("fp32", "bf16"):
        for chunked in (True, False):
            model = build_model(preset, vocab, 0, 0)
            step = TorchStep(model, build_optimizer(model, PretrainConfig(), torch.device("cpu")),
                             resolve_precision(torch.device("cpu"), precision), 1.0, compile=True, chunked_loss=chunked)
            assert step.chunked_from() == (memory.chunked_loss_from(arch.hidden_size, precision) if chunked else None)
            for batch, seq in ((1, 64), (8, 256), (80, 256)):  # 80 x 256 tokens: 1.3 GB of bf16 logits
                planned = PretrainConfig(compile=True, precision=precision, chunked_loss=chunked, batch_size=batch,
                                         seq_len=seq)
                (check,) = check_compile_request(planned, "cuda", machine, arch, planned)
                said = check.message.split("; ", 1)[1]
                assert said in (f"CUDA graphs: {compiled.EAGER_LOSS_REFUSAL}", compiled.GRAPHS_REPLAY)
                refused[precision, chunked, batch] = said != compiled.GRAPHS_REPLAY
                assert refused[precision, chunked, batch] == (not step._compiles_whole(batch * seq))
    assert [key for key, no in refused.items() if no] == [("fp32", True, 1), ("fp32", True, 8), ("fp32", True, 80),
                                                         ("bf16", True, 80)]


def test_preflight_says_what_cuda_graphs_do_for_the_run_as_asked_with_auto_resolved(tmp_path, monkeypatch):
    """run_preflight's --compile check takes the flags as given (train does not take the plan's
    batch unless told to) with `auto`'s precision resolved for the GPU: on an H100, `auto` is bf16
    and the steps replay as CUDA graphs; `--precision fp32` runs the chunked loss eager; 8 x 4
    micro-batches take none, although the plan makes them 32 x 1 (as train's start-up line says)."""
    from ptbr.backends.torch import compiled
    from ptbr.config import PretrainConfig
    from ptbr.preflight import run_preflight
    from tests.test_preflight import MACHINES

    monkeypatch.setattr(compiled, "check_compile", lambda device, processes: None)

    plans = []

    def said(**settings) -> str:
        result = run_preflight(PretrainConfig(compile=True, output=str(tmp_path / "plan"), **settings),
                               MACHINES["h100"], write=False)
        plans.append(result.recommendation.settings)
        (check,) = [c for c in result.checks if c.name == "settings.compile"]
        return check.message.split("; ", 1)[1]

    assert said() == compiled.GRAPHS_REPLAY
    assert said(precision="fp32") == f"CUDA graphs: {compiled.EAGER_LOSS_REFUSAL}"
    assert said(precision="fp32", chunked_loss=False) == compiled.GRAPHS_REPLAY
    assert said(batch_size=8, grad_accum=4) == f"CUDA graphs: {compiled.accumulation_refusal(4)}"
    assert (plans[-1].batch_size, plans[-1].grad_accum) == (32, 1)
