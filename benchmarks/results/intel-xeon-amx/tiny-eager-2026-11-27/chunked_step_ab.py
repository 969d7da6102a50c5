"""`tiny` in fp32 at the sample's 2,048-token vocabulary: a training step with the chunked loss (one
chunk) against the whole logits (--no-chunked-loss), alternating step by step in one process on
the same four batches, glibc keeping freed memory as ptbr's CPU runs set it. Prints each side's
median step time over 35 timed steps and their ratio (above 1: the chunked loss is faster).

    python benchmarks/results/intel-xeon-amx/tiny-eager-2026-11-27/chunked_step_ab.py [VOCAB]
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the checkout

from ptbr.backends.torch.allocator import keep_freed_memory  # noqa: E402
from ptbr.backends.torch.device import resolve_precision  # noqa: E402
from ptbr.backends.torch.models import build_model  # noqa: E402
from ptbr.backends.torch.step import TorchStep, build_optimizer  # noqa: E402
from ptbr.config import PretrainConfig, get_preset  # noqa: E402
from ptbr.data.batch import windows_to_batch  # noqa: E402

keep_freed_memory()
vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
preset = get_preset("tiny")
placement = resolve_precision(torch.device("cpu"), "fp32")
steps = {}
for chunked in (True, False):
    model = build_model(preset, vocab, 0, 0)
    steps[chunked] = TorchStep(model, build_optimizer(model, PretrainConfig(), placement.device), placement, 1.0,
                               chunked_loss=chunked)
rng = np.random.default_rng(0)
batches = [[windows_to_batch(rng.integers(0, vocab, size=(8, 257)))] for _ in range(4)]
times = {True: [], False: []}
for i in range(40):
    for chunked in ((True, False) if i % 2 else (False, True)):
        start = time.perf_counter()
        steps[chunked].train_step(batches[i % 4], 1e-3)
        if i >= 5:
            times[chunked].append((time.perf_counter() - start) * 1e3)
chunked_ms, whole_ms = (statistics.median(times[k]) for k in (True, False))
print(f"vocab {vocab}: chunked {chunked_ms:.1f} ms, whole logits {whole_ms:.1f} ms a step; "
      f"whole / chunked {whole_ms / chunked_ms:.3f}")
