"""Is ptbr faster than what its users would run instead? Side by side, in one run on one machine
(a benchmark, not a test: nothing here asserts a ratio).

    python benchmarks/speed.py                      # CPU: every section, ~20 min on 2 busy cores
    python benchmarks/speed.py --device cuda        # a GPU: also 400m, with MFU, at a 32k vocabulary
    python benchmarks/speed.py --only pretrain --sizes tiny --rounds 5
    python benchmarks/speed.py --quick              # two contenders at a time: checks that it works (CI)

Sections (each row: the reference, ptbr, and the ratio, >1 meaning ptbr is ahead):
  pretrain  tokens/s of `ptbr train` against transformers' Trainer and a minimal PyTorch loop on
            the same LlamaForCausalLM, token windows, batch, sequence length, precision and AdamW
            (fused), for tiny and 85m (and 400m on a GPU, with MFU), and against ptbr's own
            --no-chunked-loss; with --compile against the Trainer's torch_compile (on a GPU also
            against the Trainer in torch.compile's reduce-overhead mode, left out with a note if it
            fails, and ptbr's own --compile --no-cuda-graphs); and from those same runs, the time
            from the command to its first completed step.
  vocab32k  the same at a 32k vocabulary (random tokens; tiny, batch 8 x 256), where ptbr's chunked
            loss makes several chunks: tokens/s and peak memory against the Trainer, the plain loop and ptbr's
            own --no-chunked-loss; and ptbr --compile against --compile --no-chunked-loss (on a GPU
            in bf16/fp16, where --compile takes the whole logits either way: against eager ptbr); on CPU
            also 85m (batch 8 x 256) in ptbr's default precision there (bf16 where the CPU has it)
            against the Trainer in that precision and ptbr's --no-chunked-loss.
  finetune  LoRA and QLoRA tokens/s and peak memory of `ptbr finetune` against transformers +
            PEFT's Trainer on the same random Mistral-shaped base and plain-text data.
  finetune32k  QLoRA the same with Mistral-7B's 32k-entry output layer, where ptbr's chunked loss
            makes several chunks: also against ptbr's own --no-chunked-loss.
  startup   `ptbr --help` against `transformers --help`.
  data      MB/s of text to tokens: ptbr prepare (with an existing tokenizer) against the same
            documents through `tokenizers` directly.
  MLX rows: any mlx_lora_speed_*.json in the output directory (benchmarks/results/ by default;
            benchmarks/mlx_lora_speed.py writes them there, on a Mac) join the table.

Every contender runs in its own fresh process; the contenders of a row alternate, round after
round, and each gives the median of its timed steps (the first steps are not timed: allocator and
kernels warming up). A row shows each side's median over rounds and their ratio, and beside it the
lowest and highest ratio within a round: the load of a shared machine drifts, and that spread says
how far one round's noise reaches.

Writes benchmarks/results/speed_DEVICE.json (every run's numbers) and speed_DEVICE.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
WORKERS = Path(__file__).resolve().parent / "speed_workers.py"
RESULTS = Path(__file__).resolve().parent / "results"
FIRST_STEP_MARKERS = ("FIRST_STEP", "first step done")

# (size, batch_size, seq_len) per device; --quick runs the first CPU one with a few steps
PRETRAIN_SHAPES = {
    "cpu": [("tiny", 8, 256), ("85m", 2, 256)],
    "cuda": [("tiny", 8, 256), ("85m", 16, 1024), ("400m", 8, 1024)],
}
# the pretraining rows' vocabulary: 0 is the bundled sample's (2,048 tokens, a small dataset);
# on a GPU, random tokens over 32,000 (a real PT-BR tokenizer's size, the output layer's real cost)
PRETRAIN_VOCAB = {"cpu": 0, "cuda": 32000}
# the data section's contenders tokenize with tokenizers' own threads, as `ptbr prepare` and a script
# calling tokenizers do when run (every other worker runs without them)
PARALLEL_TOKENIZING = ("ptbr-prepare", "tokenizers-prepare")
# references that may not run everywhere: one that fails is left out of its section, with a note
OPTIONAL_REFERENCES = {"hf_trainer_compile_graphs": "HF Trainer, torch_compile=True, torch_compile_mode=reduce-overhead"}
# contenders that run CUDA graphs on a GPU (torch.compile's reduce-overhead mode), by their labels
GRAPHED_CONTENDERS = {"ptbr_compile": "ptbr --compile", "hf_trainer_compile_graphs": OPTIONAL_REFERENCES["hf_trainer_compile_graphs"]}
# dense bf16/fp16 tensor-core peaks (FLOP/s), by a word of torch.cuda.get_device_name()
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12,
                  "A10": 125e12, "V100": 125e12, "T4": 65e12, "P100": 19e12}


def run_worker(kind: str, spec: dict) -> dict:
    """A contender in a fresh process: its RESULT, plus the seconds from its start to its first
    completed step (as its first-step line arrives) and to its exit."""
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if kind not in PARALLEL_TOKENIZING:  # (tokenizers warns of its threads where a training worker forks)
        env["TOKENIZERS_PARALLELISM"] = "false"
    process = subprocess.Popen([sys.executable, str(WORKERS), kind, json.dumps(spec)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first_step, result, lines = None, None, []
    for line in process.stdout:
        lines.append(line)
        if first_step is None and any(marker in line for marker in FIRST_STEP_MARKERS):
            first_step = time.perf_counter() - started
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    process.wait()
    if process.returncode or result is None:
        raise RuntimeError(f"{kind} failed (exit {process.returncode}):\n{''.join(lines[-40:])}")
    return result | {"first_step_s": first_step, "wall_s": time.perf_counter() - started}


def side_by_side(args) -> int:
    """Contenders run at once: one at a time whenever anything is timed; --quick, which only checks
    that every contender runs, runs two side by side (its numbers then say nothing)."""
    return 2 if args.quick else 1


def interleaved(contenders: dict[str, tuple[str, dict]], rounds: int, optional: frozenset = frozenset(),
                failed: dict[str, str] | None = None, jobs: int = 1) -> dict[str, list[dict]]:
    """Every contender once per round, in a rotating order, so that none always runs first. A
    contender named in `optional` that fails is left out from then on, its earlier rounds too (why,
    in `failed`), instead of ending the section: a reference setting that may not run everywhere.
    With `jobs` above 1 (--quick) a round's contenders run that many at a time, and a failure ends
    the section once the round's running contenders are done."""
    from concurrent.futures import ThreadPoolExecutor

    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        order = [name for name in names[round_index % len(names):] + names[:round_index % len(names)] if name in runs]

        def start(name: str, round_index: int = round_index) -> dict:
            kind, spec = contenders[name]
            return run_worker(kind, dict(spec, output=str(Path(spec["output"]) / f"{name}-{round_index}")))

        if jobs > 1:
            with ThreadPoolExecutor(jobs) as pool:
                futures = [(name, pool.submit(start, name)) for name in order]
            outcomes = ((name, future.result) for name, future in futures)
        else:  # one at a time: a failure ends the section at once
            outcomes = ((name, lambda name=name: start(name)) for name in order)
        for name, outcome in outcomes:
            try:
                runs[name].append(outcome())
            except RuntimeError as error:
                if name not in optional:
                    raise
                del runs[name]  # its earlier rounds too: every pair compares the same rounds
                if failed is not None:
                    failed[name] = failure(str(error))
                print(f"  {name} round {round_index + 1}: failed, left out ({failed.get(name) if failed else error})",
                      flush=True)
                continue
            print(f"  {name} round {round_index + 1}: {summary(runs[name][-1])}", flush=True)
    return runs


def failure(error: str) -> str:
    """A failed worker's error in one line: run_worker's first line (which worker, its exit code) and
    the exception its output ends with (the last line that names one: torch.compile's errors end
    with hints about environment variables instead)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else "no output"
    raised = [line for line in lines[1:] if re.match(r"[\w.]+(Error|Exception|Failed|Exit)\b", line)]
    return f"{lines[0].rstrip(':')}: {(raised or lines)[-1][:200]}"


def summary(run: dict) -> str:
    if "step_s" in run:
        return f"median step {statistics.median(run['step_s']):.3f} s, first step after {run['first_step_s']:.1f} s"
    return f"{run['seconds']:.2f} s"


def paired_ratio(ours: list[float], theirs: list[float]) -> list[float]:
    """theirs/ours within each round (a time: above 1, ptbr took less): the spread a row shows
    beside its ratio."""
    return [t / o for o, t in zip(ours, theirs, strict=True)]


def steps_and_peaks(runs: dict[str, list[dict]]) -> tuple[dict, dict]:
    """Per contender, its runs' median step times and their peak memory."""
    return ({name: [statistics.median(r["step_s"]) for r in rs] for name, rs in runs.items()},
            {name: [r["peak_memory_bytes"] for r in rs] for name, rs in runs.items()})


LOWER_IS_BETTER = ("s", "MB")  # units of time and memory; the others are throughputs


def row(section: str, name: str, metric: str, unit: str, reference: str, reference_value: float, ptbr_value: float,
        round_ratios: list[float], command: str, **extra) -> dict:
    """A table row. Its ratio is that of the two values it shows (each the median over rounds),
    above 1 where ptbr is ahead; `round_ratios`, the same ratio within each round, give its spread
    (a noisy round shows there, not as a ratio the values contradict)."""
    ratio = reference_value / ptbr_value if unit in LOWER_IS_BETTER else ptbr_value / reference_value
    return {"section": section, "name": name, "metric": metric, "unit": unit, "reference": reference,
            "reference_value": reference_value, "ptbr_value": ptbr_value, "ratio": ratio,
            "round_ratios": round_ratios, "command": command, **extra}


# ---- sections ---------------------------------------------------------------------------------


def flops_per_token(size: str, vocab_size: int, seq_len: int) -> float:
    """6N (forward and backward through every weight, the tied output layer included) plus the
    attention's scores and weighted values: 12 x layers x hidden x seq_len (PaLM's appendix B)."""
    from ptbr.config import get_preset

    preset = get_preset(size)
    return 6 * preset.param_count(vocab_size) + 12 * preset.num_layers * preset.hidden_size * seq_len


def gpu_peak_flops() -> tuple[str, float | None]:
    import torch

    name = torch.cuda.get_device_name()
    return name, next((peak for word, peak in GPU_PEAK_FLOPS.items() if word in name), None)


def pretrain_spec(args, size: str, batch_size: int, seq_len: int, precision: str, output: Path,
                  data: Path | None = None) -> dict:
    """What a pretraining contender runs (speed_workers.py), alike for every side of a row."""
    return {"size": size, "batch_size": batch_size, "seq_len": seq_len, "device": args.device,
            "precision": precision, "warmup": args.warmup, "steps": args.steps, "output": str(output),
            **({"data": str(data)} if data else {})}


def pretrain_command(size: str, batch_size: int, seq_len: int, device: str, precision: str, data: bool) -> str:
    """ptbr's side of a pretraining row, as a user types it."""
    return (f"ptbr train {'--data DATA ' if data else ''}--model-size {size} --batch-size {batch_size} "
            f"--seq-len {seq_len} --device {device} --precision {precision}")


def pretrain_section(args, work: Path) -> list[dict]:
    from ptbr.backends.torch.device import cpu_has_native_bf16
    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokens import open_dataset

    vocab = args.vocab if args.vocab is not None else PRETRAIN_VOCAB[args.device]
    data = None
    if vocab:  # random tokens over a real tokenizer's vocabulary, enough for every step of the largest shape
        data = work / f"vocab{vocab}"
        make_vocab_dataset(data, vocab, 50_000 if args.quick else 4_000_000)
    else:
        vocab = open_dataset(SAMPLE_DIR, None).vocab_size
    shapes = PRETRAIN_SHAPES[args.device]
    if args.sizes:
        shapes = [s for s in shapes if s[0] in args.sizes]
    if args.quick:
        shapes = [("tiny", 2, 32)]
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    # on a CPU that computes bf16 natively, ptbr's --precision auto pretrains in bf16 autocast: its
    # default against the Trainer's (fp32), and against the Trainer told bf16=True
    default_is_bf16 = args.device == "cpu" and args.precision is None and cpu_has_native_bf16()
    rows = []
    for size, batch_size, seq_len in shapes:
        spec = pretrain_spec(args, size, batch_size, seq_len, precision, work / size, data)
        print(f"pretraining {size}: batch {batch_size} x seq_len {seq_len}, {precision}, {args.device}, "
              f"vocabulary {vocab:,}", flush=True)
        # ptbr_whole: ptbr's own whole logits (--no-chunked-loss), the chunked loss's lever alone
        contenders = {"ptbr": ("ptbr-pretrain", spec), "hf_trainer": ("hf-pretrain", spec),
                      "plain_loop": ("plain-pretrain", spec),
                      "ptbr_whole": ("ptbr-pretrain", dict(spec, flags=["--no-chunked-loss"]))}
        if not args.no_compile:  # torch.compile on both sides: ptbr's --compile, the Trainer's torch_compile
            contenders |= {"ptbr_compile": ("ptbr-pretrain", dict(spec, flags=["--compile"], cold_compile=True)),
                           "hf_trainer_compile": ("hf-pretrain", dict(spec, torch_compile=True, cold_compile=True))}
            if args.device == "cuda":  # --compile replays its steps as CUDA graphs there: the lever alone, and
                # the Trainer told to do the same (torch.compile's reduce-overhead mode; it may not run)
                contenders["ptbr_compile_no_graphs"] = ("ptbr-pretrain", dict(spec, flags=["--compile", "--no-cuda-graphs"],
                                                                              cold_compile=True))
                contenders["hf_trainer_compile_graphs"] = ("hf-pretrain", dict(
                    spec, torch_compile=True, torch_compile_mode="reduce-overhead", cold_compile=True))
        if default_is_bf16:  # what each runs when left to its defaults, and both in bf16
            contenders |= {"ptbr_default": ("ptbr-pretrain", dict(spec, flags=["--precision", "auto"])),
                           "hf_trainer_bf16": ("hf-pretrain", dict(spec, precision="bf16"))}
        failed: dict[str, str] = {}
        runs = interleaved(contenders, args.rounds, frozenset(OPTIONAL_REFERENCES), failed, side_by_side(args))
        tokens = batch_size * seq_len
        step = {name: [statistics.median(r["step_s"]) for r in rs] for name, rs in runs.items()}
        first = {name: [r["first_step_s"] for r in rs] for name, rs in runs.items()}
        command = pretrain_command(size, batch_size, seq_len, args.device, precision, data is not None)
        mfu = {}
        if args.device == "cuda":
            device_name, peak = gpu_peak_flops()
            if peak is not None and precision in ("bf16", "fp16"):
                per_token = flops_per_token(size, vocab, seq_len)
                mfu = {name: per_token * tokens / statistics.median(s) / peak for name, s in step.items()}
        pairs = [("ptbr", "hf_trainer", "HF Trainer"), ("ptbr", "plain_loop", "plain PyTorch loop"),
                 ("ptbr", "ptbr_whole", "ptbr --no-chunked-loss")]
        if not args.no_compile:
            pairs += [("ptbr_compile", "hf_trainer", "HF Trainer"),
                      ("ptbr_compile", "hf_trainer_compile", "HF Trainer, torch_compile=True")]
            if "ptbr_compile_no_graphs" in contenders:
                pairs.append(("ptbr_compile", "ptbr_compile_no_graphs", "ptbr --compile --no-cuda-graphs"))
            if "hf_trainer_compile_graphs" in runs:
                pairs.append(("ptbr_compile", "hf_trainer_compile_graphs", OPTIONAL_REFERENCES["hf_trainer_compile_graphs"]))
        if default_is_bf16:
            pairs += [("ptbr_default", "hf_trainer", "HF Trainer (its default: fp32)"),
                      ("ptbr_default", "hf_trainer_bf16", "HF Trainer, bf16=True")]
        first_row = len(rows)  # ptbr against the Trainer
        for ours, reference, label in pairs:
            compiled = ours == "ptbr_compile"
            extra = {"device_name": device_name, "mfu_ptbr": mfu[ours], "mfu_reference": mfu[reference]} if mfu else {}
            if compiled:  # the compile, paid once at the first step: reported apart, and when it pays off
                compile_s = statistics.median(first[ours]) - statistics.median(first["ptbr"])
                saved = statistics.median(step["ptbr"]) - statistics.median(step[ours])
                extra |= {"compile_s": compile_s, "break_even_steps": compile_s / saved if saved > 0 else None}
            default = ours == "ptbr_default"
            name = (f"pretrain {size} (batch {batch_size} x {seq_len}, " + (f"{vocab // 1000}k vocabulary, " if data else "")
                    + ("ptbr's default: bf16 autocast on this CPU)" if default else f"{precision})")
                    + (", --compile" if compiled else ""))
            rows.append(row("pretrain", name,
                            "tokens/s", "tokens/s", label, tokens / statistics.median(step[reference]),
                            tokens / statistics.median(step[ours]), paired_ratio(step[ours], step[reference]),
                            command.replace(f"--precision {precision}", "--precision auto") if default
                            else command + (" --compile" if compiled else ""),
                            runs={k: runs[k] for k in (ours, reference)}, **extra))
        if size == "tiny":
            rows.append(row("startup", f"command to first step, pretrain {size}", "seconds", "s", "HF Trainer",
                            statistics.median(first["hf_trainer"]), statistics.median(first["ptbr"]),
                            paired_ratio(first["ptbr"], first["hf_trainer"]), command))
        # a contender whose CUDA graphs inductor skipped ran without them: said under the table
        skipped = {GRAPHED_CONTENDERS[name]: max(r.get("cudagraph_skips", 0) for r in rs)
                   for name, rs in runs.items() if name in GRAPHED_CONTENDERS and args.device == "cuda"}
        if any(skipped.values()):
            rows[first_row]["cudagraph_skips"] = {label: count for label, count in skipped.items() if count}
        if failed:  # shown under the table
            rows[first_row]["failed_references"] = {OPTIONAL_REFERENCES[name]: message for name, message in failed.items()}
        if args.device == "cpu":
            rows[first_row].update(kernel_floor_row(spec, statistics.median(step["hf_trainer"])))
    return rows


def make_vocab_dataset(directory: Path, vocab_size: int, tokens: int) -> None:
    """A dataset in ptbr's layout over a `vocab_size`-token vocabulary: a word-level tokenizer of
    that many entries and uniformly random token ids. Speed and memory depend on the shapes only,
    and no tokenizer of 32k tokens can be trained on the bundled sample's 49 KB."""
    import hashlib

    import numpy as np
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from ptbr.data.tokenizer import SPECIAL_TOKENS

    directory.mkdir(parents=True, exist_ok=True)
    words = [*SPECIAL_TOKENS, *(f"t{i}" for i in range(len(SPECIAL_TOKENS), vocab_size))]  # ids 0, 1: eos, pad
    tokenizer = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[-1]))
    tokenizer.save(str(directory / "tokenizer.json"))
    rng = np.random.default_rng(0)
    splits = {"train": tokens, "val": tokens // 20}
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"  # as ptbr prepare stores ids
    for split, count in splits.items():
        rng.integers(2, vocab_size, size=count).astype(np.dtype(dtype).newbyteorder("<")).tofile(directory / f"{split}.bin")
    meta = {"format": "ptbr-tokens", "version": 1, "dtype": dtype, "byte_order": "little",
            "vocab_size": vocab_size, "eos_id": 0, "pad_id": 1, "train_tokens": splits["train"],
            "val_tokens": splits["val"], "train_documents": 1, "val_documents": 1,
            "tokenizer_sha256": hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest(),
            "sources": ["random"]}
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def large_vocab_section(args, work: Path) -> list[dict]:
    """Pretraining at a 32k vocabulary (random tokens), where ptbr's chunked loss makes several
    chunks: tokens/s and peak memory against the Trainer and the plain loop (both compute the whole
    fp32 logits), and against ptbr's own --no-chunked-loss (the lever alone)."""
    data = work / "vocab32k"
    make_vocab_dataset(data, 32000, 200_000)
    size, batch_size, seq_len = ("tiny", 2, 160) if args.quick else ("tiny", 8, 256)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    spec = pretrain_spec(args, size, batch_size, seq_len, precision, work / "vocab32k-runs", data)
    print(f"pretraining {size} at a 32k vocabulary: batch {batch_size} x seq_len {seq_len}, {precision}", flush=True)
    contenders = {"ptbr": ("ptbr-pretrain", spec), "hf_trainer": ("hf-pretrain", spec),
                  "plain_loop": ("plain-pretrain", spec),
                  "ptbr_whole": ("ptbr-pretrain", dict(spec, flags=["--no-chunked-loss"]))}
    if not args.no_compile:
        # --compile: on a CPU (or in fp32) the decoder compiled and the chunked loss eager, against the
        # forward pass and the whole logits' loss compiled together; on a GPU in 16 bits --compile
        # compiles the whole logits' loss either way (ptbr.memory.compiled_whole_logits): against eager ptbr
        from ptbr.memory import compiled_whole_logits

        contenders["ptbr_compile"] = ("ptbr-pretrain", dict(spec, flags=["--compile"]))
        if not compiled_whole_logits(batch_size * seq_len, 32000, precision, args.device):
            contenders["ptbr_compile_whole"] = ("ptbr-pretrain", dict(spec, flags=["--compile", "--no-chunked-loss"]))
    runs = interleaved(contenders, args.rounds, jobs=side_by_side(args))
    tokens = batch_size * seq_len
    command = pretrain_command(size, batch_size, seq_len, args.device, precision, True)
    name = f"pretrain {size}, 32k vocabulary (batch {batch_size} x {seq_len}, {precision})"
    rows = speed_and_memory_rows("pretrain", name, command, args.device, runs, tokens, "ptbr", (
        ("hf_trainer", "HF Trainer"), ("plain_loop", "plain PyTorch loop"), ("ptbr_whole", "ptbr --no-chunked-loss")))
    if "ptbr_compile" in runs:
        against = (("ptbr_compile_whole", "ptbr --compile --no-chunked-loss") if "ptbr_compile_whole" in runs
                   else ("ptbr", "ptbr (eager)"))
        rows += speed_and_memory_rows("pretrain", f"{name}, --compile", f"{command} --compile", args.device, runs,
                                      tokens, "ptbr_compile", (against,))
    if not args.quick and args.device == "cpu":
        rows += large_vocab_85m_rows(args, work, data)
    return rows


def large_vocab_85m_rows(args, work: Path, data: Path) -> list[dict]:
    """85m at a 32k vocabulary, batch 8 x 256, in ptbr's default precision on this CPU (bf16
    autocast where it multiplies bf16 natively, where chunks hold at least twice the hidden size,
    else fp32), against the Trainer in the same precision and ptbr's own --no-chunked-loss."""
    from ptbr.backends.torch.device import cpu_has_native_bf16

    precision = args.precision or ("bf16" if cpu_has_native_bf16() else "fp32")
    size, batch_size, seq_len = "85m", 8, 256
    spec = pretrain_spec(args, size, batch_size, seq_len, precision, work / "vocab32k-85m", data)
    print(f"pretraining {size} at a 32k vocabulary: batch {batch_size} x seq_len {seq_len}, {precision}", flush=True)
    runs = interleaved({"ptbr": ("ptbr-pretrain", spec), "hf_trainer": ("hf-pretrain", spec),
                        "ptbr_whole": ("ptbr-pretrain", dict(spec, flags=["--no-chunked-loss"]))}, args.rounds,
                       jobs=side_by_side(args))
    command = pretrain_command(size, batch_size, seq_len, args.device, precision, True)
    return speed_and_memory_rows("pretrain", f"pretrain {size}, 32k vocabulary (batch {batch_size} x {seq_len}, "
                                 f"{precision})", command, args.device, runs, batch_size * seq_len, "ptbr",
                                 (("hf_trainer", "HF Trainer" + (", bf16=True" if precision == "bf16" else "")),
                                  ("ptbr_whole", "ptbr --no-chunked-loss")))


def speed_and_memory_rows(section: str, name: str, command: str, device: str, runs: dict, tokens: float, ours: str,
                          references: tuple) -> list[dict]:
    """Tokens/s and peak memory of the contender `ours` against each (reference, label)."""
    step, memory = steps_and_peaks(runs)
    what = "peak GPU memory" if device == "cuda" else "peak resident memory"
    rows = []
    for reference, label in references:
        rows.append(row(section, name, "tokens/s", "tokens/s", label, tokens / statistics.median(step[reference]),
                        tokens / statistics.median(step[ours]), paired_ratio(step[ours], step[reference]),
                        command, runs={k: runs[k] for k in (ours, reference)}))
        rows.append(row(section, name, what, "MB", label, statistics.median(memory[reference]) / 1e6,
                        statistics.median(memory[ours]) / 1e6, paired_ratio(memory[ours], memory[reference]),
                        command))
    return rows


def kernel_floor_row(spec: dict, trainer_step_s: float) -> dict:
    """The plain loop's time per step in the kernels every contender runs alike (matrix multiplies,
    attention, AdamW: the same calls on the same shapes in each), each timed as it runs, in one
    fresh process (steps with and without that clock alternating), and the bound they set: no
    trainer running these kernels takes less time a step, so none can be faster than the Trainer
    (`trainer_step_s`, its median step over the rounds) by more than its step over them."""
    floor = run_worker("kernel-floor", dict(spec, output=str(Path(spec["output"]) / "floor")))
    kernels = floor["kernels_s"]
    floor_s = sum(kernels.values())
    print("  shared kernels: " + ", ".join(f"{group} {1000 * s:,.0f} ms" for group, s in kernels.items())
          + f" of a {1000 * floor['step_s']:,.0f} ms step ({floor['kernel_calls']} calls)", flush=True)
    return {"kernels_s": kernels, "kernel_share": min(1.0, floor_s / floor["step_s"]), "floor_step_s": floor["step_s"],
            "trainer_step_s": trainer_step_s, "kernel_ceiling": trainer_step_s / floor_s}


def make_finetune_base(directory: Path, quick: bool, vocab: int | None = None) -> None:
    """A random Mistral-shaped base (grouped-query attention, SwiGLU) with the bundled tokenizer;
    `vocab`: an output layer that wide (Mistral-7B's 32,000), of which the tokenizer uses the first
    2,048 entries (speed and memory depend on the shapes only)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokenizer import load_tokenizer, save_for_transformers

    vocab = vocab or load_tokenizer(SAMPLE_DIR / "tokenizer.json").get_vocab_size()
    hidden, layers = (64, 2) if quick else (256, 4)
    config = MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(3.5 * hidden),
                           num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=2,
                           max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=0, pad_token_id=1,
                           bos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(str(directory))
    save_for_transformers(SAMPLE_DIR / "tokenizer.json", directory)


def make_finetune_data(path: Path, examples: int, words: int) -> float:
    """Plain-text examples cut from the bundled sample; returns their mean length in tokens."""
    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokenizer import load_tokenizer

    text = (SAMPLE_DIR / "sample_ptbr.txt").read_text(encoding="utf-8").split()
    rows = [" ".join(text[(i * words) % (len(text) - words):][:words]) for i in range(examples)]
    path.write_text("".join(json.dumps({"text": r}, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tokenizer = load_tokenizer(SAMPLE_DIR / "tokenizer.json")
    return statistics.mean(len(e.ids) for e in tokenizer.encode_batch(rows))


def finetune_section(args, work: Path) -> list[dict]:
    base, data = work / "base", work / "train.jsonl"
    base.mkdir(parents=True, exist_ok=True)
    make_finetune_base(base, args.quick)
    batch_size, words, max_seq_len = (2, 20, 64) if args.quick else (4, 120, 512)
    mean_tokens = make_finetune_data(data, batch_size * (args.warmup + args.steps + 1), words)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    rows = []
    for quant, label in (("none", "LoRA"), ("4bit", "QLoRA 4-bit")):
        spec = {"base": str(base), "data": str(data), "quant": quant, "rank": 16, "batch_size": batch_size,
                "max_seq_len": max_seq_len, "device": args.device, "precision": precision, "warmup": args.warmup,
                "steps": args.steps, "output": str(work / quant)}
        print(f"fine-tuning, {label}: batch {batch_size}, ~{mean_tokens:.0f} tokens per example", flush=True)
        runs = interleaved({"ptbr": ("ptbr-finetune", spec), "hf_peft": ("hf-finetune", spec)}, args.rounds,
                           jobs=side_by_side(args))
        step, memory = steps_and_peaks(runs)
        tokens = batch_size * mean_tokens
        command = (f"ptbr finetune --base BASE --data train.jsonl --quant {quant} --lora-r 16 "
                   f"--batch-size {batch_size} --device {args.device} --precision {precision}")
        name = f"{label} fine-tuning (Mistral-shaped, batch {batch_size}, {precision})"
        rows.append(row("finetune", name, "tokens/s", "tokens/s", "transformers + PEFT Trainer",
                        tokens / statistics.median(step["hf_peft"]), tokens / statistics.median(step["ptbr"]),
                        paired_ratio(step["ptbr"], step["hf_peft"]), command, runs=runs))
        what = "peak GPU memory" if args.device == "cuda" else "peak resident memory"
        rows.append(row("finetune", name, what, "MB", "transformers + PEFT Trainer",
                        statistics.median(memory["hf_peft"]) / 1e6, statistics.median(memory["ptbr"]) / 1e6,
                        paired_ratio(memory["ptbr"], memory["hf_peft"]), command))
    return rows


def large_vocab_finetune_section(args, work: Path) -> list[dict]:
    """QLoRA at Mistral-7B's 32k vocabulary, where a micro-batch's logits exceed one chunk and
    ptbr's chunked loss makes several: tokens/s and peak memory against transformers + PEFT's
    Trainer (the whole fp32 logits) and against ptbr's own --no-chunked-loss (the lever alone)."""
    base, data = work / "base32k", work / "train32k.jsonl"
    base.mkdir(parents=True, exist_ok=True)
    make_finetune_base(base, args.quick, vocab=32000)
    batch_size, words, max_seq_len = (2, 120, 256) if args.quick else (4, 120, 512)
    mean_tokens = make_finetune_data(data, batch_size * (args.warmup + args.steps + 1), words)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    spec = {"base": str(base), "data": str(data), "quant": "4bit", "rank": 16, "batch_size": batch_size,
            "max_seq_len": max_seq_len, "device": args.device, "precision": precision, "warmup": args.warmup,
            "steps": args.steps, "output": str(work / "finetune32k")}
    print(f"fine-tuning, QLoRA 4-bit at a 32k vocabulary: batch {batch_size}, ~{mean_tokens:.0f} tokens per example",
          flush=True)
    runs = interleaved({"ptbr": ("ptbr-finetune", spec), "hf_peft": ("hf-finetune", spec),
                        "ptbr_whole": ("ptbr-finetune", dict(spec, flags=["--no-chunked-loss"]))}, args.rounds,
                       jobs=side_by_side(args))
    command = (f"ptbr finetune --base BASE --data train.jsonl --quant 4bit --lora-r 16 --batch-size {batch_size} "
               f"--device {args.device} --precision {precision}")
    name = f"QLoRA 4-bit fine-tuning, 32k vocabulary (Mistral-shaped, batch {batch_size}, {precision})"
    return speed_and_memory_rows("finetune", name, command, args.device, runs, batch_size * mean_tokens, "ptbr", (
        ("hf_peft", "transformers + PEFT Trainer"), ("ptbr_whole", "ptbr --no-chunked-loss")))


def timed_command(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def startup_section(args, work: Path) -> list[dict]:
    ours = [sys.executable, "-m", "ptbr", "--help"]
    transformers_cli = shutil.which("transformers", path=str(Path(sys.executable).parent))
    theirs, label = ([transformers_cli, "--help"], "transformers --help") if transformers_cli else (
        [sys.executable, "-c", "import torch"], "python -c 'import torch'")
    times: dict[str, list[float]] = {"ptbr": [], "reference": []}
    for _ in range(2 if args.quick else 7):
        times["ptbr"].append(timed_command(ours))
        times["reference"].append(timed_command(theirs))
    print(f"  ptbr --help: median {statistics.median(times['ptbr']):.3f} s; {label}: "
          f"{statistics.median(times['reference']):.3f} s", flush=True)
    return [row("startup", "`ptbr --help` start-up", "seconds", "s", label, statistics.median(times["reference"]),
                statistics.median(times["ptbr"]), paired_ratio(times["ptbr"], times["reference"]), "ptbr --help")]


def data_section(args, work: Path) -> list[dict]:
    from ptbr.data import SAMPLE_DIR

    sample = (SAMPLE_DIR / "sample_ptbr.txt").read_text(encoding="utf-8")
    target = 200_000 if args.quick else args.data_mb * 1_000_000
    text = (sample.rstrip() + "\n\n") * max(1, target // len(sample.encode("utf-8")))
    corpus = work / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    megabytes = corpus.stat().st_size / 1e6
    spec = {"input": str(corpus), "tokenizer": str(SAMPLE_DIR / "tokenizer.json"), "output": str(work / "out")}
    print(f"data preparation: {megabytes:.1f} MB of text", flush=True)
    runs = interleaved({"ptbr": ("ptbr-prepare", spec), "tokenizers": ("tokenizers-prepare", spec)}, args.rounds,
                       jobs=side_by_side(args))
    seconds = {name: [r["seconds"] for r in rs] for name, rs in runs.items()}
    return [row("data", f"text to tokens ({megabytes:.0f} MB, bundled tokenizer)", "MB/s", "MB/s",
                "tokenizers directly", megabytes / statistics.median(seconds["tokenizers"]),
                megabytes / statistics.median(seconds["ptbr"]), paired_ratio(seconds["ptbr"], seconds["tokenizers"]),
                "ptbr prepare --input corpus.txt --tokenizer tokenizer.json --output data", runs=runs)]


SECTIONS = {"pretrain": pretrain_section, "vocab32k": large_vocab_section, "finetune": finetune_section,
            "finetune32k": large_vocab_finetune_section, "startup": startup_section, "data": data_section}


# ---- the table --------------------------------------------------------------------------------


def mlx_rows(results: Path = RESULTS) -> list[dict]:
    """Rows from benchmarks/mlx_lora_speed.py's JSON files (ptbr's MLX LoRA against mlx_lm.lora)."""
    rows = []
    for path in sorted(results.glob("mlx_lora_speed_*.json")):
        found = json.loads(path.read_text())
        ours, theirs = found["ptbr"], found["mlx_lm_lora"]
        rows.append(row("mlx", f"MLX LoRA fine-tuning ({found.get('device', 'MLX')})", "tokens/s", "tokens/s",
                        "mlx_lm.lora", theirs["tokens_per_s"], ours["tokens_per_s"], found.get("round_ratios", []),
                        found.get("command", "python benchmarks/mlx_lora_speed.py"), source=path.name))
    return rows


def number(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "MB":
        return f"{value:,.0f} MB"
    return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"


def markdown(result: dict) -> str:
    """The README's table: one line per row, ratios > 1 meaning ptbr is ahead, then the commands."""
    load = result["conditions"].get("load_average")
    busy = f", load average {load[0]:.1f} at the start" if load else ""
    commands = {r["benchmark_command"] for r in result["rows"] if r.get("benchmark_command")}
    last = (f" These are the conditions of the last run (`{result['conditions']['command']}`); the rows kept from "
            f"earlier runs name theirs under Reproduce." if len(commands) > 1 else "")
    lines = [f"Measured on {result['conditions']['machine']} ({result['conditions']['when']}{busy}); "
             f"{result['conditions']['method']}{last}", "",
             "| Benchmark | Metric | Reference | Reference | ptbr | ptbr advantage |",
             "|---|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        theirs, ours = number(r["reference_value"], r["unit"]), number(r["ptbr_value"], r["unit"])
        if "mfu_ptbr" in r:
            theirs, ours = f"{theirs} (MFU {percent(r['mfu_reference'])})", f"{ours} (MFU {percent(r['mfu_ptbr'])})"
        spread = r.get("round_ratios") or []
        within = f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else ""
        lines.append(f"| {r['name']} | {r['metric']} | {r['reference']} | {theirs} | {ours} | {r['ratio']:.2f}x{within} |")
    notes = []
    for r in result["rows"]:
        if r.get("compile_s") is not None and r["reference"] == "HF Trainer":
            pays = (f"it pays for itself after {r['break_even_steps']:,.0f} steps" if r.get("break_even_steps")
                    else "its steps were no faster here")
            notes.append(f"- {r['name']}: compiling took {r['compile_s']:.0f} s more before the first step, from an "
                         f"empty cache (a later run of the same shapes reuses it); {pays}.")
        for name, message in (r.get("failed_references") or {}).items():
            notes.append(f"- {r['name']}: the reference \"{name}\" failed and is left out ({message}).")
        for label, count in (r.get("cudagraph_skips") or {}).items():
            notes.append(f"- {r['name']}: \"{label}\" ran without CUDA graphs in {count} compiled function(s) "
                         "(inductor skipped them; its log says why).")
        if r.get("kernel_ceiling"):
            kernels = ", ".join(f"{group} {1000 * seconds:,.0f} ms" for group, seconds in r["kernels_s"].items())
            floor_ms = 1000 * sum(r["kernels_s"].values())
            if floor_ms >= 1000 * r["floor_step_s"]:  # timed in other steps than the step they are part of
                notes.append(f"- {r['name']}: the kernels every contender runs alike ({kernels}) took {floor_ms:,.0f} ms, "
                             f"more than the plain loop's {1000 * r['floor_step_s']:,.0f} ms step they are part of "
                             f"(a machine busy with something else): no bound is read from this run.")
                continue
            notes.append(f"- {r['name']}: the kernels every contender runs alike ({kernels}; each timed as it runs, "
                         f"glibc keeping freed memory as in ptbr's runs) take {floor_ms:,.0f} ms a step, "
                         f"{100 * r['kernel_share']:.0f}% of the plain loop's {1000 * r['floor_step_s']:,.0f} ms in "
                         f"that process: even with everything else free, no trainer running them could be more than "
                         f"{r['kernel_ceiling']:.2f}x the Trainer's {1000 * r['trainer_step_s']:,.0f} ms step here "
                         f"(processes apart: the machine's drift between them is in it).")
        elif r.get("matmul_ceiling"):  # rows measured before the floor counted attention and AdamW
            notes.append(f"- {r['name']}: matrix multiplies are {1000 * r['matmul_s']:,.0f} ms of the plain loop's "
                         f"{1000 * r['floor_step_s']:,.0f} ms step ({100 * r['matmul_share']:.0f}%, one process, under "
                         f"torch's profiler): even with everything else free, no trainer of this model at this "
                         f"precision could be more than {r['matmul_ceiling']:.2f}x the Trainer here.")
    if notes:
        lines += [""] + notes
    benchmarks = list(dict.fromkeys(r.get("benchmark_command", result["conditions"]["command"]) for r in result["rows"]))
    lines += ["", "Reproduce: " + "; ".join(f"`{b}`" for b in benchmarks) + ". ptbr's side of each row:", ""]
    seen = []
    for r in result["rows"]:
        if r["command"] not in seen:
            seen.append(r["command"])
            lines.append(f"- {r['name']}: `{r['command']}`")
    return "\n".join(lines) + "\n"


def kept_rows(path: Path, new_rows: list[dict]) -> list[dict]:
    """The rows of an earlier run (e.g. `--only pretrain --sizes 85m` run apart) that this run did
    not measure again: a part of the table can be rerun without the rest."""
    if not path.is_file():
        return []
    replaced = {(r["section"], r["name"], r["metric"], r["reference"]) for r in new_rows}
    # a reference that failed this time (left out, with a note) takes its earlier rows of that shape with it
    failed = [(r["section"], r["name"], label) for r in new_rows for label in r.get("failed_references") or {}]
    return [r for r in json.loads(path.read_text())["rows"]
            if (r["section"], r["name"], r["metric"], r["reference"]) not in replaced and r["section"] != "mlx"
            and not any(r["section"] == section and r["name"].startswith(name) and r["reference"] == label
                        for section, name, label in failed)]


def percent(share: float) -> str:
    """A share as a percentage: whole percents, or a tenth where below one (a GPU's MFU at `tiny`)."""
    return f"{100 * share:.0f}%" if share >= 0.01 else f"{100 * share:.1f}%"


def cpu_name() -> str:
    """The CPU's model name where the system says it (Linux), with whether it multiplies bf16 in
    hardware: the fp32 and bf16 rows differ most between CPUs (AMX, AVX512-BF16, neither)."""
    from ptbr.backends.torch.device import cpu_bf16_units

    name = platform.processor() or platform.machine()
    try:
        models = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")]
    except OSError:
        models = []
    if models:
        name = f"{models[0]}, {platform.machine()}"
    units = cpu_bf16_units()
    return f"{name}, {' and '.join(units) if units else 'no native bf16'}"


def conditions(args) -> dict:
    import torch

    machine = f"{cpu_name()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    if args.device == "cuda":
        machine = f"{torch.cuda.get_device_name()}, {machine}"
    method = (f"each contender in a fresh process, {args.rounds} alternating round(s), "
              f"{args.warmup} untimed + {args.steps} timed steps each; a value is the median over rounds, the "
              f"ratio is that of the two values (time or memory: reference / ptbr; throughput: ptbr / "
              f"reference), and in brackets the lowest and highest ratio within a round.")
    return {"machine": machine, "when": time.strftime("%Y-%m-%d"), "method": method, "device": args.device,
            "load_average": os.getloadavg(), "quick": args.quick,
            "command": " ".join(["python benchmarks/speed.py", *args.argv])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                        help="default: bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--only", nargs="+", choices=tuple(SECTIONS), help="run these sections only")
    parser.add_argument("--sizes", nargs="+", help="pretraining presets to run (default: tiny and 85m; on a GPU also 400m)")
    parser.add_argument("--vocab", type=int, help="pretraining rows: random tokens over a vocabulary this large "
                        "(default: 32000 on a GPU; on CPU 0, the bundled sample and its 2,048-token vocabulary)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of every contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of every run")
    parser.add_argument("--data-mb", type=int, default=20, help="megabytes of text for the data section")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out the torch.compile contenders (ptbr --compile, the Trainer's torch_compile)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, one round, two timed steps, two contenders at a time: checks that "
                        "everything runs (CI); its numbers say nothing")
    parser.add_argument("--output-dir", default=str(RESULTS), help="where speed_DEVICE.json and .md are written")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what reproduces this run
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 1, 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    output = Path(args.output_dir)
    try:  # before the measuring, not after it
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--output-dir {output}: {exc.strerror or exc}")
    result = {"conditions": conditions(args), "rows": []}
    with tempfile.TemporaryDirectory(prefix="ptbr-speed-") as tmp:
        for name in args.only or SECTIONS:
            (Path(tmp) / name).mkdir()
            result["rows"] += SECTIONS[name](args, Path(tmp) / name)
    stem = f"speed_{args.device}" + ("_quick" if args.quick else "")
    for measured in result["rows"]:
        measured["benchmark_command"] = result["conditions"]["command"]
    result["rows"] += mlx_rows(output)  # MLX results kept beside this table (another machine's stay apart)
    result["rows"] = kept_rows(output / f"{stem}.json", result["rows"]) + result["rows"]
    (output / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (output / f"{stem}.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
