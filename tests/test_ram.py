"""RAM as a process can use it: a container's cgroup memory limit, where tighter than the host's
RAM, is what the RAM guard, --auto-fit and preflight plan with (the kernel kills the container at
its limit, however much RAM the host has)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from ptbr import ram as ram_module
from ptbr.cli import main
from ptbr.ram import NO_LIMIT, cgroup_limit, ram

GIB = 2**30
V1_NONE = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def v2_tree(tmp_path: Path, own: str, parent: str, current: int, inactive: int) -> tuple[Path, Path]:
    """A cgroup v2 mount with this process in /system.slice/job.scope."""
    root = tmp_path / "cgroup"
    write(root, memory_stat="")  # the root group has no memory.max
    write(root / "system.slice", memory_max=parent, memory_current=str(current),
          memory_stat=f"inactive_file {inactive}\n")
    write(root / "system.slice" / "job.scope", memory_max=own, memory_current=str(current),
          memory_stat=f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/system.slice/job.scope\n")
    return root, proc


def test_cgroup_v2_the_tightest_limit_of_the_group_and_those_above_it_counts_inactive_cache_as_free(tmp_path):
    root, proc = v2_tree(tmp_path, own="max", parent=str(8 * GIB), current=3 * GIB, inactive=GIB)
    assert cgroup_limit(root, proc) == (8 * GIB, 6 * GIB)
    root, proc = v2_tree(tmp_path / "b", own=str(4 * GIB), parent=str(8 * GIB), current=3 * GIB, inactive=GIB)
    assert cgroup_limit(root, proc) == (4 * GIB, 2 * GIB)
    root, proc = v2_tree(tmp_path / "c", own="max", parent="max", current=3 * GIB, inactive=GIB)
    assert cgroup_limit(root, proc) is None


def test_cgroup_v2_inside_a_container_its_group_is_the_root_it_sees(tmp_path):
    root = tmp_path / "cgroup"
    write(root, memory_max=str(2 * GIB), memory_current=str(GIB // 2), memory_stat="inactive_file 0\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    assert cgroup_limit(root, proc) == (2 * GIB, 3 * GIB // 2)
    proc.write_text("0::/../../kubepods/pod1/abc\n")  # a path from outside the namespace: not mounted here
    assert cgroup_limit(root, proc) == (2 * GIB, 3 * GIB // 2)


def test_cgroup_v1_the_memory_controllers_limit_and_the_hierarchical_one(tmp_path):
    root = tmp_path / "cgroup"
    group = root / "memory" / "docker" / "abc"
    write(group, memory_limit_in_bytes=str(6 * GIB), memory_usage_in_bytes=str(2 * GIB),
          memory_stat=f"cache 9\nhierarchical_memory_limit {5 * GIB}\ntotal_inactive_file {GIB // 2}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/docker/abc\n3:cpu,cpuacct:/\n0::/\n")
    assert cgroup_limit(root, proc) == (5 * GIB, 5 * GIB - 2 * GIB + GIB // 2)
    write(group, memory_limit_in_bytes=V1_NONE, memory_stat=f"hierarchical_memory_limit {V1_NONE}\n")
    assert cgroup_limit(root, proc) is None
    # inside a container: the memory controller's mount is the container's own group
    write(root / "memory", memory_limit_in_bytes=str(GIB), memory_usage_in_bytes=str(GIB // 4), memory_stat="")
    proc.write_text("4:memory:/docker/elsewhere\n")
    assert cgroup_limit(root, proc) == (GIB, 3 * GIB // 4)
    assert int(V1_NONE) >= NO_LIMIT


def test_no_cgroup_file_system_or_an_unreadable_one_is_no_limit(tmp_path):
    assert cgroup_limit(tmp_path / "none", tmp_path / "none") is None
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/a\n")
    write(tmp_path / "cgroup" / "a", memory_max="garbage")
    assert cgroup_limit(tmp_path / "cgroup", proc) is None


MIB = 2**20


@pytest.fixture
def limited(tmp_path, monkeypatch):
    """This process in a cgroup v2 group limited to 2 GiB, 256 MiB of it free, on a host with far more."""
    root = tmp_path / "cgroup"
    write(root, memory_max=str(2 * GIB), memory_current=str(2 * GIB - 256 * MIB), memory_stat="inactive_file 0\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    monkeypatch.setattr(ram_module, "CGROUP_ROOT", root)
    monkeypatch.setattr(ram_module, "PROC_CGROUP", proc)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(total=64 * GIB, available=60 * GIB))
    return root


def test_ram_is_the_limit_where_tighter_than_the_host(limited):
    assert ram() == ram_module.Ram(total=2 * GIB, available=256 * MIB, limit=2 * GIB)
    write(limited, memory_max=str(128 * GIB))  # a limit above the host's RAM changes nothing
    assert ram() == ram_module.Ram(total=64 * GIB, available=60 * GIB)


def test_the_ram_guard_and_preflight_see_the_containers_limit_not_the_hosts_ram(limited, tmp_path, capsys):
    """A run predicted beyond the container's limit was let through on a big host, then killed
    by the kernel at the limit (exit 137, no line). (A batch whose peak is far beyond what this
    test process may hold by then: the guard counts what the process holds as in use already.)"""
    args = ["train", "--model-size", "tiny", "--seq-len", "32", "--device", "cpu", "--max-steps", "1",
            "--output", str(tmp_path / "run"), "--batch-size", "65536"]
    assert main(args) == 5
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "GiB more than this process holds, and 0.2 GiB is free under the container's memory limit (2.0 GiB): " \
           "the kernel would kill the run (--batch-size 65536); fix: run with --auto-fit" in line, line
    assert main(["preflight", "--output", str(tmp_path / "pf"), "--device", "cpu"]) in (0, 10)
    out = capsys.readouterr().out
    assert "RAM (the container's memory limit) 0.2 GiB available of 2.0 GiB" in out
    assert "fix: raise the container's memory limit (e.g. docker run --memory 16g): loading data and checkpoints " \
           "needs RAM too" in out
    report = json.loads((tmp_path / "pf" / "preflight_report.json").read_text())
    assert report["hardware"]["ram_limit"] == 2 * GIB and report["hardware"]["ram_available"] == 256 * MIB
    # a preset that fits nowhere under the limit: the failed check says so, and names the limit (its line
    # was the recommendation's last reason, "training on the CPU: expect hours ...")
    assert main(["preflight", "--output", str(tmp_path / "pf85"), "--device", "cpu", "--model-size", "85m"]) == 10
    checks = {c["name"]: c for c in json.loads((tmp_path / "pf85" / "preflight_report.json").read_text())["checks"]}
    failed = checks["memory.recommended"]
    assert failed["status"] == "fail" and failed["message"].startswith(
        "does not fit: micro-batch 1 of 64 tokens with gradient checkpointing needs "), failed
    assert failed["fix"] == "use a smaller preset, or a higher container memory limit (e.g. docker run --memory 16g)"
    assert (checks["memory.requested"]["status"], checks["memory.requested"]["fix"]) == (
        "fail", "nothing smaller fits either: see memory.recommended")


def test_a_data_parallel_cpu_run_counts_every_process_on_the_machine(monkeypatch, caplog):
    """Each process of `--num-processes 2` on a CPU reaches the predicted peak from the same RAM:
    a peak that fits once but not twice was let through, and the kernel killed a rank (exit 137)."""
    from types import SimpleNamespace

    from ptbr.backends.world import SingleProcess
    from ptbr.errors import DeviceError
    from ptbr.runs.common import plan_host_memory

    held = psutil.Process().memory_info().rss
    real, swap = psutil.virtual_memory(), psutil.swap_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(total=64 * GIB, available=2 * GIB))
    monkeypatch.setattr(psutil, "swap_memory", lambda: swap._replace(free=0))
    monkeypatch.setattr(ram_module, "CGROUP_ROOT", Path("/nonexistent-cgroup"))
    kept = []
    backend = SimpleNamespace(name="torch", device="cpu", keep_freed_memory=lambda: kept.append(1) or "")
    settings = SimpleNamespace(auto_fit=False, batch_size=8)
    peak = held + int(1.5 * GIB)  # 1.5 GiB more than held: one process fits in 2 GiB, two do not

    class MainOfTwo(SingleProcess):  # rank 0 of 2 whose collectives answer themselves: it decides for both
        size = 2

    backend.world = MainOfTwo()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DeviceError) as refused:
        plan_host_memory(peak, backend, settings)
    assert str(refused.value).startswith(f"the memory model predicts a peak of {peak / GIB:.1f} GiB in each of "
                                         "the 2 processes on this machine, 3.0 GiB more than they hold, and 2.0 "
                                         "GiB is free (RAM and swap): the kernel would kill the run")
    assert refused.value.fix.startswith("run fewer processes (--num-processes 1: on a CPU they share its cores")
    # two machines of one process each (torchrun --nnodes 2): each has its own RAM
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    plan_host_memory(peak, backend, settings)
    backend.world = SingleProcess()  # one process: the same peak fits
    plan_host_memory(peak, backend, settings)
    assert kept == []  # 1.5x the peak of 1.5 GiB more does not fit in 2 GiB: freed memory goes back
