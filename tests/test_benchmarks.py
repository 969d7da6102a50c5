"""The speed benchmark runs and writes its table (a check that it works, not a timed test: no
ratio is asserted, only that every row is there and its numbers are numbers)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
WITHOUT_A_GPU = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"ptbr_{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_speed():
    return load_benchmark("speed")


@pytest.mark.slow
def test_quick_speed_benchmark_writes_every_row(tmp_path):
    from ptbr.backends.torch.device import cpu_has_native_bf16

    speed = load_speed()
    speed.main(["--quick", "--output-dir", str(tmp_path)])
    result = json.loads((tmp_path / "speed_cpu_quick.json").read_text())
    found = {(row["section"], row["metric"], row["reference"]) for row in result["rows"]}
    # the machine is named with what decides its fp32 and bf16 rows most
    from ptbr.backends.torch.device import cpu_bf16_units

    units = " and ".join(cpu_bf16_units()) or "no native bf16"
    assert f", {units}, {os.cpu_count()} CPU cores, torch " in result["conditions"]["machine"]
    assert {
        ("pretrain", "tokens/s", "HF Trainer"),
        ("pretrain", "tokens/s", "plain PyTorch loop"),
        ("pretrain", "tokens/s", "ptbr --no-chunked-loss"),  # the chunked loss (one chunk here) alone
        ("pretrain", "tokens/s", "HF Trainer, torch_compile=True"),  # ptbr --compile against the compiled Trainer
        ("startup", "seconds", "HF Trainer"),  # command to first step
        ("finetune", "tokens/s", "transformers + PEFT Trainer"),
        ("finetune", "peak resident memory", "transformers + PEFT Trainer"),
        ("data", "MB/s", "tokenizers directly"),
    } <= found
    assert any(row["name"] == "`ptbr --help` start-up" for row in result["rows"] if row["section"] != "mlx")
    finetune = [r for r in result["rows"] if r["section"] == "finetune" and "32k vocabulary" not in r["name"]]
    assert len(finetune) == 4  # LoRA and QLoRA, speed and memory
    # QLoRA at Mistral-7B's 32k vocabulary, where the chunked loss makes several chunks: against PEFT and
    # ptbr's own whole logits
    large = [r for r in result["rows"] if r["section"] == "finetune" and "32k vocabulary" in r["name"]]
    assert {(row["metric"], row["reference"]) for row in large} == {
        (metric, reference) for metric in ("tokens/s", "peak resident memory")
        for reference in ("transformers + PEFT Trainer", "ptbr --no-chunked-loss")} and len(large) == 4
    assert all(row["command"].startswith("ptbr finetune --base BASE ") for row in large)
    for row in result["rows"]:
        for key in ("reference_value", "ptbr_value", "ratio"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (row["name"], key)
        assert row["command"].startswith(("ptbr ", "python benchmarks/"))
    pretrain = [row for row in result["rows"] if row["section"] == "pretrain" and "32k vocabulary" not in row["name"]]
    large = [row for row in result["rows"] if row["section"] == "pretrain" and "32k vocabulary" in row["name"]
             and "--compile" not in row["name"]]
    # and under --compile (the decoder compiled, the chunked loss eager) against --compile's whole logits
    large_compiled = [row for row in result["rows"] if "32k vocabulary" in row["name"] and "--compile" in row["name"]]
    assert [(row["metric"], row["reference"]) for row in large_compiled] == [
        ("tokens/s", "ptbr --compile --no-chunked-loss"), ("peak resident memory", "ptbr --compile --no-chunked-loss")]
    assert all(row["command"].endswith(" --compile") for row in large_compiled)
    # at a 32k vocabulary, where the chunked loss makes several chunks: speed and memory against three references
    assert {(row["metric"], row["reference"]) for row in large} == {
        (metric, reference) for metric in ("tokens/s", "peak resident memory")
        for reference in ("HF Trainer", "plain PyTorch loop", "ptbr --no-chunked-loss")} and len(large) == 6
    assert all(row["command"].startswith("ptbr train --data DATA ") for row in large)
    compiled = [row for row in pretrain if row["command"].endswith(" --compile")]
    defaults = [row for row in pretrain if "--precision auto" in row["command"]]
    # on a CPU that computes bf16 natively, also ptbr's default (bf16 autocast) against the Trainer's
    # fp32 default and its bf16=True; each ptbr run says the precision it resolved
    assert len(defaults) == (2 if cpu_has_native_bf16() else 0)
    # ptbr: three references (the Trainer, the plain loop, its own whole logits); ptbr --compile: two
    assert len(pretrain) == 5 + len(defaults) and len(compiled) == 2
    for row in pretrain:
        ours = next(runs for name, runs in row["runs"].items() if name.startswith("ptbr"))
        assert {run["precision"] for run in ours} == {"bf16" if row in defaults else "fp32"}, row["name"]
    assert [row["reference"] for row in defaults] == ["HF Trainer (its default: fp32)", "HF Trainer, bf16=True"][:len(defaults)]
    # the compile is reported apart: seconds more before the first step, measured from an empty cache
    assert all(row["compile_s"] > 0 and "break_even_steps" in row for row in compiled)
    # the kernels every contender runs alike (multiplies, attention, AdamW) bound any trainer's ratio:
    # a number > 0 on the Trainer's row, each group timed as it runs (under a dispatch mode)
    floor = [row for row in pretrain if "kernel_ceiling" in row]
    assert len(floor) == 1 and floor[0]["reference"] == "HF Trainer" and floor[0] not in compiled
    assert set(floor[0]["kernels_s"]) == {"matrix multiplies", "attention", "AdamW"}
    assert all(seconds > 0 for seconds in floor[0]["kernels_s"].values())
    # (the kernels are timed in steps apart from the step without the clock: on a loaded machine
    # their sum can exceed it, and the share is then capped at 1, the note reading no bound from it)
    assert 0 < floor[0]["kernel_share"] <= 1 and floor[0]["floor_step_s"] > 0
    # the bound: the Trainer's median step over the least time any trainer's step can take
    trainer_steps = [statistics.median(run["step_s"]) for run in floor[0]["runs"]["hf_trainer"]]
    assert floor[0]["trainer_step_s"] == statistics.median(trainer_steps)
    assert floor[0]["kernel_ceiling"] == pytest.approx(floor[0]["trainer_step_s"] / sum(floor[0]["kernels_s"].values()))
    table = (tmp_path / "speed_cpu_quick.md").read_text()
    assert table.count("\n| ") == len(result["rows"]) + 1  # the header, then one line per row
    assert "compiling took" in table and "the kernels every contender runs alike (matrix multiplies " in table
    assert "Reproduce: " in table and "`python benchmarks/speed.py --quick" in table
    measured = [row for row in result["rows"] if row["section"] != "mlx"]  # MLX rows come from their own files
    assert all(row["benchmark_command"].startswith("python benchmarks/speed.py --quick") for row in measured)


def test_the_kernel_floor_times_the_shared_kernels_of_forward_backward_and_update():
    """The floor's clock counts every multiply, attention and AdamW call of a step, forward, backward
    and update alike, and nothing else (its time would make the floor too high)."""
    import torch
    import torch.nn.functional as F

    workers = load_benchmark("speed_workers")
    w = torch.randn(8, 8, requires_grad=True)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    optimizer = torch.optim.AdamW([w, q], fused=True)
    clock = workers.kernel_clock()
    with clock:
        x = torch.randn(4, 8)
        attention = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        loss = (x @ w).relu().sum() + attention.exp().sum()  # relu, exp, sum: not shared kernels
        loss.backward()
        optimizer.step()
    # x @ w, then w's gradient (x needs none); attention forward and backward; one fused AdamW
    assert clock.calls == 2 + 2 + 1
    assert all(seconds > 0 for seconds in clock.seconds.values()) and set(clock.seconds) == set(workers.SHARED_KERNELS)


def test_mlx_results_join_the_table(tmp_path):
    """benchmarks/mlx_lora_speed.py's JSON (written on a Mac) becomes a row of this table."""
    speed = load_speed()
    (tmp_path / "mlx_lora_speed_metal.json").write_text(json.dumps({
        "device": "Metal (Apple M2)", "ptbr": {"tokens_per_s": 1200.0, "peak_memory_gb": 1.0},
        "mlx_lm_lora": {"tokens_per_s": 1000.0, "peak_memory_gb": 1.1}, "ratio": 1.2,
        "round_ratios": [1.25, 1.1, 1.2], "command": "python benchmarks/mlx_lora_speed.py"}))
    rows = speed.mlx_rows(tmp_path)
    assert [(r["reference"], r["reference_value"], r["ptbr_value"], r["ratio"]) for r in rows] == [
        ("mlx_lm.lora", 1000.0, 1200.0, 1.2)]
    table = speed.markdown({"conditions": {"machine": "M2", "when": "today", "method": "m", "command": "c"},
                            "rows": rows})
    assert ("| MLX LoRA fine-tuning (Metal (Apple M2)) | tokens/s | mlx_lm.lora | 1,000 tokens/s | 1,200 tokens/s "
            "| 1.20x (1.10-1.25) |") in table


def test_a_rows_ratio_is_that_of_the_values_it_shows_with_the_rounds_spread_beside_it():
    """Three rounds where the reference had one slow round: the median of the ratios within a round
    would say 1.16x while the medians shown say ptbr is slower (the table contradicted itself)."""
    speed = load_speed()
    ours, theirs = [0.13, 0.15, 0.17], [0.151, 0.1957, 0.15]  # step times, s
    r = speed.row("pretrain", "p", "tokens/s", "tokens/s", "HF Trainer", 1000 / 0.151, 1000 / 0.15,
                  speed.paired_ratio(ours, theirs), "ptbr train")
    assert r["ratio"] == pytest.approx(0.151 / 0.15) and sorted(r["round_ratios"])[1] == pytest.approx(0.151 / 0.13)
    memory = speed.row("pretrain", "p", "peak", "MB", "HF Trainer", 700.0, 350.0, [2.0], "ptbr train")
    assert memory["ratio"] == 2.0  # less memory: ahead
    table = speed.markdown({"conditions": {"machine": "m", "when": "w", "method": "m", "command": "c"},
                            "rows": [r, memory]})
    assert "| 1.01x (0.88-1.30) |" in table and "| 2.00x |" in table


def test_kernels_timed_longer_than_the_step_they_are_part_of_give_no_bound():
    """On a loaded machine the kernels, timed in steps apart from the one without the clock, can add
    up to more than it: the share was capped at 100% and the note still printed a 'bound', below
    the ratio ptbr had just measured."""
    speed = load_speed()
    r = speed.row("pretrain", "p", "tokens/s", "tokens/s", "HF Trainer", 1000.0, 1100.0, [1.1], "ptbr train")
    conditions = {"machine": "m", "when": "w", "method": "m", "command": "c"}
    floor = {"kernels_s": {"matrix multiplies": 0.15, "attention": 0.04, "AdamW": 0.001}, "floor_step_s": 0.18,
             "trainer_step_s": 0.2}
    busy = speed.markdown({"conditions": conditions, "rows": [dict(r, **floor, kernel_share=1.0, kernel_ceiling=0.2 / 0.191)]})
    assert "took 191 ms, more than the plain loop's 180 ms step they are part of" in busy
    assert "no bound is read from this run" in busy and "could be more than" not in busy
    floor["floor_step_s"] = 0.25
    quiet = speed.markdown({"conditions": conditions, "rows": [dict(r, **floor, kernel_share=0.764, kernel_ceiling=0.2 / 0.191)]})
    assert "take 191 ms a step, 76% of the plain loop's 250 ms" in quiet and "more than 1.05x the Trainer's 200 ms" in quiet


def test_mfu_counts_every_weight_and_the_attention():
    speed = load_speed()
    # tiny at the bundled 2,048-token vocabulary: 1,066,112 parameters (tied), 4 layers of width 128
    assert speed.flops_per_token("tiny", 2048, 256) == 6 * 1_066_112 + 12 * 4 * 128 * 256


def test_an_output_dir_that_cannot_be_made_stops_before_measuring(tmp_path, capsys):
    speed = load_speed()
    taken = tmp_path / "a-file"
    taken.write_text("")
    with pytest.raises(SystemExit) as stopped:
        speed.main(["--only", "pretrain", "--output-dir", str(taken)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: --output-dir {taken}: File exists")


def test_mfu_below_one_percent_keeps_a_digit():
    speed = load_speed()
    assert [speed.percent(x) for x in (0.0042, 0.01, 0.1449)] == ["0.4%", "1%", "14%"]


def test_the_loss_benchmark_times_both_losses_after_checking_they_agree(tmp_path, capsys):
    loss_speed = load_benchmark("loss_speed")
    rows = loss_speed.main(["--quick", "--json", str(tmp_path / "loss.json")])
    assert [r["variant"] for r in rows] == ["whole logits", "chunked, 16,384 tokens (ptbr's)", "chunked, 48 tokens"]
    assert all(r["ms"] > 0 and r["peak_mib"] is None for r in rows)  # no peak on CPU
    assert json.loads((tmp_path / "loss.json").read_text())["rows"] == rows
    table = capsys.readouterr().out
    assert "| quick, 2 x 64 | 128 | 32 | fp32 | whole logits |" in table and "| 1.00 | - |" in table


def test_the_loss_benchmark_checks_bf16_chunks_too():
    rows = load_benchmark("loss_speed").main(["--quick", "--precision", "bf16"])
    assert [r["precision"] for r in rows] == ["bf16"] * 3


def test_the_loss_benchmark_refuses_to_time_a_loss_that_differs(monkeypatch):
    from ptbr.backends.torch import loss

    loss_speed = load_benchmark("loss_speed")
    chunked = loss.chunked_cross_entropy
    monkeypatch.setattr(loss, "chunked_cross_entropy", lambda *a, **k: chunked(*a, **k) * 1.001)
    with pytest.raises(SystemExit, match="chunked, 16,384 tokens.*: loss"):
        loss_speed.main(["--quick"])


def test_the_loss_benchmark_refuses_a_loss_whose_gradient_differs(monkeypatch):
    """The right loss with a wrong gradient (as an in-place accumulation that aliased its addend once
    gave) is caught before it is timed."""
    from ptbr.backends.torch import loss

    loss_speed = load_benchmark("loss_speed")
    chunked = loss.chunked_cross_entropy

    def halved_gradients(hidden, weight, *args, **kwargs):
        value = chunked(hidden, weight, *args, **kwargs)
        return value + 0.5 * (hidden.sum() - hidden.sum().detach())  # same value, another gradient

    monkeypatch.setattr(loss, "chunked_cross_entropy", halved_gradients)
    with pytest.raises(SystemExit, match="hidden states' gradient"):
        loss_speed.main(["--quick"])


@WITHOUT_A_GPU
@pytest.mark.parametrize("name", ["speed", "loss_speed"])
def test_device_cuda_without_a_gpu_is_one_line(name, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_benchmark(name).main(["--device", "cuda"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--device cuda: torch sees no CUDA GPU here")


@WITHOUT_A_GPU
@pytest.mark.parametrize("script", ["memory_accuracy.py", "lora_memory_accuracy.py"])
def test_memory_benchmarks_refuse_device_cuda_without_a_gpu_before_the_grid(script):
    import subprocess

    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--device", "cuda"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--device cuda: torch sees no CUDA GPU here")
    assert "failed" not in done.stdout  # not one failure per grid point


def test_the_memory_grid_measures_ptbrs_default_loss_when_asked(monkeypatch):
    """--chunked-loss: every point is predicted and measured with the chunked loss (the table says
    which loss); without it, the whole logits, as the README's GPU tables were measured."""
    accuracy = load_benchmark("memory_accuracy")
    measured = []

    def fake_measure(script, point, row, timeout, env, also):
        measured.append(point)
        return row | {"measured": row["predicted"], "error_pct": 0.0, "seconds": 1.0}

    monkeypatch.setattr(accuracy, "measure_in_fresh_process", fake_measure)
    point = ("tiny", 32000, 8, 512, "fp32", False)
    chunked = accuracy.run_grid("cpu", [point], 60, chunked_loss=True)
    whole = accuracy.run_grid("cpu", [point], 60)
    assert [p["chunked_loss"] for p in measured] == [True, False]
    # the 32k-entry fp32 logits of 4,096 tokens (500 MiB) are what the chunked loss leaves out
    assert whole[0]["predicted"] - chunked[0]["predicted"] > 4096 * 32000 * 4
    assert "| tiny | 32000 | 8 x 512 | fp32 | no | chunked |" in accuracy.markdown(chunked, "cuda")
    assert "| tiny | 32000 | 8 x 512 | fp32 | no | whole |" in accuracy.markdown(whole, "cuda")

def test_an_optional_reference_that_fails_is_left_out_with_a_note(monkeypatch, capsys, tmp_path):
    """A reference setting that may not run everywhere (the Trainer in torch.compile's reduce-overhead
    mode, on a GPU) is left out of its section after it fails, its earlier rounds too, and the table
    says so (its rows of an earlier run go); any other contender's failure still ends the section."""
    speed = load_speed()
    tried = []

    def worker(kind, spec):
        tried.append(kind)
        if kind == "flaky" and tried.count("flaky") == 2:  # its second round
            raise RuntimeError("flaky failed (exit 1):\nTraceback (most recent call last):\nValueError: no graphs here\n"
                               "\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n")
        return {"step_s": [0.5], "first_step_s": 1.0, "wall_s": 2.0}

    monkeypatch.setattr(speed, "run_worker", worker)
    contenders = {"ours": ("steady", {"output": "/tmp"}), "theirs": ("flaky", {"output": "/tmp"})}
    failed = {}
    runs = speed.interleaved(contenders, 3, frozenset({"theirs"}), failed)
    assert list(runs) == ["ours"] and len(runs["ours"]) == 3 and tried.count("flaky") == 2
    assert failed == {"theirs": "flaky failed (exit 1): ValueError: no graphs here"}
    assert "theirs round 2: failed, left out" in capsys.readouterr().out
    tried.clear()
    with pytest.raises(RuntimeError, match="flaky failed"):
        speed.interleaved(contenders, 2)

    label = "HF Trainer, torch_compile_mode=reduce-overhead"
    row = speed.row("pretrain", "pretrain tiny", "tokens/s", "tokens/s", "HF Trainer", 10.0, 12.0, [1.2], "ptbr train",
                    failed_references={label: failed["theirs"]}, cudagraph_skips={"ptbr --compile": 2})
    table = speed.markdown({"rows": [row], "conditions": {"machine": "a machine", "when": "today",
                                                          "method": "a method", "command": "speed.py"}})
    assert (f'- pretrain tiny: the reference "{label}" failed and is left out '
            "(flaky failed (exit 1): ValueError: no graphs here).") in table
    assert ('- pretrain tiny: "ptbr --compile" ran without CUDA graphs in 2 compiled function(s) (inductor skipped '
            "them; its log says why).") in table
    # an earlier run's rows of that reference go with it; its other rows stay
    earlier = [speed.row("pretrain", "pretrain tiny, --compile", "tokens/s", "tokens/s", ref, 10.0, 12.0, [1.2], "c")
               for ref in (label, "HF Trainer, torch_compile=True")]
    (tmp_path / "speed_cuda.json").write_text(json.dumps({"rows": earlier}))
    assert [r["reference"] for r in speed.kept_rows(tmp_path / "speed_cuda.json", [row])] == [
        "HF Trainer, torch_compile=True"]
