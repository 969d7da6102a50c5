"""tiny on CUDA (bf16, 8 x 256, 32k vocabulary), each run in a fresh process (not a test):

    python sync_experiments.py             # EXPERIMENT=profile (default): profile_and_sync.txt
    EXPERIMENT=ab python sync_experiments.py                             # update_order_ab.txt

profile: ptbr (eager and --compile) as it is and with no per-step read of the device at all (an
upper bound: variant 2, the loss and norm never read, the update always applied), the Trainer and
the plain loop (eager), then the same under torch's profiler (steps 13-17: kernels, launches, host
time by op). ab: ptbr's step with its update queued before the step's read of the loss and norm
(variant 0: fused AdamW skipping a non-finite step on the device through its found_inf flag, as the
working tree measured had it) against the update after that read (variant 1, the host deciding the
skip: ptbr as committed), alternating, twice each, --compile and eager. Run from the repository root
with benchmarks/ importable (sys.path below). Variant 0 of the ab experiment needs that working
tree's TorchStep._update; with ptbr as committed both variants run the same code.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")  # speed.py, speed_workers.py

def nosync_patch():
    import torch

    from ptbr.backends.torch import step as st
    from ptbr.data.batch import StepResult, input_count
    def train_step(self, micro_batches, lr):
        module = self.parallel or self.model
        targets, inputs = st.target_count_of(micro_batches), input_count(micro_batches)
        on_device = [self._to_device(b) for b in micro_batches]
        graphs = self.graphs_step(len(on_device), on_device[0]["labels"].numel())
        for b in on_device:
            with self._kernels():
                ls = self._compiled_loss_sum(module, b, graphs=True) if graphs else self._train_loss(module, b)
                ls.mul(1.0 / targets).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(1.0, 1.0, targets, inputs, False)
    st.TorchStep.train_step = train_step

if len(sys.argv) > 2 and sys.argv[1] == "sub":
    kind, spec, prof_on, nosync = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
    import speed_workers
    if nosync == 2:
        nosync_patch()
    elif nosync == 1:  # the update after the wait (the host decides the skip), as before
        from ptbr.backends.torch import step as st
        init = st.TorchStep.__init__
        def patched(self, *a, **k):
            init(self, *a, **k)
            self.optimizer._step_supports_amp_scaling = False
        st.TorchStep.__init__ = patched
    prof = None
    if prof_on:
        from torch.profiler import ProfilerActivity, profile, schedule
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=int(os.environ.get("PWAIT", 10)), warmup=2, active=5, repeat=1))
        orig = speed_workers.first_step_reported
        def stepping(ends):
            orig(ends)
            prof.step()
        speed_workers.first_step_reported = stepping
        if kind == "ptbr-pretrain":
            from ptbr.backends.torch import step as st
            ts = st.TorchStep.train_step
            def wrapped(self, mb, lr):
                r = ts(self, mb, lr)
                prof.step()
                return r
            st.TorchStep.train_step = wrapped
        prof.start()
    {"ptbr-pretrain": speed_workers.ptbr_pretrain, "hf-pretrain": speed_workers.hf_pretrain,
     "plain-pretrain": speed_workers.plain_pretrain}[kind](spec)
    if prof:
        prof.stop()
        ev = prof.key_averages()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_us = sum(e.device_time_total for e in kernels)
        launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cudaMemcpyAsync")]
        print(f"PROF per step: {len(kernels)/5:.0f} GPU events, GPU busy {gpu_us/5/1000:.2f} ms, {len(launches)/5:.0f} launches/copies")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    raise SystemExit(0)

import argparse  # noqa: E402

import speed  # noqa: E402

args = argparse.Namespace(device=os.environ.get("DEVICE", "cuda"), warmup=int(os.environ.get("WARMUP", 10)), steps=int(os.environ.get("STEPS", 30)))
work = Path(tempfile.mkdtemp())
data = work / "vocab32000"
speed.make_vocab_dataset(data, 32000, 2_000_000)
if os.environ.get("EXPERIMENT", "profile") == "ab":
    RUNS = [("ptbr-pretrain", ["--compile"], 0, 0), ("ptbr-pretrain", ["--compile"], 0, 1)] * 2 + [("ptbr-pretrain", [], 0, 0), ("ptbr-pretrain", [], 0, 1)] * 2
else:
    RUNS = [("ptbr-pretrain", ["--compile"], 0, 0), ("ptbr-pretrain", ["--compile"], 0, 2),
            ("ptbr-pretrain", [], 0, 0), ("ptbr-pretrain", [], 0, 2), ("hf-pretrain", [], 0, 0), ("plain-pretrain", [], 0, 0),
            ("ptbr-pretrain", [], 1, 0), ("hf-pretrain", [], 1, 0), ("plain-pretrain", [], 1, 0), ("ptbr-pretrain", ["--compile"], 1, 0)]
for kind, flags, prof_on, nosync in RUNS:
    spec = speed.pretrain_spec(args, "tiny", 8, 256, os.environ.get("PREC", "bf16"), work / f"r{time.time()}", data)
    spec["flags"] = flags
    t = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "sub", kind, json.dumps(spec), str(prof_on), str(nosync)], capture_output=True, text=True)
    out = p.stdout + p.stderr
    res = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    print(f"== {kind} {flags} profile={prof_on} nosync={nosync} rc={p.returncode} wall {time.perf_counter()-t:.0f} s", flush=True)
    if res:
        s = res[0]["step_s"]
        print(f"  median {statistics.median(s)*1000:.2f} ms  min {min(s)*1000:.2f}  steps {[round(x*1000,1) for x in s[:12]]}")
    if prof_on:
        i = out.find("PROF per step")
        print(out[i:i+6000] if i >= 0 else out[-3000:])
    elif p.returncode:
        print(out[-3000:])
