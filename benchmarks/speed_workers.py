"""One contender of a speed benchmark, run in a fresh process by benchmarks/speed.py (not a test).

    python benchmarks/speed_workers.py KIND SPEC_JSON

KIND is ptbr-pretrain, hf-pretrain, plain-pretrain, kernel-floor (the plain loop's time in the
kernels every contender runs alike), ptbr-finetune, hf-finetune, ptbr-prepare or
tokenizers-prepare. Each contender prints FIRST_STEP (or ptbr's own "first step done" line) when
its first optimizer step has completed, so that the parent can time the command up to it, and
finally one line `RESULT {json}` with its step times, peak memory or throughput.

The references are written the way their users write them: a Hugging Face `Trainer` (with PEFT
for fine-tuning) and a minimal PyTorch loop; they get the same model, data, batch, sequence
length, precision and optimizer (AdamW, fused where torch has it) as ptbr.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

FIRST_STEP = "FIRST_STEP"


def report(result: dict) -> None:
    """The worker's result, with how many compiled functions inductor ran without the CUDA graphs
    they were compiled for (reduce-overhead mode; it says why in its log only), where torch.compile
    ran in this process."""
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        result = result | {"cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}
    print("RESULT " + json.dumps(result), flush=True)


def peak_memory_bytes(device: str) -> int:
    """Peak bytes allocated on the GPU, or the process's peak resident memory on CPU."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def timed_steps(ends: list[float], warmup: int, steps: int) -> list[float]:
    """Seconds of steps warmup+1 .. warmup+steps, from the moments every step ended."""
    return [ends[k] - ends[k - 1] for k in range(warmup, warmup + steps)]


def first_step_reported(ends: list[float]) -> None:
    if len(ends) == 1:
        print(FIRST_STEP, flush=True)


# ---- pretraining ------------------------------------------------------------------------------


def step_clock(spec: dict, ends: list[float]):
    """A Trainer callback that appends the time each optimizer step ends to `ends`."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            first_step_reported(ends)

    return StepClock()


def pretrain_batches(spec: dict):
    """The dataset (the sample, unless spec["data"] names another) and the batches ptbr draws for
    each step (a pure function of the step)."""
    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokens import PretrainBatches, open_dataset

    dataset = open_dataset(spec.get("data", SAMPLE_DIR), None)
    return dataset, PretrainBatches(dataset, spec["batch_size"], 1, spec["seq_len"], 1337)


def ptbr_pretrain(spec: dict) -> None:
    """`ptbr train`, the command itself (its main(), in this fresh process)."""
    from ptbr.cli import main

    total = spec["warmup"] + spec["steps"] + 1  # the last step also evaluates: not timed
    code = main(["train", "--model-size", spec["size"], "--batch-size", str(spec["batch_size"]),
                 "--seq-len", str(spec["seq_len"]), "--max-steps", str(total), "--eval-every", "0",
                 "--eval-batches", "1", "--save-every", str(10**6), "--log-every", str(10**6),
                 "--output", spec["output"], "--resume", "never", "--device", spec["device"],
                 "--precision", spec["precision"], *(["--data", spec["data"]] if "data" in spec else []),
                 *spec.get("flags", [])])
    if code:
        raise SystemExit(code)
    rows = [json.loads(line) for line in (Path(spec["output"]) / "metrics.jsonl").read_text().splitlines()]
    # elapsed_s is the loop's wall clock at each step's metrics row: the step and everything around it
    ends = [row["elapsed_s"] for row in rows]
    precision = json.loads((Path(spec["output"]) / "run_config.json").read_text())["precision"]  # as resolved
    report({"step_s": timed_steps(ends, spec["warmup"], spec["steps"]), "precision": precision,
            "peak_memory_bytes": peak_memory_bytes(spec["device"])})


def build_reference_model(spec: dict, dataset):
    from ptbr.backends.torch.models import build_model
    from ptbr.config import get_preset

    return build_model(get_preset(spec["size"]), dataset.vocab_size, dataset.eos_id, 1337)


def hf_pretrain(spec: dict) -> None:
    """transformers' Trainer on the same LlamaForCausalLM and token windows."""
    import torch
    from transformers import Trainer, TrainingArguments

    dataset, source = pretrain_batches(spec)
    total = spec["warmup"] + spec["steps"] + 1
    rows = [{"input_ids": torch.from_numpy(ids.astype("int64")), "labels": torch.from_numpy(ids.astype("int64"))}
            for step in range(total) for ids in source.cycle(step)[0]["input_ids"]]
    model = build_reference_model(spec, dataset)
    ends: list[float] = []

    args = TrainingArguments(
        output_dir=spec["output"], per_device_train_batch_size=spec["batch_size"], max_steps=total,
        learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        lr_scheduler_type="cosine", warmup_steps=1, optim="adamw_torch_fused", logging_steps=10,
        save_strategy="no", report_to="none", dataloader_num_workers=0, use_cpu=spec["device"] == "cpu",
        bf16=spec["precision"] == "bf16", fp16=spec["precision"] == "fp16", disable_tqdm=True, seed=1337,
        torch_compile=spec.get("torch_compile", False),
        **({"torch_compile_mode": spec["torch_compile_mode"]} if spec.get("torch_compile_mode") else {}))
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[step_clock(spec, ends)]).train()
    report({"step_s": timed_steps(ends, spec["warmup"], spec["steps"]), "peak_memory_bytes": peak_memory_bytes(spec["device"])})


def plain_loop(spec: dict):
    """A minimal PyTorch loop (nanoGPT's shape): forward, cross-entropy, backward, clip, AdamW.
    Returns its number of steps and the function that runs step k."""
    import math

    import torch
    import torch.nn.functional as F

    dataset, source = pretrain_batches(spec)
    device = torch.device(spec["device"])
    model = build_reference_model(spec, dataset).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type in ("cpu", "cuda"))
    total = spec["warmup"] + spec["steps"] + 1
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step(k: int) -> None:
        batch = source.cycle(k)[0]
        x = torch.from_numpy(batch["input_ids"].astype("int64")).to(device)
        y = torch.from_numpy(batch["labels"].astype("int64")).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loss.item()  # the loss every such loop prints

    return total, step


def plain_pretrain(spec: dict) -> None:
    """The plain loop, timed step by step."""
    total, step = plain_loop(spec)
    ends: list[float] = []
    for k in range(total):
        step(k)
        ends.append(time.perf_counter())
        first_step_reported(ends)
    report({"step_s": timed_steps(ends, spec["warmup"], spec["steps"]), "peak_memory_bytes": peak_memory_bytes(spec["device"])})


# The kernels every contender of a pretraining row runs alike: the same calls on the same shapes
# (one LlamaForCausalLM with SDPA attention, fused AdamW), by the names torch dispatches them under.
SHARED_KERNELS = {
    "matrix multiplies": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "AdamW": ("aten::_fused_adamw_",),
}


def kernel_clock():
    """A torch dispatch mode that adds up the wall time of every SHARED_KERNELS call made while it
    is active (forward, backward and the update: they all dispatch through it), timed around the
    call itself: no profiler, under which the multiplies took about a tenth longer (`tiny` and
    `85m` on a 2-core AMD EPYC: 105 against 95 ms, 1,572 against 1,424 ms a step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    group_of = {name: group for group, names in SHARED_KERNELS.items() for name in names}

    class KernelClock(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds = dict.fromkeys(SHARED_KERNELS, 0.0)
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            group = group_of.get(func._overloadpacket._qualified_op_name)
            if group is None:
                return func(*args, **(kwargs or {}))
            started = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds[group] += time.perf_counter() - started
            self.calls += 1
            return out

    return KernelClock()


def kernel_floor(spec: dict) -> None:
    """The seconds per step that the plain loop spends in the kernels every contender runs alike
    (CPU: matrix multiplies, attention, AdamW), each timed as it runs, and its step time without
    the clock, in this one process: no contender can take less time per step than those kernels.
    Steps with and without the clock alternate, so that a machine whose speed drifts weighs on both.
    glibc keeps freed memory here, as in ptbr's runs: the kernels' time holds no page faults of
    new buffers (the plain loop and the Trainer, left to glibc's defaults, take thousands a step
    inside these same kernels, which is part of what ptbr gains on them)."""
    import statistics

    from ptbr.backends.torch.allocator import keep_freed_memory

    keep_freed_memory()
    total, step = plain_loop(spec)
    for k in range(spec["warmup"]):
        step(k)
    plain, clocked = [], []
    for k in range(spec["warmup"], spec["warmup"] + 2 * spec["steps"]):
        if k % 2:
            clock = kernel_clock()
            with clock:
                step(k)
            clocked.append(clock)
        else:
            started = time.perf_counter()
            step(k)
            plain.append(time.perf_counter() - started)
    report({"kernels_s": {group: statistics.median(c.seconds[group] for c in clocked) for group in SHARED_KERNELS},
            "step_s": statistics.median(plain), "kernel_calls": clocked[0].calls})


# ---- fine-tuning ------------------------------------------------------------------------------


def ptbr_finetune(spec: dict) -> None:
    """`ptbr finetune`, the command itself."""
    from ptbr.cli import main

    total = spec["warmup"] + spec["steps"] + 1
    code = main(["finetune", "--base", spec["base"], "--data", spec["data"], "--quant", spec["quant"],
                 "--lora-r", str(spec["rank"]), "--lora-alpha", str(2 * spec["rank"]), "--lora-dropout", "0.05",
                 "--batch-size", str(spec["batch_size"]), "--max-seq-len", str(spec["max_seq_len"]),
                 "--max-steps", str(total), "--eval-every", "0", "--save-every", str(10**6),
                 "--log-every", str(10**6), "--output", spec["output"], "--resume", "never", "--seed", "0",
                 "--device", spec["device"], "--precision", spec["precision"], *spec.get("flags", [])])
    if code:
        raise SystemExit(code)
    rows = [json.loads(line) for line in (Path(spec["output"]) / "metrics.jsonl").read_text().splitlines()]
    ends = [row["elapsed_s"] for row in rows]
    report({"step_s": timed_steps(ends, spec["warmup"], spec["steps"]), "peak_memory_bytes": peak_memory_bytes(spec["device"])})


def hf_finetune(spec: dict) -> None:
    """transformers + PEFT, as their documentation shows it: LoRA on every linear projection of
    the base (4-bit NF4 with double quantization for QLoRA, after prepare_model_for_kbit_training),
    a causal-LM collator padding each batch, and the Trainer."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        BitsAndBytesConfig,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"], torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["base"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [json.loads(line)["text"] for line in Path(spec["data"]).read_text(encoding="utf-8").splitlines()]
    rows = [{"input_ids": tokenizer(text, truncation=True, max_length=spec["max_seq_len"])["input_ids"]}
            for text in texts]
    options = {"dtype": dtype}
    if spec["quant"] == "4bit":
        options["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                            bnb_4bit_use_double_quant=True,
                                                            bnb_4bit_compute_dtype=dtype)
        options["device_map"] = {"": torch.device(spec["device"])}
    model = AutoModelForCausalLM.from_pretrained(spec["base"], **options)
    if spec["quant"] == "4bit":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = model.to(spec["device"])
    model = get_peft_model(model, LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], lora_dropout=0.05,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    ends: list[float] = []

    total = spec["warmup"] + spec["steps"] + 1
    args = TrainingArguments(
        output_dir=spec["output"], per_device_train_batch_size=spec["batch_size"], max_steps=total,
        learning_rate=2e-4, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, warmup_steps=1,
        optim="adamw_torch_fused", logging_steps=10, save_strategy="no", report_to="none",
        dataloader_num_workers=0, use_cpu=spec["device"] == "cpu", bf16=spec["precision"] == "bf16",
        fp16=spec["precision"] == "fp16", disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[step_clock(spec, ends)],
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
    report({"step_s": timed_steps(ends, spec["warmup"], spec["steps"]), "peak_memory_bytes": peak_memory_bytes(spec["device"])})


# ---- data preparation -------------------------------------------------------------------------


def ptbr_prepare(spec: dict) -> None:
    """ptbr prepare's own function with an existing tokenizer (what `ptbr prepare --tokenizer` runs)."""
    from ptbr.data.prepare import prepare

    started = time.perf_counter()
    prepare([spec["input"]], spec["output"], tokenizer_path=spec["tokenizer"], show_progress=False)
    report({"seconds": time.perf_counter() - started})


def tokenizers_prepare(spec: dict) -> None:
    """The same text through `tokenizers` directly: documents (blank-line separated), encode_batch_fast
    (the same ids as encode_batch, without the character offsets; what ptbr prepare calls),
    an EOS after each, one uint16 array written to disk."""
    import numpy as np
    from tokenizers import Tokenizer

    started = time.perf_counter()
    tokenizer = Tokenizer.from_file(spec["tokenizer"])
    eos = tokenizer.token_to_id("<|endoftext|>") or 0
    documents = [d for d in Path(spec["input"]).read_text(encoding="utf-8").split("\n\n") if d.strip()]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch_fast(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    Path(spec["output"]).mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype=np.uint16).tofile(Path(spec["output"]) / "train.bin")
    report({"seconds": time.perf_counter() - started})


KINDS = {"ptbr-pretrain": ptbr_pretrain, "hf-pretrain": hf_pretrain, "plain-pretrain": plain_pretrain,
         "kernel-floor": kernel_floor, "ptbr-finetune": ptbr_finetune, "hf-finetune": hf_finetune,
         "ptbr-prepare": ptbr_prepare, "tokenizers-prepare": tokenizers_prepare}

if __name__ == "__main__":
    given = json.loads(sys.argv[2])
    if given.get("cold_compile"):
        # torch.compile starts from an empty cache: its whole compile time is in the first step
        import os

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(given["output"]) / "inductor-cache")
    KINDS[sys.argv[1]](given)
    import gc

    gc.freeze()  # as `ptbr` does after its command: the exit then skips a second of garbage collection
