"""The peak memory ptbr shows on a CPU is the process's peak resident memory, never the memory in
use when it is asked: metrics.jsonl's mem_bytes, report.md, `ptbr monitor` and `ptbr test-gpu`.

The runs return what their steps free to the kernel (glibc's malloc settings in the environment,
which ptbr leaves as the user set them), so that the memory in use between steps is far below the
peak of a step: a number read at logging time is then half of the peak or less. Each runs in a
process of its own that, when ptbr is done, reads its own VmHWM (Linux's high-water mark of
resident memory) and resident memory from /proc, independently of ptbr's code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ptbr.monitor import share_of
from ptbr.train.metrics import read_metrics
from tests.conftest import REPO, run_cli, shown_size

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc (Linux)")

GIB, MIB = 1024**3, 1024**2
# freed blocks from 64 KiB unmapped, the heap's free top trimmed at once: a step's activations and
# logits go back to the kernel when freed
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
SHAPE = ["--model-size", "tiny", "--seq-len", "256", "--batch-size", "32", "--device", "cpu"]

# runs `ptbr ARGS...` in this process, then prints the process's own peak and resident memory
PTBR_THEN_MEMORY = textwrap.dedent("""
    import json, sys
    from ptbr.cli import main
    code = main(sys.argv[1:])
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps({"code": code, "peak": int(status["VmHWM"].split()[0]) * 1024,
                      "rss": int(status["VmRSS"].split()[0]) * 1024}))
""")


def ptbr_then_memory(*args: str) -> tuple[str, dict]:
    """ptbr's stdout, and the process's VmHWM and VmRSS in bytes once ptbr returned."""
    import os

    done = subprocess.run([sys.executable, "-c", PTBR_THEN_MEMORY, *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=dict(os.environ, **RETURN_FREED))
    assert done.returncode == 0, done.stderr
    *printed, last = done.stdout.splitlines()
    memory = json.loads(last)
    assert memory["code"] == 0, done.stderr
    return "\n".join(printed), memory


@pytest.fixture(scope="module")
def peaked_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("peak") / "run"
    _, memory = ptbr_then_memory("train", "--output", out, *SHAPE, "--precision", "fp32", "--max-steps", "3",
                                 "--eval-every", "3", "--eval-batches", "1")
    return out, memory


def test_mem_bytes_is_the_process_s_peak_so_far(peaked_run):
    out, memory = peaked_run
    mem = [row["mem_bytes"] for row in read_metrics(out / "metrics.jsonl")]
    predicted = json.loads((out / "run_config.json").read_text())["predicted_peak_bytes"]
    assert len(mem) == 3 and mem == sorted(mem)  # a peak so far never falls
    # the last row's peak: the process's, which after the last row grew by the final save at most
    assert 0.95 * memory["peak"] <= mem[-1] <= memory["peak"]
    # what the memory in use at logging time would have said: far below (this is what makes the run a test)
    assert memory["rss"] < 0.7 * mem[-1], (memory, mem)
    # and the memory model predicts the peak (memory in use at logging time was ~40% of it)
    assert 0.75 < mem[-1] / predicted < 1.25, (mem, predicted)


def test_report_and_monitor_show_the_peak_against_the_prediction(peaked_run):
    out, memory = peaked_run
    rows = read_metrics(out / "metrics.jsonl")
    predicted = json.loads((out / "run_config.json").read_text())["predicted_peak_bytes"]
    peak = max(row["mem_bytes"] for row in rows)
    by_step = next(row["step"] for row in rows if row["mem_bytes"] == peak)
    assert peak >= 0.95 * memory["peak"]
    report = (out / "report.md").read_text()
    assert (f"| peak memory | measured {peak:,} B ({shown_size(peak)}); predicted {predicted:,} B "
            f"({shown_size(predicted)}) ({share_of(peak, predicted)}% of the prediction) |") in report
    assert "each row holds the peak the run's process had reached by that step, not the memory in use" in report
    shown = run_cli("monitor", str(out), "--once", timeout=60)
    assert shown.returncode == 0, shown.stderr
    [line] = [line for line in shown.stdout.splitlines() if line.startswith("memory ")]
    assert line == (f"memory      peak {shown_size(peak)}, reached by step {by_step}; predicted peak "
                    f"{shown_size(predicted)} ({share_of(peak, predicted)}%)")


def test_test_gpu_on_a_cpu_prints_the_process_s_peak(tmp_path):
    printed, memory = ptbr_then_memory("test-gpu", *SHAPE)
    found = re.search(r"peak memory (\d+\.\d\d) GiB \((.+)\)$", printed, flags=re.M)
    assert found, printed
    assert found[2] == "the process's peak resident memory, interpreter and libraries included"
    shown = float(found[1]) * GIB
    assert abs(shown - memory["peak"]) <= 0.005 * GIB + 1  # the peak, rounded to 2 decimals
    assert shown > 1.5 * memory["rss"], (printed, memory)  # not the memory in use after the step


def test_a_process_started_by_a_larger_one_reports_its_own_peak():
    """ru_maxrss of a process that a larger one exec'd (Python's subprocess) starts at the larger
    one's peak; ptbr reads VmHWM, the peak of its own memory. A 256 MiB block, touched and freed,
    is in the peak and not in the memory in use."""
    held = b"x" * (768 * MIB)  # this process's peak is at least this  # noqa: F841 - held while the child runs
    child = textwrap.dedent("""
        import json, resource, torch
        from ptbr.backends.torch.device import peak_memory, peak_resident_bytes
        inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        block = b"x" * (256 * 2**20)
        del block
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(json.dumps({"peak": peak_resident_bytes(), "cpu": peak_memory(torch.device("cpu")),
                          "hwm": int(status["VmHWM"].split()[0]) * 1024, "rss": int(status["VmRSS"].split()[0]) * 1024,
                          "ru_maxrss": inherited}))
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    memory = json.loads(done.stdout)
    assert memory["ru_maxrss"] >= 768 * MIB  # the trap: the parent's peak
    assert memory["hwm"] <= memory["peak"] <= memory["cpu"] <= memory["hwm"] + MIB  # VmHWM, read just before
    assert memory["peak"] >= memory["rss"] + 250 * MIB
    assert memory["peak"] < memory["ru_maxrss"]
