"""Preflight and --auto-fit: recommendations for injected hardware (T4, 2x T4, H100, 8/16/32 GB
Apple Silicon, a 24 GB CPU-only machine) for every preset and for Mistral-7B QLoRA; the CLI's
exit codes and files; the recommended config trained as is; auto-fit under an injected OOM."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from ptbr.config import PRESETS, FinetuneConfig, PretrainConfig, build_settings
from ptbr.memory import GIB, Architecture, estimate_run
from ptbr.preflight import GPU, Hardware, recommend, run_preflight
from ptbr.preflight.checks import FAIL, PASS, WARN, check_kaggle, check_packages

# --------------------------------------------------------------------------------------------
# Injected machines, with the numbers torch and psutil report on them
# --------------------------------------------------------------------------------------------

T4 = GPU("Tesla T4", memory_total=15_828_320_256, memory_free=15_642_001_408, compute_capability="7.5",
         real_bf16=False, driver="550.90.07")
H100 = GPU("NVIDIA H100 80GB HBM3", memory_total=85_029_158_912, memory_free=84_493_336_576,
           compute_capability="9.0", real_bf16=True, driver="550.90.07")


def linux(gpus=(), ram=31 * GIB, available=29 * GIB, cores=4, kaggle=False) -> Hardware:
    return Hardware("Linux 6.6 x86_64", cores, ram, available, list(gpus), in_kaggle=kaggle, torch_cuda="12.4")


def mac(unified_gib: int, available_gib: float) -> Hardware:
    # Metal's recommended working set is 2/3 of unified memory on these machines
    return Hardware("Darwin 24.1 arm64", 8, unified_gib * GIB, int(available_gib * GIB), apple_silicon=True,
                    unified_memory=unified_gib * GIB, metal_working_set=unified_gib * GIB * 2 // 3)


MACHINES = {
    "t4": linux([T4]),
    "2xt4": linux([T4, T4], kaggle=True),
    "h100": linux([H100], ram=240 * GIB, available=230 * GIB, cores=26),
    "mac8": mac(8, 5.5),
    "mac16": mac(16, 11),
    "mac32": mac(32, 24),
    "cpu24": Hardware("Linux 6.6 x86_64", 2, 24 * GIB, 22 * GIB),
}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
              "max_position_embeddings": 32768, "tie_word_embeddings": False}
VOCAB = 32000


def pretrain_request(size: str) -> PretrainConfig:
    """What a user asks for: 32 sequences per step, as 8 x grad_accum 4, of the preset's length."""
    seq = min(1024, PRESETS[size].max_position_embeddings)
    return PretrainConfig(model_size=size, seq_len=seq, batch_size=8, grad_accum=4)


def qlora_request() -> FinetuneConfig:
    return FinetuneConfig(base="mistral-7b", data="train.jsonl", quant="4bit", lora_r=16, max_seq_len=1024,
                          batch_size=4, grad_accum=4)


def check_invariants(rec, hardware: Hardware, requested, arch: Architecture, seq_key: str):
    s = rec.settings
    assert type(s) is type(requested)  # the recommendation is the run's own settings
    processes = int(s.num_processes)
    assert processes == (len(hardware.gpus) if rec.target == "cuda" and hardware.gpus else 1)  # every GPU
    assert s.batch_size * s.grad_accum * processes == requested.batch_size * requested.grad_accum
    assert s.learning_rate == requested.learning_rate
    if not rec.fits:
        return
    assert rec.estimate.total <= rec.budget
    assert getattr(s, seq_key) <= getattr(requested, seq_key)
    # the micro-batch is the largest that fits: the next larger divisor of the effective batch does not
    share = requested.batch_size * requested.grad_accum // processes
    larger = [d for d in range(s.batch_size + 1, share + 1) if share % d == 0]
    if larger:
        bigger = estimate_run(s, arch, rec.target, larger[0], getattr(s, seq_key), s.precision,
                              s.gradient_checkpointing, processes, grad_accum=share // larger[0])
        assert bigger.total > rec.budget
    cpu = "bf16" if hardware.cpu_bf16 and seq_key == "seq_len" else "fp32"  # pretraining on a native-bf16 CPU
    expected = {"cuda": "bf16" if hardware.gpus and hardware.gpus[0].real_bf16 else "fp16", "cpu": cpu,
                "mps": "fp32", "mlx": "bf16"}[rec.target]
    assert s.precision == expected


# (machine, preset) -> (batch_size, grad_accum, seq_len, gradient_checkpointing), or None: does not fit
PRETRAIN_EXPECTED = {  # with the chunked loss (the default): 85m fits twice the micro-batch it did
    # 800m on one T4: accumulating micro-batches keep 2.9 GiB of gradients, and then not even one
    # sequence of 1024 fits (13.39 GiB of 13.11); 32 x 256 in one micro-batch does
    ("t4", "tiny"): (32, 1, 512, False), ("t4", "85m"): (16, 2, 1024, False),
    # 400m on a T4: 4 x 1024 needed 13.3 GiB of 13.1 once the loss's chunks on CUDA grew to 256 MiB
    ("t4", "400m"): (2, 16, 1024, False), ("t4", "800m"): (32, 1, 256, True),
    # 2x T4: one process per GPU, each with half the effective batch
    ("2xt4", "tiny"): (16, 1, 512, False), ("2xt4", "85m"): (16, 1, 1024, False),
    ("2xt4", "400m"): (2, 8, 1024, False), ("2xt4", "800m"): (16, 1, 1024, True),
    ("h100", "tiny"): (32, 1, 512, False), ("h100", "85m"): (32, 1, 1024, False),
    ("h100", "400m"): (32, 1, 1024, False), ("h100", "800m"): (16, 2, 1024, False),
    ("mac8", "tiny"): (8, 4, 512, False), ("mac8", "85m"): (1, 32, 1024, False),
    ("mac8", "400m"): None, ("mac8", "800m"): None,  # 16 B per parameter alone exceed Metal's 5.3 GiB
    # Apple Silicon plans for the MLX backend (its estimate: benchmarks/mlx_memory_accuracy.py)
    ("mac16", "tiny"): (32, 1, 512, False), ("mac16", "85m"): (4, 8, 1024, False),
    ("mac16", "400m"): (1, 32, 1024, True), ("mac16", "800m"): None,
    ("mac32", "tiny"): (32, 1, 512, False), ("mac32", "85m"): (8, 4, 1024, False),
    ("mac32", "400m"): (2, 16, 1024, False), ("mac32", "800m"): (1, 32, 1024, False),
    ("cpu24", "tiny"): (32, 1, 512, False), ("cpu24", "85m"): (16, 2, 1024, False),
    ("cpu24", "400m"): (4, 8, 1024, False), ("cpu24", "800m"): (1, 32, 1024, False),
}


@pytest.mark.parametrize("machine, size", list(PRETRAIN_EXPECTED))
def test_pretrain_recommendation(machine, size):
    hardware, requested = MACHINES[machine], pretrain_request(size)
    arch = Architecture.from_preset(PRESETS[size], VOCAB)
    rec = recommend(hardware, requested, arch, max_positions=PRESETS[size].max_position_embeddings)
    check_invariants(rec, hardware, requested, arch, "seq_len")
    s = rec.settings
    got = (s.batch_size, s.grad_accum, s.seq_len, s.gradient_checkpointing) if rec.fits else None
    assert got == PRETRAIN_EXPECTED[(machine, size)], rec.reasons
    if not rec.fits:
        assert "does not fit" in rec.reasons[-1]


QLORA_EXPECTED = {  # machine -> (batch_size, grad_accum, max_seq_len, gradient_checkpointing, precision)
    # 8 x 1024 would need 13.6 of 13.1 GiB usable: the last layer's recomputation in the backward
    # pass, while every layer's checkpointed (fp32) input is alive
    "t4": (4, 4, 1024, True, "fp16"),  # predicted 9.5 GiB
    "2xt4": (4, 2, 1024, True, "fp16"),  # x 2 processes
    "h100": (4, 4, 1024, False, "bf16"),  # 48.5 of 70.8 GiB: micro-batch 8 would not fit without checkpointing
    "mac8": None,  # MLX 4-bit weights + adapters already need 5.2 GiB, Metal allows 4.9 here
    "mac16": (2, 8, 1024, True, "bf16"),  # the MLX estimate (benchmarks/mlx_memory_accuracy.py)
    "mac32": (8, 2, 1024, True, "bf16"),
    "cpu24": (8, 2, 1024, True, "fp32"),  # bitsandbytes' CPU path computes in fp32
}


@pytest.mark.parametrize("machine", list(QLORA_EXPECTED))
def test_mistral_7b_qlora_recommendation(machine):
    hardware, requested = MACHINES[machine], qlora_request()
    arch = Architecture.from_hf_config(MISTRAL_7B)
    rec = recommend(hardware, requested, arch, max_positions=MISTRAL_7B["max_position_embeddings"], examples=848)
    check_invariants(rec, hardware, requested, arch, "max_seq_len")
    s = rec.settings
    got = (s.batch_size, s.grad_accum, s.max_seq_len, s.gradient_checkpointing, s.precision)
    assert (got if rec.fits else None) == QLORA_EXPECTED[machine], rec.reasons
    assert any("848 training examples" in r for r in rec.reasons)
    if machine == "mac16":
        assert rec.target == "mlx"  # fine-tuning on Apple Silicon: MLX's 4-bit
        assert rec.estimate.quant == "mlx4"


def test_backend_mlx_plans_for_mlx_on_any_machine_and_for_its_cpu_off_a_mac():
    """--backend mlx on Linux runs MLX's CPU build (fp32, its 4-bit base, RAM): the plan must be
    that run's, not torch's on the CPU (bitsandbytes' nf4) nor a Mac's (bf16, Metal)."""
    arch = Architecture.from_hf_config(MISTRAL_7B)
    asked = dataclasses.replace(qlora_request(), backend="mlx")
    rec = recommend(MACHINES["cpu24"], asked, arch, max_positions=MISTRAL_7B["max_position_embeddings"], examples=848)
    assert rec.target == "mlx" and rec.estimate.quant == "mlx4" and rec.settings.precision == "fp32"
    assert any("MLX on the CPU" in r for r in rec.reasons) and not any("Apple Silicon" in r for r in rec.reasons)
    rec = recommend(MACHINES["mac16"], asked, arch, max_positions=MISTRAL_7B["max_position_embeddings"], examples=848)
    assert rec.target == "mlx" and rec.settings.precision == "bf16"
    fp16 = dataclasses.replace(asked, precision="fp16")  # MLX has no loss scaling: the run refuses fp16
    rec = recommend(MACHINES["mac16"], fp16, arch, max_positions=MISTRAL_7B["max_position_embeddings"], examples=848)
    assert rec.settings.precision == "bf16" and any("bf16 instead of fp16: MLX has no loss" in r for r in rec.reasons)


def test_t4_gets_fp16_and_two_t4s_train_on_both():
    rec = recommend(MACHINES["2xt4"], pretrain_request("85m"), Architecture.from_preset(PRESETS["85m"], VOCAB))
    assert rec.settings.precision == "fp16"
    assert any("no native bf16" in r for r in rec.reasons)
    assert rec.settings.num_processes == "2" and not rec.settings.fsdp
    assert any("2 GPUs: --num-processes 2, one data-parallel process on each" in r for r in rec.reasons)
    config = rec.config_file()
    assert config["num_processes"] == "2"  # `ptbr train --config` starts both
    three = dataclasses.replace(pretrain_request("85m"), num_processes="3")  # more than the GPUs: said so
    rec = recommend(MACHINES["2xt4"], three, Architecture.from_preset(PRESETS["85m"], VOCAB), processes_given=True)
    assert rec.settings.num_processes == "2"
    assert any(r.startswith("--num-processes 3 is more than the 2 GPUs: --num-processes 2, one") for r in rec.reasons)
    # one device: one process, and the plan says why it is not the number given (it said nothing)
    for machine, why in (("t4", "one GPU takes one process"), ("cpu24", "on a CPU one process already uses every core")):
        rec = recommend(MACHINES[machine], three, Architecture.from_preset(PRESETS["85m"], VOCAB), processes_given=True)
        assert rec.settings.num_processes == "1"
        assert any(r.startswith(f"--num-processes 1, not 3: {why}") for r in rec.reasons), rec.reasons
    # asking for bf16 on a T4 is corrected, with the reason
    asked = dataclasses.replace(pretrain_request("85m"), precision="bf16")
    rec = recommend(MACHINES["t4"], asked, Architecture.from_preset(PRESETS["85m"], VOCAB))
    assert rec.settings.precision == "fp16" and any("instead of bf16" in r for r in rec.reasons)


def test_a_cpu_with_native_bf16_pretrains_in_bf16_and_fine_tunes_in_fp32():
    """The same policy as `ptbr train`'s own --precision auto (resolve_precision, tested in
    test_training): bf16 autocast for pretraining where the CPU multiplies bf16 in hardware."""
    arch = Architecture.from_preset(PRESETS["85m"], VOCAB)
    plain, native = MACHINES["cpu24"], dataclasses.replace(MACHINES["cpu24"], cpu_bf16=True)
    assert recommend(plain, pretrain_request("85m"), arch).settings.precision == "fp32"
    rec = recommend(native, pretrain_request("85m"), arch)
    assert rec.settings.precision == "bf16" and any("computes bf16 natively" in r for r in rec.reasons)
    asked = dataclasses.replace(pretrain_request("85m"), precision="fp32")
    assert recommend(native, asked, arch).settings.precision == "fp32"  # an explicit fp32 is kept
    qlora = recommend(native, qlora_request(), Architecture.from_hf_config(MISTRAL_7B))
    assert qlora.target == "cpu" and qlora.settings.precision == "fp32"


def test_a_model_whose_training_state_does_not_fit_one_gpu_is_sharded_over_two():
    """800m: 16 bytes per parameter of weights and AdamW are 11.7 GiB; on two 12 GB GPUs, DDP
    cannot even start, FSDP shares that state between them."""
    gpu = dataclasses.replace(T4, memory_free=12 * 10**9)
    rec = recommend(linux([gpu, gpu]), pretrain_request("800m"), Architecture.from_preset(PRESETS["800m"], VOCAB))
    assert rec.fits and rec.settings.fsdp and rec.settings.num_processes == "2"
    assert any("FSDP (--fsdp)" in r for r in rec.reasons)
    one = recommend(linux([gpu]), pretrain_request("800m"), Architecture.from_preset(PRESETS["800m"], VOCAB))
    assert not one.fits and not one.settings.fsdp


def test_sequence_is_shortened_only_when_one_sequence_does_not_fit():
    # 85m with checkpointing and the whole logits needs 1.79 GiB for one sequence of 2048 tokens,
    # 1.39 GiB for 1024
    small_gpu = linux([dataclasses.replace(T4, memory_free=int(1.7 / 0.9 * GIB))])
    requested = PretrainConfig(model_size="85m", seq_len=2048, batch_size=1, grad_accum=8, chunked_loss=False)
    rec = recommend(small_gpu, requested, Architecture.from_preset(PRESETS["85m"], VOCAB))
    assert rec.fits and rec.settings.seq_len == 1024 and rec.settings.gradient_checkpointing
    assert any("lowered from 2048 to 1024" in r for r in rec.reasons)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def test_packages_missing_or_too_old_fail_for_the_path_that_needs_them():
    versions = {"torch": "2.13.0", "transformers": "5.23.0", "tokenizers": "0.23.3", "accelerate": "1.15.0",
                "safetensors": "0.8.0", "numpy": "2.4.6", "peft": None, "bitsandbytes": "0.44.0", "mlx": None,
                "mlx-lm": None}
    pretrain = {c.name: c.status for c in check_packages("pretrain", "cuda", None, versions)}
    assert pretrain["packages.torch"] == PASS and FAIL not in pretrain.values()
    finetune = {c.name: c.status for c in check_packages("finetune", "cuda", "nf4", versions)}
    assert finetune["packages.peft"] == FAIL and finetune["packages.bitsandbytes"] == FAIL
    mlx = {c.name: c.status for c in check_packages("finetune", "mlx", "mlx4", versions)}
    assert mlx["packages.mlx"] == FAIL and "packages.peft" not in mlx


def test_kaggle_output_outside_working_is_a_warning():
    checks = {c.name: c for c in check_kaggle(MACHINES["2xt4"], "/tmp/run")}
    assert checks["kaggle.runtime"].status == PASS
    assert checks["kaggle.output"].status == WARN and "/kaggle/working" in checks["kaggle.output"].fix
    assert check_kaggle(MACHINES["t4"], "/tmp/run") == []


def test_probe_never_raises(monkeypatch):
    import psutil

    from ptbr.preflight.hardware import probe_hardware

    def broken():
        raise OSError("no /proc")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    hardware = probe_hardware()
    assert hardware.ram_total == 0 and any("RAM unknown" in note for note in hardware.notes)
    assert hardware.cpu_cores >= 1


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def test_preflight_writes_a_config_that_train_uses_as_is(tmp_path, capsys):
    from ptbr.cli import main

    out = tmp_path / "plan"
    assert main(["preflight", "--mode", "pretrain", "--model-size", "tiny", "--seq-len", "64", "--batch-size", "4",
                 "--grad-accum", "2", "--output", str(out)]) == 0
    report = json.loads((out / "preflight_report.json").read_text())
    assert report["ok"] and report["summary"]["fail"] == 0
    names = {c["name"] for c in report["checks"]}
    assert {"hardware.os", "data.dataset", "model.preset", "packages.torch", "memory.recommended",
            "disk.space"} <= names
    config = json.loads((out / "recommended_config.json").read_text())
    assert config["reasons"] and config["batch_size"] * config["grad_accum"] == 8
    assert {"batch_size", "grad_accum", "seq_len", "learning_rate", "precision", "gradient_checkpointing",
            "max_steps"} <= set(config)
    build_settings(PretrainConfig, config)  # every key is a PretrainConfig field (or "reasons")
    assert "warmup_steps" not in config  # derived from max_steps: it must follow the --max-steps below
    assert "next: ptbr train --config" in capsys.readouterr().out

    run = tmp_path / "run"
    assert main(["train", "--config", str(out / "recommended_config.json"), "--max-steps", "2",
                 "--output", str(run)]) == 0
    assert json.loads((run / "training_summary.json").read_text())["steps"] == 2


def test_a_precision_the_run_would_refuse_fails_preflight(tmp_path, capsys):
    """`--precision fp16` on a machine without a GPU: `ptbr train` stops with exit 5, so preflight
    must fail it too (it passed, planning fp32 in its place), and name what `auto` would run."""
    from ptbr.cli import main
    from ptbr.preflight import probe_hardware

    out = tmp_path / "plan"
    assert main(["preflight", "--mode", "pretrain", "--model-size", "tiny", "--seq-len", "64", "--precision", "fp16",
                 "--device", "cpu", "--output", str(out)]) == 10
    report = json.loads((out / "preflight_report.json").read_text())
    (failed,) = [c for c in report["checks"] if c["status"] == FAIL]
    auto = "bf16" if probe_hardware().cpu_bf16 else "fp32"
    assert failed["name"] == "settings.precision" and failed["fix"] == f"use --precision {auto} or auto"
    assert "--precision fp16 cannot run here (fp16 needs a CUDA GPU)" in failed["message"]
    assert main(["train", "--model-size", "tiny", "--precision", "fp16", "--device", "cpu", "--max-steps", "1",
                 "--output", str(tmp_path / "run")]) == 5


def test_device_cuda_without_a_gpu_fails_without_a_memory_plan_for_it(tmp_path, capsys):
    """No GPU: the accelerator check fails, and no memory check claims GiB "usable on cuda" (they
    were 90% of the RAM)."""
    from ptbr.cli import main
    from ptbr.preflight import probe_hardware

    if probe_hardware().gpus:
        pytest.skip("this machine has a GPU")
    out = tmp_path / "plan"
    assert main(["preflight", "--mode", "pretrain", "--model-size", "tiny", "--device", "cuda",
                 "--output", str(out)]) == 10
    report = json.loads((out / "preflight_report.json").read_text())
    assert [c["name"] for c in report["checks"] if c["status"] == FAIL] == ["hardware.accelerator"]
    # with --compile too (its check asked torch for the missing GPU's compute capability and crashed)
    assert main(["preflight", "--mode", "pretrain", "--model-size", "tiny", "--device", "cuda", "--compile",
                 "--output", str(tmp_path / "compiled")]) == 10
    again = json.loads((tmp_path / "compiled" / "preflight_report.json").read_text())
    assert [c["name"] for c in again["checks"] if c["status"] == FAIL] == ["hardware.accelerator"]
    assert not [c for c in report["checks"] if c["name"].startswith("memory.")]
    assert "usable on cuda" not in capsys.readouterr().out
    # the requested run's checkpoints still have a size (they read "take 0.0 MiB")
    (disk,) = [c for c in report["checks"] if c["name"] == "disk.space"]
    assert disk["value"]["one_checkpoint"] > 4 * 1_000_000 and disk["value"]["needed"] > disk["value"]["one_checkpoint"]


def test_a_broken_dataset_fails_preflight(tmp_path, capsys):
    from ptbr.cli import main
    from ptbr.data import SAMPLE_DIR

    broken = tmp_path / "data"
    shutil.copytree(SAMPLE_DIR, broken)
    with open(broken / "train.bin", "ab") as f:
        f.write(b"\x01")  # an odd number of bytes: not uint16 tokens
    out = tmp_path / "plan"
    assert main(["preflight", "--data", str(broken), "--output", str(out)]) == 10
    report = json.loads((out / "preflight_report.json").read_text())
    failed = [c for c in report["checks"] if c["status"] == FAIL]
    assert not report["ok"] and [c["name"] for c in failed] == ["data.dataset"]
    assert "not a multiple of 2" in failed[0]["message"] and failed[0]["fix"]
    assert "error: 1 check(s) failed: data.dataset" in capsys.readouterr().err


def test_under_a_launcher_rank_0_reports_and_the_other_ranks_print_only_their_failures(tmp_path, capsys,
                                                                                        monkeypatch):
    """torchrun / accelerate launch start `ptbr preflight` in every rank: each printed the whole
    report, one after the other, and wrote the same two files. Rank 0 alone does now; another rank
    checks all the same (another machine may lack what rank 0's has) and prints its failures."""
    from ptbr.cli import main

    common = ["preflight", "--mode", "pretrain", "--model-size", "tiny", "--seq-len", "64", "--device", "cpu"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main([*common, "--output", str(tmp_path / "quiet")]) == 0
    assert capsys.readouterr().out == "" and not list((tmp_path / "quiet").rglob("*"))  # (its writability probed)
    assert main([*common, "--data", str(tmp_path / "nope"), "--output", str(tmp_path / "failed")]) == 10
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"rank 1: FAIL  data.dataset  data directory not found: {tmp_path / 'nope'}",
        f"rank 1: {'':6}{'':12}  fix: give the directory written by `ptbr prepare` (train.bin, val.bin, meta.json)"]
    assert err.startswith("error: 1 check(s) failed on rank 1: data.dataset (") and not list((tmp_path / "failed").rglob("*"))
    monkeypatch.setenv("RANK", "0")
    assert main([*common, "--output", str(tmp_path / "plan")]) == 0
    assert capsys.readouterr().out.startswith("preflight (pretrain): ")
    assert (tmp_path / "plan" / "preflight_report.json").exists()


def test_under_a_launcher_the_plan_is_for_its_processes(tmp_path, capsys, monkeypatch):
    """torchrun --nproc-per-node 2 on a machine of 4 GPUs: preflight planned one process on each
    of the 4, and `ptbr train --config` under the same launcher refused that config's
    num_processes 4 (exit 2). The launcher's processes are the run's: the plan is for 2."""
    import ptbr.preflight
    from ptbr.cli import main

    monkeypatch.setattr(ptbr.preflight, "probe_hardware", lambda: linux([H100] * 4, ram=240 * GIB, available=230 * GIB))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    common = ["preflight", "--mode", "pretrain", "--model-size", "tiny", "--seq-len", "64", "--batch-size", "4",
              "--device", "cuda"]
    main([*common, "--output", str(tmp_path / "plan")])  # (this machine's torch is not the 4 GPUs' CUDA build)
    assert json.loads((tmp_path / "plan" / "recommended_config.json").read_text())["num_processes"] == "2"
    assert "--num-processes 2 as given: 2 of the 4 GPUs" in capsys.readouterr().out
    assert main([*common, "--num-processes", "3", "--output", str(tmp_path / "three")]) == 2
    assert capsys.readouterr().err.startswith("error: --num-processes 3 in a run of 2 processes (--num-processes); ")
    monkeypatch.delenv("WORLD_SIZE")  # one process: one on each GPU, as before
    main([*common, "--output", str(tmp_path / "alone")])
    assert json.loads((tmp_path / "alone" / "recommended_config.json").read_text())["num_processes"] == "4"


def test_flags_of_the_other_mode_are_an_error(tmp_path, capsys):
    from ptbr.cli import main

    assert main(["preflight", "--mode", "pretrain", "--lora-r", "8", "--output", str(tmp_path)]) == 2
    assert "--lora-r not used by --mode pretrain" in capsys.readouterr().err


@pytest.fixture
def toy_base(tmp_path) -> Path:
    """A two-layer Mistral-architecture base with its tokenizer, and a chat JSONL beside it."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    from ptbr.data.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    rows = [{"messages": [{"role": "user", "content": f"Quanto é {i} mais {i}?"},
                          {"role": "assistant", "content": f"{i} mais {i} são {2 * i}."}]} for i in range(24)]
    with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    texts = [m["content"] for r in rows for m in r["messages"]] + ["<|user|>\n<|assistant|>\n"] * 4
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(texts, vocab_size=300, min_frequency=1),
                                        eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    base = tmp_path / "base"
    tokenizer.save_pretrained(base)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(base)
    return base


def test_finetune_preflight_reads_the_base_and_checks_the_jsonl(toy_base, tmp_path, capsys):
    from ptbr.cli import main

    data, out = toy_base.parent / "train.jsonl", tmp_path / "plan"
    common = ["--mode", "finetune", "--base", str(toy_base), "--quant", "none", "--max-seq-len", "64"]
    assert main(["preflight", *common, "--data", str(data), "--output", str(out)]) == 0
    report = json.loads((out / "preflight_report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model.config"]["status"] == PASS and checks["model.tokenizer"]["status"] == PASS
    assert checks["data.train"]["value"]["examples"] == 24 and checks["data.valid"]["status"] == WARN
    config = json.loads((out / "recommended_config.json").read_text())
    settings = build_settings(FinetuneConfig, config)  # `ptbr finetune --config` takes it as is
    assert settings.base == str(toy_base) and settings.max_seq_len == 64
    assert any("24 training examples" in r for r in config["reasons"])

    broken = tmp_path / "broken.jsonl"
    broken.write_text(data.read_text() + '{"messages": [{"role": "user"}]}\n', encoding="utf-8")
    assert main(["preflight", *common, "--data", str(broken), "--output", str(tmp_path / "again")]) == 10
    report = json.loads((tmp_path / "again" / "preflight_report.json").read_text())
    failed = [c for c in report["checks"] if c["status"] == FAIL]
    assert [c["name"] for c in failed] == ["data.train"] and "line 25" in failed[0]["message"]


def test_a_plan_for_kaggle_reads_a_base_s_config_without_its_weights(toy_base, tmp_path, capsys):
    """A fine-tuning plan for Kaggle, whose base is a model hosted there (`kaggle:`, which nothing
    here can read): planned from a local folder holding the same model's config.json and tokenizer,
    its weights left out (a warning, and the bundle command names the Kaggle model); a `kaggle:` base
    fails with that fix; a plan for this machine still needs the weights."""
    import shutil

    from ptbr.cli import main
    from ptbr.kaggle.bundle import plan_contents
    from ptbr.kaggle.settings import BundleSettings

    config_only = tmp_path / "config-only"
    shutil.copytree(toy_base, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    data = toy_base.parent / "train.jsonl"
    common = ["preflight", "--mode", "finetune", "--data", str(data), "--max-seq-len", "64"]
    assert main([*common, "--base", str(config_only), "--for", "kaggle", "--output", str(tmp_path / "plan")]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("--mode finetune --base kaggle:OWNER/MODEL/FRAMEWORK/VARIATION")
    checks = {c["name"]: c for c in json.loads((tmp_path / "plan" / "preflight_report.json").read_text())["checks"]}
    assert checks["model.weights"]["status"] == WARN and "planned from its config.json" in checks["model.weights"]["message"]
    assert checks["model.tokenizer"]["status"] == PASS and checks["data.train"]["value"]["examples"] == 24
    assert checks["memory.recommended"]["status"] == PASS
    # the same plan from the complete base: no warning, the same batch
    assert main([*common, "--base", str(toy_base), "--for", "kaggle", "--output", str(tmp_path / "full")]) == 0
    full = json.loads((tmp_path / "full" / "recommended_config.json").read_text())
    planned = json.loads((tmp_path / "plan" / "recommended_config.json").read_text())
    assert "model.weights" not in capsys.readouterr().out
    assert {k: planned[k] for k in ("batch_size", "grad_accum", "precision")} == {
        k: full[k] for k in ("batch_size", "grad_accum", "precision")}
    # the bundle takes the plan with the model on Kaggle (the config's local base is left out)
    plan = plan_contents(BundleSettings(str(tmp_path / "b"), "ptbr-tester", "ptbr-ft-run", mode="finetune",
                                        config=str(tmp_path / "plan" / "recommended_config.json"), data=str(data),
                                        base="kaggle:mistral-ai/mistral/transformers/7b-v0.1"))
    assert plan.base == {"kaggle": "mistral-ai/mistral/transformers/7b-v0.1"} and "base" not in plan.settings

    assert main([*common, "--base", "kaggle:mistral-ai/mistral/transformers/7b-v0.1", "--for", "kaggle",
                 "--output", str(tmp_path / "hosted")]) == 10
    hosted = {c["name"]: c for c in json.loads((tmp_path / "hosted" / "preflight_report.json").read_text())["checks"]}
    assert hosted["model.base"]["status"] == FAIL and "hosted on Kaggle" in hosted["model.base"]["message"]
    assert "the weights can be left out with --for kaggle" in hosted["model.base"]["fix"]
    # for this machine a base without weights is not one
    assert main([*common, "--base", str(config_only), "--output", str(tmp_path / "here")]) == 10
    here = {c["name"]: c for c in json.loads((tmp_path / "here" / "preflight_report.json").read_text())["checks"]}
    assert here["model.base"]["status"] == FAIL and "no weights" in here["model.base"]["message"]


def test_an_output_that_is_the_data_s_or_the_base_s_directory_fails_as_the_run_would(toy_base, tmp_path, capsys):
    """preflight passed an --output that is the directory of --data (or --base), and then told the
    user to run `ptbr train --config` there, which refuses it (exit 6): the same refusal is a failed
    check now, and no recommended config is written into the data's folder."""
    from ptbr.cli import main

    data = toy_base.parent / "train.jsonl"
    common = ["preflight", "--mode", "finetune", "--base", str(toy_base), "--data", str(data), "--quant", "none"]
    for flag, folder in (("data", data.parent), ("base", toy_base)):
        before = sorted(p.name for p in folder.iterdir())
        result = run_preflight(build_settings(FinetuneConfig, {"base": str(toy_base), "data": str(data),
                                                               "quant": "none", "output": str(folder)}))
        (failed,) = result.failed
        given = data if flag == "data" else toy_base
        assert failed.name == "disk.output" and failed.message == (
            f"--output is the directory of --{flag} {given}: the run would refuse it")
        assert failed.fix == "give the run a directory of its own with --output (e.g. runs/NAME)"
        assert main([*common, "--output", str(folder)]) == 10
        # nothing written there: no report, no recommended config in the data's (or the model's) folder
        assert sorted(p.name for p in folder.iterdir()) == before
        printed = capsys.readouterr()
        assert "report: not written (the --output a run would refuse, see disk.output above)" in printed.out
        assert "error: 1 check(s) failed: disk.output" in printed.err
    # a folder that holds a model (an earlier run's final/): the run refuses it too
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_text("x")
    assert main([*common, "--output", str(final)]) == 10
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert line.split()[1] == "disk.output" and line.endswith(
        "  the output directory holds a model (model.safetensors), not a run: the run would refuse it")
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]


def test_an_output_holding_a_run_is_a_warning_that_the_run_resumes_it(tmp_path, capsys):
    """preflight passed an --output holding another run's checkpoints, and its recommended config
    was then refused there ("the checkpoint belongs to another run: seq_len is 64 ...")."""
    from ptbr.cli import main

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000020").mkdir(parents=True)
    (run / "checkpoints" / "step_000020" / "trainer_state.json").write_text("{}")
    (run / "checkpoints" / "step_000010").mkdir()
    (run / "checkpoints" / "step_000010" / "trainer_state.json").write_text("{}")
    assert main(["preflight", "--mode", "pretrain", "--model-size", "tiny", "--output", str(run)]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "disk.previous_run" in line]
    assert line.split()[0] == "WARN" and line.endswith(
        f"{run} holds a run (checkpoints up to step_000020): the run resumes it where its settings match the "
        "checkpoint's, and refuses other settings (this plan's among them)")
    assert ("fix: for a new run, give a new --output, or add --resume never (the old run's files move to "
            "OUTPUT/previous/)") in out
    assert main(["preflight", "--mode", "pretrain", "--model-size", "tiny", "--output", str(run), "--resume",
                 "never"]) == 0
    assert "disk.previous_run" not in capsys.readouterr().out


def test_load_test_loads_the_base_with_its_adapter_and_fails_on_broken_weights(toy_base, tmp_path, capsys):
    """`--load-test` loads the base as `ptbr finetune` will: the weights' bytes with the adapter
    (fp32 here: 4 B a parameter, LoRA's too); truncated weights are a failed check (exit 10) naming
    the load error, not a crash."""
    from ptbr.cli import main
    from ptbr.memory import Architecture

    common = ["preflight", "--mode", "finetune", "--base", str(toy_base), "--data", str(toy_base.parent / "train.jsonl"),
              "--quant", "none", "--device", "cpu", "--precision", "fp32", "--lora-r", "4", "--load-test"]
    assert main([*common, "--output", str(tmp_path / "plan")]) == 0
    checks = {c["name"]: c for c in json.loads((tmp_path / "plan" / "preflight_report.json").read_text())["checks"]}
    arch = Architecture.from_hf_config(json.loads((toy_base / "config.json").read_text()))
    assert checks["model.load_test"]["status"] == PASS
    # the weights, the adapter and the rotary embedding's buffers (inv_freq and its original, head_dim / 2 each)
    assert checks["model.load_test"]["value"] == 4 * (arch.parameters + arch.lora_parameters(4) + arch.head_dim)
    weights = toy_base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main([*common, "--output", str(tmp_path / "again")]) == 10
    checks = {c["name"]: c for c in json.loads((tmp_path / "again" / "preflight_report.json").read_text())["checks"]}
    failed = checks["model.load_test"]
    assert failed["status"] == FAIL and failed["value"] == str(toy_base), failed
    assert failed["message"] == "cannot load the base model: Error while deserializing header: invalid header length"


def test_finetune_recommended_config_is_a_finetune_config():
    hardware, requested = MACHINES["t4"], qlora_request()
    rec = recommend(hardware, requested, Architecture.from_hf_config(MISTRAL_7B))
    settings = build_settings(FinetuneConfig, json.loads(json.dumps(rec.config_file())))
    assert (settings.batch_size, settings.grad_accum, settings.gradient_checkpointing) == (4, 4, True)


# --------------------------------------------------------------------------------------------
# --auto-fit
# --------------------------------------------------------------------------------------------


def test_halving_keeps_the_effective_batch():
    from ptbr.train.autofit import halve

    assert halve(8, 1) == (4, 2) and halve(4, 2) == (2, 4) and halve(6, 2) == (3, 4)
    assert halve(3, 1) == (1, 3) and halve(1, 8) is None


def test_out_of_memory_is_recognised():
    import torch

    from ptbr.backends.torch import TorchBackend

    is_out_of_memory = TorchBackend.create("cpu").is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 8 GB)"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


class FakeStep:
    """A backend's step that runs out of memory above `limit` rows: its micro-batch's, plus one
    row's worth for the earlier micro-batches' gradients from a step's second micro-batch on (as a
    real step's peak is under accumulation). Appends each step's number of micro-batches to `calls`."""

    def __init__(self, limit: int, calls: list | None = None):
        self.limit, self.calls = limit, calls if calls is not None else []

    def train_step(self, micro_batches, lr):
        import torch

        self.calls.append(len(micro_batches))
        if len(micro_batches[0]["input_ids"]) + (len(micro_batches) > 1) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


def test_auto_fit_on_cpu_plans_into_the_share_of_ram_preflight_plans_into(monkeypatch):
    """--auto-fit's guard on CPU skips a size the memory model puts above 80% of the available RAM,
    as preflight plans (resident memory runs above the model's tensors there): a size at 90% of it
    was run, where the kernel may kill the process."""
    from collections import namedtuple

    import psutil

    from ptbr.train.autofit import ram_guard

    memory = namedtuple("memory", "total available percent used free")
    too_big = ram_guard(lambda batch: batch * 900 * 2**20)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(2 << 30, 1000 * 2**20, 50.0, 0, 0))
    assert "more than the 0.8 GiB planned for (80% of the 1.0 GiB of RAM available)" in too_big(1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(2 << 30, 1200 * 2**20, 50.0, 0, 0))
    assert too_big(1) is None and too_big(2) is not None


def test_auto_fit_halves_until_a_step_fits():
    from ptbr.backends.torch import TorchBackend
    from ptbr.errors import DeviceError
    from ptbr.train.autofit import auto_fit

    backend = TorchBackend.create("cpu")
    built = []

    def make_step(batch_size):
        built.append(batch_size)
        return FakeStep(limit=3)

    choice = auto_fit(backend, make_step, lambda b: {"input_ids": [[0]] * b}, 16, 2)
    assert (choice.batch_size, choice.grad_accum) == (2, 16)
    assert built == [16, 8, 4, 2]  # a fresh step for each try
    assert [t["result"].split(":")[0] for t in choice.tried] == ["out of memory"] * 3 + ["fits"]
    with pytest.raises(DeviceError, match="even at micro-batch 1"):
        auto_fit(backend, lambda b: FakeStep(limit=0), lambda b: {"input_ids": [[0]] * b}, 4, 1)


def test_auto_fit_dry_runs_accumulate_as_the_run_will():
    """A micro-batch of 4 fits alone (4 <= 4) but not with the gradients an earlier micro-batch
    leaves (5): under accumulation the dry run's steps run two micro-batches, so 4 x 2 is refused
    and 2 x 4 chosen; a dry run of one micro-batch would have chosen 4 x 2, and the run's first
    step would have run out of memory. Without accumulation a step is one micro-batch."""
    from ptbr.backends.torch import TorchBackend
    from ptbr.train.autofit import auto_fit

    backend, calls = TorchBackend.create("cpu"), []
    choice = auto_fit(backend, lambda b: FakeStep(4, calls), lambda b: {"input_ids": [[0]] * b}, 8, 1)
    assert (choice.batch_size, choice.grad_accum) == (2, 4)
    assert [t["result"].split(":")[0] for t in choice.tried] == ["out of memory"] * 2 + ["fits"]
    assert calls == [1, 2, 2, 2]  # 8 x 1 (one micro-batch), 4 x 2, then 2 x 4's two steps
    calls.clear()
    choice = auto_fit(backend, lambda b: FakeStep(4, calls), lambda b: {"input_ids": [[0]] * b}, 4, 1)
    assert (choice.batch_size, choice.grad_accum, calls) == (4, 1, [1, 1])


@pytest.mark.parametrize("compile, chunked", [(False, True), (True, True), (True, False), (False, False)])
def test_auto_fit_probes_run_eager_with_the_run_s_own_loss(monkeypatch, compile, chunked):
    """--auto-fit's probes run eager (one compile per probed size would cost tens of seconds each)
    with the run's own loss, compiled or not: the chunked loss's peak, or the whole logits'."""
    from types import SimpleNamespace

    from ptbr.runs import pretrain

    probes = []

    class Backend:
        name, device = "torch", "cuda"  # no RAM guard

        def pretrain_step(self, preset, vocab_size, eos_id, pad_id, settings):
            probes.append(settings)

    def one_probe(backend, make_step, longest_batch, batch_size, grad_accum, too_big):
        make_step(batch_size)
        return SimpleNamespace(batch_size=batch_size, grad_accum=grad_accum)

    monkeypatch.setattr(pretrain, "auto_fit", one_probe)
    dataset = SimpleNamespace(meta=None, vocab_size=300, eos_id=0)
    pretrain._auto_fit(PretrainConfig(compile=compile, chunked_loss=chunked), Backend(), dataset, PRESETS["tiny"])
    assert not probes[0].compile and probes[0].chunked_loss == chunked


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


TRAIN = ["--model-size", "tiny", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1"]


def test_auto_fit_chooses_a_smaller_micro_batch_and_leaves_no_trace(tmp_path, oom_above):
    from ptbr.cli import main

    assert main(["train", *TRAIN, "--batch-size", "2", "--grad-accum", "4", "--max-steps", "3",
                 "--output", str(tmp_path / "plain")]) == 0
    oom_above(limit=2)
    fitted = tmp_path / "fitted"
    assert main(["train", *TRAIN, "--batch-size", "8", "--grad-accum", "1", "--max-steps", "3", "--auto-fit",
                 "--output", str(fitted)]) == 0
    log = (fitted / "train.log").read_text()
    assert "auto-fit chose batch_size 2 x grad_accum 4" in log
    settings = json.loads((fitted / "run_config.json").read_text())["settings"]
    assert (settings["batch_size"], settings["grad_accum"]) == (2, 4)
    # the dry runs used throwaway models: the run is the one that batch 2 x 4 gives from the start
    assert _losses(fitted) == _losses(tmp_path / "plain")


def test_out_of_memory_mid_run_resumes_from_the_last_checkpoint(tmp_path, oom_above):
    from ptbr.cli import main

    # the dry run (2 calls) and 3 real steps fit at micro-batch 4; then micro-batches of 4 run out
    oom_above(limit=2, after_calls=5)
    run = tmp_path / "run"
    assert main(["train", *TRAIN, "--batch-size", "4", "--grad-accum", "1", "--max-steps", "6", "--save-every", "2",
                 "--auto-fit", "--output", str(run)]) == 0
    log = (run / "train.log").read_text()
    assert "out of memory during the run" in log and "batch_size 2 x grad_accum 2" in log
    assert "resuming from" in log and "step_000002" in log
    summary = json.loads((run / "training_summary.json").read_text())
    assert summary["steps"] == 6
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))


def test_preflight_keeps_every_precision_the_run_accepts():
    """The plan changes an explicit --precision only where the run refuses it (ptbr.backends.torch.
    device.resolve_precision): fp16 on a GPU with native bf16 runs (with GradScaler), and on MPS
    both 16-bit precisions run; preflight used to FAIL them as "the run would stop with exit 5"."""
    import torch

    from ptbr.backends.torch.device import resolve_precision
    from ptbr.errors import DeviceError
    from ptbr.preflight.recommend import choose_precision

    reasons: list[str] = []
    assert choose_precision(MACHINES["h100"], "cuda", "fp16", reasons) == "fp16"
    assert "computes bf16 natively, which needs no loss scaling" in reasons[-1]
    assert choose_precision(MACHINES["t4"], "cuda", "bf16", reasons) == "fp16"  # the run refuses it (exit 5)
    assert reasons[-1] == "precision fp16 instead of bf16: the Tesla T4 has no native bf16"
    for precision in ("fp16", "bf16", "fp32"):
        assert choose_precision(MACHINES["mac16"], "mps", precision, []) == precision
        assert resolve_precision(torch.device("mps"), precision).precision == precision  # as the run does
    assert choose_precision(MACHINES["cpu24"], "cpu", "fp16", reasons) == "fp32"
    with pytest.raises(DeviceError):
        resolve_precision(torch.device("cpu"), "fp16")


def test_device_mps_off_apple_silicon_fails_even_with_a_gpu():
    """--device mps on Linux with an NVIDIA GPU: the run stops (torch has no MPS there); preflight
    planned the MLX backend for it and passed."""
    from ptbr.preflight.checks import check_hardware
    from ptbr.preflight.recommend import choose_target

    assert choose_target(MACHINES["t4"], "pretrain", "mps") == "mps"
    (failed,) = [c for c in check_hardware(MACHINES["t4"], "mps") if c.status == FAIL]
    assert failed.name == "hardware.accelerator" and "Apple Silicon's GPU" in failed.message
    assert failed.fix == "use --device auto or cuda"
    assert not [c for c in check_hardware(MACHINES["mac16"], "mps") if c.status == FAIL]
    assert choose_target(MACHINES["mac16"], "pretrain", "mps") == "mlx"


def test_a_mixture_of_experts_base_gets_no_plan_of_a_dense_one():
    """Mixtral-8x7B's config.json read as a dense decoder is a 7.2B model (it has 46.7B): the plan
    passed with 14.7 GiB. It fails, naming the experts, and other checks still run."""
    from ptbr.preflight.checks import mixture_of_experts

    mixtral = MISTRAL_7B | {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2}
    check = mixture_of_experts(mixtral)
    assert check.status == FAIL and check.name == "model.architecture"
    assert "MixtralForCausalLM is a mixture-of-experts decoder (num_local_experts 8)" in check.message
    assert mixture_of_experts(MISTRAL_7B) is None and mixture_of_experts(MISTRAL_7B | {"num_experts": 1}) is None
    # and the runs' own uses of the memory model (the run's predicted peak, --auto-fit's RAM guard)
    # treat it as an architecture the model does not know, not as a dense 7B
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Architecture.from_hf_config(mixtral)


def test_a_shorter_sequence_says_what_it_costs_and_the_full_length_alternative():
    """800m on one T4: the plan keeps 32 sequences per step at 256 tokens. It said "the effective
    batch is unchanged", while a step now holds a quarter of the tokens and the model trains on
    256-token contexts; it says so, and what keeps 1024-token contexts instead."""
    rec = recommend(MACHINES["t4"], pretrain_request("800m"), Architecture.from_preset(PRESETS["800m"], VOCAB),
                    max_positions=PRESETS["800m"].max_position_embeddings)
    assert rec.settings.seq_len == 256
    assert ("tokens per step fall from 32,768 to 8,192 (the effective batch counts sequences, now 256 tokens long), "
            "and the model trains on 256-token contexts: 4x --max-steps sees the same tokens") in "\n".join(rec.reasons)
    assert not any("the effective batch is unchanged" in r for r in rec.reasons)
    (alternative,) = [r for r in rec.reasons if r.startswith("to keep 1024-token contexts instead")]
    batch = int(alternative.split("--batch-size ")[1].split()[0])
    s = dataclasses.replace(rec.settings, batch_size=batch, grad_accum=1, seq_len=1024, gradient_checkpointing=True)
    assert estimate_run(s, Architecture.from_preset(PRESETS["800m"], VOCAB), "cuda", batch, 1024, s.precision, True,
                        1, grad_accum=1).total <= rec.budget


def test_several_gpus_are_planned_by_the_one_with_least_free_memory():
    """Every rank holds the same micro-batch: a second T4 with 8 GiB in use by something else sets
    the budget (the plan read GPU 0 only, and rank 1 ran out of memory)."""
    busy = dataclasses.replace(T4, memory_free=7 * GIB)
    rec = recommend(linux([T4, busy]), pretrain_request("400m"), Architecture.from_preset(PRESETS["400m"], VOCAB),
                    max_positions=PRESETS["400m"].max_position_embeddings)
    assert rec.budget == int(0.9 * 7 * GIB)
    assert any(r.startswith("GPU 1 Tesla T4: 7.0 GiB of 14.7 GiB free (the least free of the 2 GPUs the run uses)")
               for r in rec.reasons), rec.reasons
    assert rec.estimate.total <= rec.budget


def test_a_base_that_cannot_be_read_leaves_the_checkpoints_size_unknown(tmp_path):
    """No weights and an unknown architecture: the disk check says so instead of "0.0 MiB"."""
    from ptbr.cli import main

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"architectures": ["WeirdForCausalLM"], "model_type": "weird"}))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "olá mundo"}) + "\n", encoding="utf-8")
    out = tmp_path / "plan"
    assert main(["preflight", "--mode", "finetune", "--base", str(base), "--data", str(data), "--device", "cpu",
                 "--output", str(out)]) == 10
    report = json.loads((out / "preflight_report.json").read_text())
    (disk,) = [c for c in report["checks"] if c["name"] == "disk.space"]
    assert disk["status"] == PASS and disk["value"]["needed"] is None
    assert "the checkpoints' size is unknown" in disk["message"]


def test_preflight_for_kaggle_plans_the_two_t4s_and_the_bundle_takes_its_config(tmp_path, capsys, caplog):
    """`--for kaggle` plans for the kernel `ptbr kaggle bundle` makes (two T4s), from any machine:
    fp16, a process on each T4, two checkpoints kept, gradient checkpointing and a micro-batch that
    fit a T4 (800m: 8 x 1024 would need 29.6 GiB); nothing of this machine (its packages) is
    checked, and the recommended config goes into a bundle as is, without a note."""
    from ptbr.cli import main
    from ptbr.kaggle.bundle import plan_contents
    from ptbr.kaggle.settings import BundleSettings

    out = tmp_path / "plan"
    request = ["preflight", "--mode", "pretrain", "--model-size", "800m", "--seq-len", "1024", "--batch-size", "8",
               "--grad-accum", "4", "--for", "kaggle"]
    assert main([*request, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (f"next: ptbr kaggle bundle --config {out / 'recommended_config.json'} --owner YOUR_KAGGLE_USERNAME "
            "--slug NAME --output bundles/NAME\n") in printed
    config = json.loads((out / "recommended_config.json").read_text())
    assert {k: config[k] for k in ("precision", "num_processes", "keep_last", "batch_size", "grad_accum",
                                   "gradient_checkpointing")} == {
        "precision": "fp16", "num_processes": "2", "keep_last": 2, "batch_size": 4, "grad_accum": 8,
        "gradient_checkpointing": True}
    assert config["planned_for"] == "kaggle"  # the bundle's notes read it
    checks = {c["name"]: c for c in json.loads((out / "preflight_report.json").read_text())["checks"]}
    # nothing of this machine: its packages, its disk, its Python
    assert not [name for name in checks if name.startswith("packages.") or name == "disk.space"]
    assert "Python" not in checks["hardware.os"]["message"]
    assert checks["hardware.gpu1"]["value"]["name"] == "Tesla T4" and checks["kaggle.output_size"]["status"] == WARN
    plan = plan_contents(BundleSettings(str(tmp_path / "b"), "ptbr-tester", "ptbr-800m-run",
                                        config=str(out / "recommended_config.json")))
    assert plan.settings["precision"] == "fp16" and plan.settings["num_processes"] == "2"
    assert "note:" not in caplog.text + capsys.readouterr().err  # (the console's, or the records where a handler was left)
    # what only this machine could load, and what two processes cannot run
    assert main([*request, "--output", str(tmp_path / "p2"), "--load-test"]) == 2
    assert "--load-test loads the model on this machine, not on Kaggle's" in capsys.readouterr().err
    assert main([*request, "--output", str(tmp_path / "p3"), "--compile"]) == 10
    compiled = {c["name"]: c for c in json.loads((tmp_path / "p3" / "preflight_report.json").read_text())["checks"]}
    assert compiled["settings.compile"]["status"] == FAIL
    assert "a run of 2 data-parallel processes" in compiled["settings.compile"]["message"]
    # its fix, one process, is kept as given (it became 2, and the plan then failed its own check)
    assert main([*request, "--output", str(tmp_path / "p4"), "--compile", "--num-processes", "1"]) == 0
    assert json.loads((tmp_path / "p4" / "recommended_config.json").read_text())["num_processes"] == "1"
    # what the bundle refuses
    assert main([*request, "--output", str(tmp_path / "p5"), "--backend", "mlx"]) == 2
    assert "--device auto --backend mlx is not on Kaggle" in capsys.readouterr().err
    assert main([*request, "--output", str(tmp_path / "p6"), "--num-processes", "3"]) == 2  # it became 2, unsaid
    assert "--num-processes 3 is more than Kaggle's 2 GPUs" in capsys.readouterr().err


def _probe_the_output_repeatedly(directory: str) -> list[str]:
    from ptbr.preflight.checks import check_output

    return [c.message for _ in range(300) for c in check_output(directory, None, None, False)
            if c.status == FAIL]


def test_ranks_checking_one_output_at_once_each_find_it_writable(tmp_path):
    """Under a launcher every rank runs preflight on the same --output at the same moment: each
    probes it for writing under a name of its own. Before, they shared one probe file, and a rank
    whose probe the other had just removed failed disk.writable ("No such file or directory")."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(4) as pool:
        failures = pool.map(_probe_the_output_repeatedly, [str(tmp_path / "plan")] * 4)
    assert failures == [[], [], [], []]
    assert list((tmp_path / "plan").iterdir()) == []  # no probe left behind
