"""How good is the memory model? Predicted vs measured peak of real training steps, over a grid.

    python benchmarks/memory_accuracy.py                      # CPU grid, a few minutes on 2 cores
    python benchmarks/memory_accuracy.py --device cuda --jobs 4   # GPU grid (needs a CUDA GPU)
    python benchmarks/memory_accuracy.py --markdown --output results.json
    python benchmarks/memory_accuracy.py --device cuda --jobs 4 --chunked-loss   # ptbr's default loss

Each grid point runs in a fresh process: the real model (ptbr.backends.torch.models.build_model), the real
optimizer and the real step (ptbr.backends.torch.step.TorchStep) on random tokens, three optimizer steps so
that the AdamW state exists during a forward and backward pass (the steady-state peak). The loss
takes the whole logits (`--no-chunked-loss`) unless --chunked-loss asks for ptbr's default, the
chunked loss with the device's chunk size.

What is measured, and why it matches what is predicted:
- CUDA: torch.cuda.max_memory_allocated() after the warm-up's memory is freed and the peak stats
  reset. It counts tensors only; the CUDA context is neither counted nor predicted
  (ptbr.memory.RUNTIME_BYTES adds it when preflight plans a run).
- CPU: the growth of peak resident memory (ru_maxrss) over the resident memory just before the
  model is built. The baseline is taken after importing torch and transformers and after a
  warm-up step of a throwaway one-layer model, so that the interpreter, the libraries, their
  kernels, thread pools and allocator arenas are in the baseline, as they are outside the
  prediction. What is left is the model's tensors plus what glibc's allocator keeps around them
  (told, as in ptbr's CPU runs, to keep what is freed: ptbr/backends/torch/allocator.py).
  The CPU rows also give the peak of allocated tensor bytes (from torch.profiler's memory events
  over the third step, plus the parameters and optimizer state alive at its start): the gap
  between the two columns is allocator overhead, not model error. --malloc-release reruns the
  grid with glibc told to give freed memory back (resident memory then follows the tensors, but
  CPU steps ran about 2x slower here, from page faults).

The last CPU results are in benchmarks/results/ (the README table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

# (model_size, vocab_size, batch_size, seq_len, precision, gradient_checkpointing)
GRIDS = {
    "cpu": [
        ("tiny", 2048, 8, 256, "fp32", False),
        ("tiny", 2048, 32, 512, "fp32", False),
        ("tiny", 2048, 32, 512, "fp32", True),
        ("tiny", 32000, 8, 512, "fp32", False),
        ("85m", 32000, 1, 128, "fp32", False),
        ("85m", 32000, 4, 256, "fp32", False),
        ("85m", 32000, 8, 256, "fp32", False),
        ("85m", 32000, 8, 256, "fp32", True),
        ("85m", 32000, 4, 256, "bf16", False),
        ("400m", 32000, 1, 256, "fp32", False),
    ],
    "cuda": [
        (size, 32000, batch, seq, precision, checkpointing)
        for size, batch, seq in (("85m", 8, 512), ("85m", 32, 1024), ("400m", 8, 1024), ("800m", 4, 2048))
        for precision in ("bf16", "fp32")
        for checkpointing in (False, True)
    ],
}
STEPS = 3
GOAL = {"cuda": 0.10, "cpu": 0.20}


def predict(point: dict) -> dict:
    from ptbr.config import get_preset
    from ptbr.memory import Architecture, estimate_training_memory

    arch = Architecture.from_preset(get_preset(point["model_size"]), point["vocab_size"])
    estimate = estimate_training_memory(arch, point["batch_size"], point["seq_len"], point["precision"],
                                        point["gradient_checkpointing"], device=point["device"],
                                        chunked_loss=point.get("chunked_loss", False))
    return {"predicted": estimate.total, "phase": estimate.peak_phase}


def measure(point: dict) -> dict:
    """Runs in its own process: build, train STEPS steps, report the peak."""
    import resource

    import numpy as np
    import torch

    from ptbr.backends.torch.allocator import keep_freed_memory
    from ptbr.backends.torch.device import resolve_device, resolve_precision
    from ptbr.backends.torch.models import build_model
    from ptbr.backends.torch.step import TorchStep, build_optimizer
    from ptbr.config import LoopSettings, ModelPreset, get_preset
    from ptbr.data.batch import windows_to_batch

    placement = resolve_precision(resolve_device(point["device"]), point["precision"])
    cuda = placement.device.type == "cuda"
    if not cuda:  # as ptbr's CPU runs do (TorchBackend.create); --malloc-release's variable overrides it
        keep_freed_memory()
    settings = LoopSettings()

    def build(preset, vocab_size, checkpointing):
        model = build_model(preset, vocab_size, eos_id=0, seed=0).to(placement.device)
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        # the whole logits (--no-chunked-loss) unless the point asks for the chunked loss, as
        # predict() estimates them (the chunked loss's estimate is also checked in tests/test_memory.py)
        return TorchStep(model, build_optimizer(model, settings, placement.device), placement, 1.0,
                         chunked_loss=point.get("chunked_loss", False))

    def batch(vocab_size, batch_size, seq_len, seed):
        windows = np.random.default_rng(seed).integers(0, vocab_size, size=(batch_size, seq_len + 1))
        return windows_to_batch(windows)

    # warm-up on a throwaway one-layer model: kernels, thread pools and arenas join the baseline
    baseline = baseline_after_warm_up(build(ModelPreset("warm-up", 64, 1, 2, 2, 128, 64, 1e-3), 256,
                                            point["gradient_checkpointing"]),
                                      [batch(256, 2, 16, seed) for seed in range(2)], cuda)
    started = time.monotonic()
    backend = build(get_preset(point["model_size"]), point["vocab_size"], point["gradient_checkpointing"])
    for step in range(STEPS - 1):
        backend.train_step([batch(point["vocab_size"], point["batch_size"], point["seq_len"], step)], 1e-4)
    result = {"baseline": baseline}
    if cuda:
        torch.cuda.synchronize()
        backend.train_step([batch(point["vocab_size"], point["batch_size"], point["seq_len"], STEPS)], 1e-4)
        torch.cuda.synchronize()
        result["measured"] = torch.cuda.max_memory_allocated() - baseline
    else:
        result["measured"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        result["allocated"] = _profiled_peak(backend, batch(point["vocab_size"], point["batch_size"],
                                                            point["seq_len"], STEPS))
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def baseline_after_warm_up(warm, batches: list[dict], cuda: bool) -> int:
    """Train a throwaway backend on `batches`, free it, and return the memory in use from then on
    (allocated on CUDA with the peak statistics reset; resident on CPU): what a point's peak is
    measured above."""
    import gc

    import psutil
    import torch

    for batch in batches:
        warm.train_step([batch], 1e-3)
    del warm  # the caller passed it without keeping a reference: this frees it
    gc.collect()
    if not cuda:
        return psutil.Process().memory_info().rss
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _profiled_peak(backend, batch) -> int:
    """Peak allocated CPU bytes during one step: the tensors alive at its start (parameters and
    optimizer state; gradients are None between steps) plus the largest rise during it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    alive = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    for state in backend.optimizer.state.values():
        alive += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        backend.train_step([batch], 1e-4)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = rise = 0
    for event in events:
        if event.device_type() == torch.autograd.DeviceType.CPU:
            live += event.nbytes()
            rise = max(rise, live)
    return alive + rise


# ptbr's CPU runs keep freed blocks under 32 MiB in the heap (no trimming), so a CPU process's resident
# memory stays above its live tensors; a fixed mmap threshold returns them (and being a malloc
# setting of the user's, it leaves ptbr's alone).
MALLOC_RELEASE = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def run_grid(device: str, points: list[tuple], timeout: int, malloc_release: bool = False, jobs: int = 1,
             gpu_share: float = 0.9, chunked_loss: bool = False) -> list[dict]:
    env = os.environ | (MALLOC_RELEASE if malloc_release else {})
    tasks = []
    for size, vocab, batch_size, seq_len, precision, checkpointing in points:
        point = {"model_size": size, "vocab_size": vocab, "batch_size": batch_size, "seq_len": seq_len,
                 "precision": precision, "gradient_checkpointing": checkpointing, "device": device,
                 "chunked_loss": chunked_loss}
        tasks.append((point, dict(point) | predict(point)))

    def run(point: dict, row: dict) -> dict:
        row = measure_in_fresh_process(__file__, point, row, timeout, env, {"allocated": ("allocated_error_pct", 2)})
        print(_line(row), file=sys.stderr, flush=True)
        return row

    return in_parallel(run, tasks, jobs, device, gpu_share)


# what a fresh CUDA process holds beyond its tensors (context, kernels, allocator slack): the
# share of a GPU that each concurrently measured point is assumed to take beyond its prediction
CUDA_PROCESS_BYTES = 2 << 30


def in_parallel(run, tasks: list[tuple[dict, dict]], jobs: int, device: str, gpu_share: float = 0.9) -> list[dict]:
    """run(point, row) for every task, up to `jobs` at a time, the rows in the tasks' order. Each
    point is its own process and its peak is that process's own (max_memory_allocated, or its
    resident memory), so points measured side by side do not disturb each other's numbers; on a
    GPU, a point starts only when the predicted peaks of those running leave room for its own
    within `gpu_share` of the memory free at the start."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    if jobs <= 1:
        return [run(point, row) for point, row in tasks]
    budget = None
    if device == "cuda":
        import torch

        budget = gpu_share * torch.cuda.mem_get_info()[0]
    room, in_use = threading.Condition(), [0.0]

    def one(task: tuple[dict, dict]) -> dict:
        need = 1.25 * task[1]["predicted"] + CUDA_PROCESS_BYTES if budget else 0.0
        with room:  # a point larger than the whole budget runs alone
            room.wait_for(lambda: in_use[0] == 0 or in_use[0] + need <= budget)
            in_use[0] += need
        try:
            return run(*task)
        finally:
            with room:
                in_use[0] -= need
                room.notify_all()

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, tasks))


def measure_in_fresh_process(script: str, point: dict, row: dict, timeout: int, env: dict | None = None,
                             also: dict[str, tuple[str, int]] | None = None, decimals: int = 1) -> dict:
    """`script --measure POINT` in a fresh process; its numbers join `row` with error_pct (the
    prediction against "measured") and, for each key of `also` it reported, the error against it
    as (name, decimals). A point that fails or times out gets "failed" instead."""
    try:
        done = subprocess.run([sys.executable, script, "--measure", json.dumps(point)], capture_output=True,
                              text=True, timeout=timeout, check=True, env=env)
        row |= json.loads(done.stdout.strip().splitlines()[-1])
        for key, (name, places) in {"measured": ("error_pct", decimals)}.items() | (also or {}).items():
            if key in row:
                row[name] = round(100 * (row["predicted"] - row[key]) / row[key], places)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        tail = (getattr(exc, "stderr", "") or "").strip().splitlines()[-1:] or [type(exc).__name__]
        row["failed"] = tail[0]
    return row


def _line(row: dict) -> str:
    name = (f"{row['model_size']} vocab {row['vocab_size']} batch {row['batch_size']} seq {row['seq_len']} "
            f"{row['precision']}{' ckpt' if row['gradient_checkpointing'] else ''}"
            f"{' chunked loss' if row.get('chunked_loss') else ''}")
    if "failed" in row:
        return f"{name}: failed: {row['failed']}"
    return (f"{name}: predicted {row['predicted'] / 2**20:.0f} MiB, measured {row['measured'] / 2**20:.0f} MiB "
            f"({row['error_pct']:+.1f}%) in {row['seconds']} s")


def markdown(rows: list[dict], device: str) -> str:
    cpu = device == "cpu"
    head = "| model | vocab | batch x seq | precision | grad. ckpt | loss | predicted MiB | measured MiB | error |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if cpu:
        head += " allocated MiB | error vs allocated |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        if "failed" in r:
            continue
        line = (f"| {r['model_size']} | {r['vocab_size']} | {r['batch_size']} x {r['seq_len']} | {r['precision']} | "
                f"{'yes' if r['gradient_checkpointing'] else 'no'} | {'chunked' if r.get('chunked_loss') else 'whole'} | "
                f"{r['predicted'] / 2**20:,.0f} | "
                f"{r['measured'] / 2**20:,.0f} | {r['error_pct']:+.1f}% |")
        if cpu:
            line += f" {r['allocated'] / 2**20:,.0f} | {r['allocated_error_pct']:+.2f}% |"
        lines.append(line)
    return "\n".join(lines)


def cli(description: str, measure, run_grid, markdown, goal: dict[str, float], options=None) -> int:
    """The command line both benchmarks share: --device, --output, --markdown, --timeout, and the
    internal --measure POINT of a fresh process. `options(parser)` adds a benchmark's own; run_grid
    gets (device, timeout, args). Exit 1 when a point fails or misses the goal."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--output", help="write the rows as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per grid point")
    parser.add_argument("--jobs", type=int, default=1, help="grid points measured at once, each in its own process "
                        "(their peaks are their own; on a GPU a point waits until the predicted peaks leave it room)")
    parser.add_argument("--gpu-share", type=float, default=0.9,
                        help="with --jobs on a GPU: the share of its free memory the points running at once may take")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one point, in a fresh process
    if options:
        options(parser)
    args = parser.parse_args()
    if args.jobs < 1 or not 0 < args.gpu_share <= 1:
        parser.error(f"--jobs must be 1 or more and --gpu-share in (0, 1] (got {args.jobs} and {args.gpu_share})")
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    rows = run_grid(device, args.timeout, args)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        print(markdown(rows, device))
    measured = [r for r in rows if "failed" not in r]
    worst = max((abs(r["error_pct"]) for r in measured), default=float("nan"))
    print(f"{len(measured)}/{len(rows)} points measured on {device}; worst error {worst:.1f}% "
          f"(goal: within {goal[device]:.0%})", file=sys.stderr)
    return 0 if len(measured) == len(rows) and worst <= 100 * goal[device] else 1


def main() -> int:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--malloc-release", action="store_true", help="CPU: run each point with "
                            f"{' '.join(f'{k}={v}' for k, v in MALLOC_RELEASE.items())}")
        parser.add_argument("--chunked-loss", action="store_true",
                            help="ptbr's default loss (chunks of the device's size) instead of the whole logits")

    return cli(__doc__.splitlines()[0], measure,
               lambda device, timeout, args: run_grid(device, GRIDS[device], timeout, args.malloc_release, args.jobs,
                                                      args.gpu_share, args.chunked_loss),
               markdown, GOAL, options)


if __name__ == "__main__":
    raise SystemExit(main())
