"""Host memory on a CPU: glibc keeps what a step frees (ptbr/backends/torch/allocator.py). mallopt
sets the whole process, so each case runs in a fresh interpreter: where glibc puts tensors of
several sizes (its own counters: mallinfo2), and real bf16 training steps of a small model,
counting the pages they fault in once warm (each a fresh page from the kernel: the cost the
setting removes)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from ptbr.backends.torch import allocator

pytestmark = pytest.mark.skipif(not allocator._glibc(), reason="glibc's malloc only")

# glibc's malloc statistics (mallinfo2), in a child process whose allocator a test has set
MALLINFO = """
import ctypes, json, sys, torch
from ptbr.backends.torch import allocator
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
"""

WHERE = MALLINFO + """
kept = allocator.keep_freed_memory() if sys.argv[1] == "keep" else None
mapped = {}
for mib in (1, 16, 48):
    before = libc.mallinfo2().hblkhd  # bytes in blocks glibc mmapped on their own
    tensor = torch.ones(mib * 2**18)
    mapped[mib] = (libc.mallinfo2().hblkhd - before) >> 20
    del tensor
print(json.dumps({"kept": kept, "mapped": mapped, "again": allocator.keep_freed_memory() if kept else None}))
"""

STEPS = """
import json, resource, sys
import numpy as np, torch
from ptbr.backends.torch import allocator
from ptbr.backends.torch.device import resolve_precision
from ptbr.backends.torch.models import build_model
from ptbr.backends.torch.step import TorchStep, build_optimizer
from ptbr.config import LoopSettings, get_preset
from ptbr.data.batch import windows_to_batch
allocator.keep_freed_memory()
placement = resolve_precision(torch.device("cpu"), "bf16")
model = build_model(get_preset("tiny"), 2048, 0, 0)
step = TorchStep(model, build_optimizer(model, LoopSettings(), placement.device), placement, 1.0,
                 chunked_loss=True)
batches = [windows_to_batch(np.random.default_rng(i).integers(0, 2048, size=(8, 257))) for i in range(2)]
faults = []
for i in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step.train_step([batches[i % 2]], 1e-4)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


RISING_BAR = MALLINFO + """
fixed = allocator.return_freed_memory() if sys.argv[1] == "return" else None
big = torch.ones(16 * 2**18)  # 16 MiB, mapped on its own; freeing it raises glibc's default bar to 16 MiB
del big
before = libc.mallinfo2().hblkhd
small = torch.ones(2**18)  # 1 MiB
print(json.dumps({"fixed": fixed, "mapped": (libc.mallinfo2().hblkhd - before) >> 20}))
"""


def _child(script: str, *args: str, **env):
    environ = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True,
                          env={**environ, **env}, timeout=300)
    return json.loads(done.stdout.splitlines()[-1])


def test_blocks_under_32_mib_come_from_the_heap_and_larger_ones_are_mapped():
    """glibc's default maps a block of 128 KiB or more on its own (unmapped when freed: its pages
    fault in again next time); ptbr's setting serves everything under 32 MiB from the heap."""
    kept = _child(WHERE, "keep")
    assert kept["kept"] is True and kept["again"] is True  # once per process, the same answer
    assert kept["mapped"] == {"1": 0, "16": 0, "48": 48}
    assert _child(WHERE, "default")["mapped"] == {"1": 1, "16": 16, "48": 48}


def test_the_bar_fixed_at_128_kib_stops_rising_so_freed_blocks_go_back_to_the_kernel():
    """glibc's default bar rises to what was freed (16 MiB here): a 1 MiB block then comes from the
    heap and stays there when freed, which grew the heap past the memory model's peak (1.6-1.75x
    over micro-batches). Fixed, it is mapped on its own and unmapped when freed."""
    assert _child(RISING_BAR, "default") == {"fixed": None, "mapped": 0}
    assert _child(RISING_BAR, "return") == {"fixed": True, "mapped": 1}


@pytest.mark.slow
def test_warm_bf16_steps_fault_no_pages_in():
    """The first steps grow the heap; from the fifth on, what a step frees serves the next: most
    steps fault no page (now and then one grows the heap by a few hundred: the median). glibc's
    default faults 700-10,000 pages in most warm steps here, though some runs settle too: the
    placement test above is what tells the two apart every time."""
    faults = _child(STEPS)
    assert faults[0] > 10_000  # the first step's fresh pages are counted: the measure works
    assert statistics.median(faults[4:]) < 50


def test_the_users_own_malloc_settings_are_left_alone():
    assert allocator.user_chose_the_allocator({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == (
        "LD_PRELOAD=/usr/lib/libjemalloc.so.2")
    assert allocator.user_chose_the_allocator({"LD_PRELOAD": "/opt/intel/lib/libiomp5.so"}) is None  # not a malloc
    assert allocator.user_chose_the_allocator({"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_TOP_PAD_": "0"}) == (
        "MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_")
    assert allocator.user_chose_the_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == (
        "glibc.malloc.trim_threshold")
    # what does not touch mmap or trimming is not a choice of this
    assert allocator.user_chose_the_allocator({"MALLOC_ARENA_MAX": "2", "LD_PRELOAD": "",
                                               "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None


def test_a_malloc_setting_in_the_environment_keeps_glibc_as_told():
    told = _child(WHERE, "keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert told["kept"] is False and told["mapped"]["16"] == 16  # glibc's default bar: 16 MiB mapped


def test_a_cpu_backend_keeps_freed_memory_and_a_gpu_one_does_not(monkeypatch):
    import ptbr.backends.torch as torch_backend

    calls = []
    monkeypatch.setattr(torch_backend, "keep_freed_memory", lambda: calls.append(1) or True)
    backend = torch_backend.TorchBackend.create("cpu", "fp32", pretraining=True)
    assert calls == []  # a run decides, once it knows its predicted peak
    assert backend.keep_freed_memory().startswith("glibc's malloc keeps what a step frees") and calls == [1]
    monkeypatch.setattr(torch_backend, "resolve_device", lambda device: __import__("torch").device("cuda", 0))
    monkeypatch.setattr(torch_backend, "resolve_precision", lambda *a: None)
    gpu = torch_backend.TorchBackend.__new__(torch_backend.TorchBackend)
    gpu.placement = type("P", (), {"device": __import__("torch").device("cuda", 0)})()
    assert gpu.keep_freed_memory() == "" and calls == [1]


def test_freed_memory_is_kept_only_where_the_peak_it_can_hold_fits(monkeypatch, tmp_path, capsys):
    """Keeping freed memory held up to 1.52x the predicted peak (tiny, 64 x 256, four micro-batches):
    a run whose peak that much larger would not fit the RAM available (a container's limit, say)
    leaves glibc at its defaults, where the memory model's prediction holds, and says so."""
    import psutil

    import ptbr.backends.torch as torch_backend
    from ptbr.cli import main
    from ptbr.runs import common

    calls = []
    monkeypatch.setattr(torch_backend, "keep_freed_memory", lambda: calls.append(1) or True)
    real = psutil.virtual_memory()
    args = ["train", "--model-size", "tiny", "--seq-len", "32", "--batch-size", "2", "--device", "cpu",
            "--precision", "fp32", "--max-steps", "1", "--eval-every", "0"]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=64 * 2**30))
    monkeypatch.setattr(common, "FREED_MEMORY_HELD", 64 * 2**30 / 1e6)  # the run fits, its peak that much larger not
    assert main([*args, "--output", str(tmp_path / "tight")]) == 0
    err = capsys.readouterr().err
    assert calls == [] and "glibc's malloc returns what steps free: keeping it (faster steps on a CPU) " \
        "can hold 68719.5x the predicted peak of 0.5 GiB, more than the 64.0 GiB of RAM available" in err, err
    monkeypatch.setattr(common, "FREED_MEMORY_HELD", 2.0)
    assert main([*args, "--output", str(tmp_path / "roomy")]) == 0
    assert calls == [1] and "glibc's malloc keeps what a step frees" in capsys.readouterr().err


TRIM = """
import json, psutil, torch
from ptbr.backends.torch import allocator
allocator.keep_freed_memory()
def rss():
    return psutil.Process().memory_info().rss >> 20
before = rss()
held = [torch.ones(2**18) for _ in range(400)]  # 400 MiB in 1 MiB tensors: the heap's, never trimmed here
del held
kept = rss()
allocator.give_back_freed_memory()
print(json.dumps({"grew": kept - before, "after": rss() - before}))
"""


def test_what_a_checkpoint_load_freed_goes_back_to_the_kernel():
    """A resumed CPU run held the checkpoint files' buffers for good (freed into a heap ptbr keeps
    from trimming): 1,856 MiB against 1,467 uninterrupted for an 85m run. malloc_trim after the load
    gives them back, and the torch backend calls it after every checkpoint load on a CPU."""
    done = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, check=True)
    measured = json.loads(done.stdout)
    assert measured["grew"] > 350 and measured["after"] < 50, measured


def test_a_cpu_resume_gives_back_what_the_load_freed(tmp_path, monkeypatch):
    from ptbr.cli import main

    args = ["train", "--output", str(tmp_path / "run"), "--model-size", "tiny", "--seq-len", "32", "--device", "cpu",
            "--save-every", "1"]
    assert main([*args, "--max-steps", "1"]) == 0
    calls = []
    monkeypatch.setattr(allocator, "give_back_freed_memory", lambda: calls.append(1))
    assert main([*args, "--max-steps", "2"]) == 0
    assert calls == [1]
