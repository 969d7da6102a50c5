"""How good is the memory model for LoRA and QLoRA? Predicted vs measured peak of real fine-tuning steps.

    python benchmarks/lora_memory_accuracy.py --markdown           # CPU, a few minutes on 2 cores
    python benchmarks/lora_memory_accuracy.py --device cuda --jobs 4 --markdown
    python benchmarks/lora_memory_accuracy.py --device cuda --jobs 4 --chunked-loss   # its default loss only

The base is a Mistral-shaped model (grouped-query attention, SwiGLU) with random weights, saved to a
temporary directory and loaded the way `ptbr finetune` loads it (ptbr.backends.torch.lora.load_model:
bitsandbytes NF4 for --quant 4bit, peft's LoRA on every projection). Each point runs in a fresh
process: the warm-up step of a throwaway base joins the baseline, then the real base is loaded and
three optimizer steps run. Measured as in benchmarks/memory_accuracy.py: on CUDA
torch.cuda.max_memory_allocated(); on CPU the peak of allocated tensor bytes (torch.profiler's
memory events) and the growth of peak resident memory, with glibc's malloc set as ptbr's CPU runs
set it (ptbr.backends.torch.allocator.keep_freed_memory).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from memory_accuracy import (  # noqa: E402  (same directory)
    _profiled_peak,
    baseline_after_warm_up,
    cli,
    in_parallel,
    measure_in_fresh_process,
)

# a scaled-down Mistral-7B: same head size, GQA ratio and MLP ratio; 0.24 B parameters
BASE = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 3584, "max_position_embeddings": 4096}
WARM = BASE | {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "intermediate_size": 224, "vocab_size": 256}
# (quant, precision, gradient_checkpointing, batch_size, seq_len, chunked_loss)
GRIDS = {
    "cpu": [("none", "fp32", False, 4, 256, False), ("none", "bf16", False, 4, 256, False),
            ("4bit", "fp32", False, 4, 256, False), ("4bit", "bf16", False, 4, 256, False),
            ("4bit", "bf16", False, 8, 512, False), ("4bit", "bf16", True, 8, 512, False),
            ("none", "bf16", True, 8, 512, False),
            # the chunked loss (`ptbr finetune`'s default)
            ("4bit", "fp32", False, 4, 256, True), ("4bit", "bf16", False, 8, 512, True),
            ("4bit", "bf16", True, 8, 512, True), ("none", "bf16", True, 8, 512, True)],
    "cuda": [(quant, precision, checkpointing, batch, seq, chunked) for quant in ("4bit", "none")
             for precision in ("bf16", "fp16") for checkpointing in (False, True)
             for batch, seq in ((4, 1024), (16, 2048)) for chunked in (False, True)],
}
RANK, DROPOUT = 16, 0.05
STEPS = 3
GOAL = {"cuda": 0.10, "cpu": 0.20}


def save_base(config: dict, directory: Path) -> None:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**config)).save_pretrained(directory)


def predict(point: dict) -> dict:
    from ptbr.memory import Architecture, estimate_lora_memory

    quant = {"none": None, "4bit": "nf4"}[point["quant"]]
    estimate = estimate_lora_memory(Architecture.from_hf_config(BASE), point["batch_size"], point["seq_len"], RANK,
                                    quant, point["precision"], point["gradient_checkpointing"],
                                    lora_dropout=DROPOUT > 0, device=point["device"],
                                    chunked_loss=point["chunked_loss"])
    return {"predicted": estimate.total, "phase": estimate.peak_phase}


def measure(point: dict) -> dict:
    """Runs in its own process: load, train STEPS steps, report the peak."""
    import resource

    import numpy as np
    import torch

    from ptbr.backends.torch.allocator import keep_freed_memory
    from ptbr.backends.torch.device import resolve_device, resolve_precision
    from ptbr.backends.torch.lora import load_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import FinetuneConfig

    placement = resolve_precision(resolve_device(point["device"]), point["precision"])
    cuda = placement.device.type == "cuda"
    if not cuda:  # glibc's malloc as ptbr's CPU runs set it (TorchBackend.create)
        keep_freed_memory()

    def backend(base: str):
        settings = FinetuneConfig(base=base, data="unused", quant=point["quant"], lora_r=RANK, lora_dropout=DROPOUT,
                                  gradient_checkpointing=point["gradient_checkpointing"])
        model = load_model(settings, placement).model
        return TorchStep(model, build_optimizer(model, settings, placement.device), placement, 1.0,
                         chunked_loss=point["chunked_loss"])

    def batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> dict:
        ids = np.random.default_rng(seed).integers(0, vocab_size, size=(batch_size, seq_len))
        return {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}

    baseline = baseline_after_warm_up(backend(point["warm"]), [batch(WARM["vocab_size"], 2, 16, seed)
                                                                for seed in range(2)], cuda)
    started = time.monotonic()
    step = backend(point["base"])
    shape = (BASE["vocab_size"], point["batch_size"], point["seq_len"])
    for seed in range(STEPS - 1):
        step.train_step([batch(*shape, seed)], 1e-4)
    result = {"baseline": baseline}
    if cuda:
        torch.cuda.synchronize()
        step.train_step([batch(*shape, STEPS)], 1e-4)
        torch.cuda.synchronize()
        result["measured"] = torch.cuda.max_memory_allocated() - baseline
    else:
        result["allocated"] = _profiled_peak(step, batch(*shape, STEPS))
        result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        result["measured"] = result["allocated"]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def run_grid(device: str, timeout: int, jobs: int = 1, gpu_share: float = 0.9, chunked_only: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        save_base(BASE, Path(tmp) / "base")
        save_base(WARM, Path(tmp) / "warm")
        tasks = []
        for quant, precision, checkpointing, batch_size, seq_len, chunked in GRIDS[device]:
            if chunked_only and not chunked:
                continue
            point = {"quant": quant, "precision": precision, "gradient_checkpointing": checkpointing,
                     "batch_size": batch_size, "seq_len": seq_len, "chunked_loss": chunked, "device": device,
                     "base": str(Path(tmp) / "base"), "warm": str(Path(tmp) / "warm")}
            tasks.append((point, {k: v for k, v in point.items() if k not in ("base", "warm")} | predict(point)))

        def run(point: dict, row: dict) -> dict:
            row = measure_in_fresh_process(__file__, point, row, timeout, also={"rss": ("rss_error_pct", 1)},
                                           decimals=2)
            print(json.dumps({k: row.get(k) for k in ("quant", "precision", "gradient_checkpointing", "batch_size",
                                                          "seq_len", "chunked_loss", "predicted", "measured", "error_pct", "failed")}),
                  file=sys.stderr, flush=True)
            return row

        return in_parallel(run, tasks, jobs, device, gpu_share)


def markdown(rows: list[dict], device: str) -> str:
    measured_as = "allocated peak" if device == "cpu" else "max_memory_allocated"
    head = f"| base | quant | precision | grad. ckpt | loss | batch × seq | predicted MiB | {measured_as} MiB | error |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if device == "cpu":
        head += " peak RSS growth MiB | error |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        if "failed" in r:
            continue
        line = (f"| Mistral-shaped 0.24B | {r['quant']} | {r['precision']} | "
                f"{'yes' if r['gradient_checkpointing'] else 'no'} | {'chunked' if r.get('chunked_loss') else 'whole'} | "
                f"{r['batch_size']} × {r['seq_len']} | "
                f"{r['predicted'] / 2**20:,.0f} | {r['measured'] / 2**20:,.0f} | {r['error_pct']:+.2f}% |")
        if device == "cpu":
            line += f" {r['rss'] / 2**20:,.0f} | {r['rss_error_pct']:+.1f}% |"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    def options(parser) -> None:
        parser.add_argument("--chunked-loss", action="store_true",
                            help="only the points with `ptbr finetune`'s default loss, the chunked one")

    return cli(__doc__.splitlines()[0], measure,
               lambda device, timeout, args: run_grid(device, timeout, args.jobs, args.gpu_share, args.chunked_loss),
               markdown, GOAL, options)


if __name__ == "__main__":
    raise SystemExit(main())
