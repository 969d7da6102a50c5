"""How good is the MLX memory model? Predicted peak (ptbr.memory.estimate_mlx_memory) vs
mx.get_peak_memory() of real MLX training steps (ptbr.backends.mlx.step.MlxStep).

    python benchmarks/mlx_memory_accuracy.py [--markdown]     # mlx[cpu]: a few minutes on 2 cores

Pretraining points build a preset-shaped mlx-lm Llama (the wide one with a batch so small that
AdamW's update is the peak); LoRA/QLoRA points a Mistral-shaped one
(grouped-query attention, SwiGLU) with random weights, quantized and adapted by the code
`ptbr finetune --backend mlx` uses. Each point runs two optimizer steps and reports the peak of
the second (the steady state: AdamW's state exists from the start), measured from a reset peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

# a scaled-down Mistral-7B: same GQA ratio and MLP ratio
MISTRAL = {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
           "intermediate_size": 896, "vocab_size": 4000}
# (mode, quant, precision, gradient_checkpointing, batch_size, seq_len)
GRID = [("pretrain", "none", "fp32", False, 4, 64), ("pretrain", "none", "fp32", False, 4, 256),
        ("pretrain", "none", "fp32", True, 4, 256), ("pretrain", "none", "bf16", False, 4, 128),
        ("pretrain-wide", "none", "fp32", False, 1, 32),
        ("lora", "none", "fp32", False, 4, 128), ("lora", "none", "bf16", False, 4, 128),
        ("lora", "4bit", "fp32", False, 2, 64), ("lora", "4bit", "fp32", False, 4, 256),
        ("lora", "4bit", "fp32", True, 4, 256), ("lora", "4bit", "bf16", False, 4, 128),
        ("lora", "8bit", "fp32", False, 4, 128)]
RANK, DROPOUT = 16, 0.05
# pretraining: tiny-like (activations dominate), and wide with a short batch (AdamW's update does)
PRESETS = {"pretrain": ({"name": "bench", "hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4,
                         "intermediate_size": 352, "max_position_embeddings": 1024, "learning_rate": 1e-3}, 4000),
           "pretrain-wide": ({"name": "wide", "hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 8,
                              "intermediate_size": 1408, "max_position_embeddings": 1024, "learning_rate": 1e-3}, 8000)}


def architecture(point: dict):
    from ptbr.config import ModelPreset
    from ptbr.memory import Architecture

    if point["mode"] in PRESETS:
        preset, vocab = PRESETS[point["mode"]]
        return Architecture.from_preset(ModelPreset(**preset), vocab)
    return Architecture.from_hf_config(MISTRAL)


def predict(point: dict) -> int:
    from ptbr.memory import estimate_mlx_memory

    bits = {"none": None, "4bit": 4, "8bit": 8}[point["quant"]]
    estimate = estimate_mlx_memory(architecture(point), point["batch_size"], point["seq_len"], point["precision"],
                                   RANK if point["mode"] == "lora" else None, bits, point["gradient_checkpointing"],
                                   lora_dropout=point["mode"] == "lora" and DROPOUT > 0,
                                   grad_accum=point.get("grad_accum", 1))
    return estimate.total


def build_step(point: dict):
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    from ptbr.backends.mlx import MlxBackend
    from ptbr.backends.mlx.device import MlxPlacement
    from ptbr.backends.mlx.lora import GROUP_SIZE, QUANT_BITS, adapt, quantize
    from ptbr.config import FinetuneConfig, ModelPreset, PretrainConfig

    backend = MlxBackend(MlxPlacement("cpu", point["precision"], "benchmark"))
    checkpointing = point["gradient_checkpointing"]
    if point["mode"] in PRESETS:
        preset, vocab = PRESETS[point["mode"]]
        settings = PretrainConfig(batch_size=point["batch_size"], seq_len=point["seq_len"],
                                  gradient_checkpointing=checkpointing)
        return backend.pretrain_step(ModelPreset(**preset), vocab, 0, None, settings), vocab
    args = ModelArgs(model_type="llama", num_hidden_layers=MISTRAL["num_hidden_layers"], rms_norm_eps=1e-5,
                     tie_word_embeddings=False, **{k: v for k, v in MISTRAL.items() if k != "num_hidden_layers"})
    model = Model(args)
    model.set_dtype(backend.placement.dtype)
    if point["quant"] != "none":
        quantize(model, QUANT_BITS[point["quant"]])
    mx.eval(model.parameters())
    settings = FinetuneConfig(base="bench", data="bench", batch_size=point["batch_size"], lora_r=RANK,
                              lora_dropout=DROPOUT, quant=point["quant"], max_seq_len=point["seq_len"],
                              gradient_checkpointing=checkpointing)
    quantization = None if point["quant"] == "none" else {"group_size": GROUP_SIZE}
    adapted = adapt(model, MISTRAL, "bench", quantization, settings)
    return backend.finetune_step(adapted, settings), MISTRAL["vocab_size"]


def measure(point: dict) -> int:
    import mlx.core as mx
    import numpy as np

    # what is still alive from before (in a test process, earlier tests' arrays until their garbage
    # is collected) is not this step's: measured from here
    gc.collect()
    before = mx.get_active_memory()
    step, vocab = build_step(point)
    rng = np.random.default_rng(0)
    windows = rng.integers(0, vocab, (point["batch_size"], point["seq_len"] + 1))
    batch = {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
    micro_batches = [batch] * point.get("grad_accum", 1)  # a step of that many (tests; the grid has one)
    step.train_step(micro_batches, 1e-4)
    mx.reset_peak_memory()
    step.train_step(micro_batches, 1e-4)
    peak = mx.get_peak_memory() - before
    del step
    gc.collect()
    mx.clear_cache()
    return int(peak)


def run(points: list[dict]) -> list[dict]:
    import mlx.core as mx

    from ptbr.log import setup_console

    setup_console(40)  # the LoRA summary lines of each point would drown the table
    mx.set_default_device(mx.cpu)
    rows = []
    for point in points:
        measured = measure(point)
        predicted = predict(point)
        rows.append(point | {"measured": measured, "predicted": predicted,
                             "error": round((predicted - measured) / measured, 4)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def grid() -> list[dict]:
    return [dict(zip(("mode", "quant", "precision", "gradient_checkpointing", "batch_size", "seq_len"), values, strict=True))
            for values in GRID]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    rows = run(grid())
    if args.markdown:
        print("| mode | quant | precision | ckpt | batch x seq | measured MiB | predicted MiB | error |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['quant']} | {r['precision']} | {'yes' if r['gradient_checkpointing'] else 'no'} "
                  f"| {r['batch_size']} x {r['seq_len']} | {r['measured'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} "
                  f"| {100 * r['error']:+.1f}% |")
    else:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
