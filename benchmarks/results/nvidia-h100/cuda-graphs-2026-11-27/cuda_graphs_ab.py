"""The script behind cuda_graphs_ab.txt (kept as a record; ptbr's --no-cuda-graphs now gives the
same A/B through benchmarks/speed.py): `ptbr train --compile` on CUDA with its compiled loss as it
was ("default") against the same in torch.compile's reduce-overhead mode (CUDA graphs), each run in
a fresh process through speed_workers.py's ptbr-pretrain worker; prints each run's median step,
every step, the peak allocated memory and every warning-like line. Run from the repository root:
SIZES="tiny 85m" MODES="default reduce-overhead" WARMUP=5 STEPS=30 python this-file."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")

if len(sys.argv) > 2 and sys.argv[1] == "sub":
    mode, spec = sys.argv[2], json.loads(sys.argv[3])
    if mode != "default":
        import torch

        import ptbr.backends.torch.compiled as compiled

        compiled.compile_loss = lambda loss: torch.compile(loss, dynamic=False, mode=mode)
    import speed_workers

    speed_workers.ptbr_pretrain(spec)
    raise SystemExit(0)

import speed  # noqa: E402 (benchmarks/ on the path first)

args = argparse.Namespace(device="cuda", warmup=int(os.environ.get("WARMUP", 5)), steps=int(os.environ.get("STEPS", 30)))
work = Path(tempfile.mkdtemp())
data = work / "vocab32000"
speed.make_vocab_dataset(data, 32000, 4_000_000)
SHAPES = {"tiny": ("tiny", 8, 256), "85m": ("85m", 16, 1024), "400m": ("400m", 8, 1024)}
for size, batch, seq in [SHAPES[s] for s in os.environ.get("SIZES", "tiny").split()]:
    for mode in os.environ.get("MODES", "default reduce-overhead default reduce-overhead").split():
        spec = speed.pretrain_spec(args, size, batch, seq, "bf16", work / f"{size}-{mode}-{time.time()}", data)
        spec["flags"] = ["--compile"]
        started = time.perf_counter()
        process = subprocess.run([sys.executable, __file__, "sub", mode, json.dumps(spec)], capture_output=True,
                                 text=True)
        wall = time.perf_counter() - started
        out = process.stdout + process.stderr
        results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        warned = [line for line in out.splitlines()
                  if any(w in line.lower() for w in ("warn", "cublas", "determin", "skipping cudagraph", "error"))]
        print(f"== {size} {mode} rc={process.returncode} wall {wall:.0f} s", flush=True)
        if results:
            steps = results[0]["step_s"]
            print(f"  median {statistics.median(steps) * 1000:.2f} ms steps {[round(x * 1000, 1) for x in steps]} "
                  f"peak {results[0]['peak_memory_bytes']}")
        for line in warned[:15]:
            print("  W:", line[:300])
        if process.returncode:
            print(out[-3000:])
