"""CPUs a process may use: a container's CPU quota (`docker run --cpus`) or a cpuset narrows the
machine's cores, and torch's CPU thread pool is fitted to them (a pool sized by the host's cores is
throttled by the quota every step)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ptbr import cpus
from ptbr import ram as ram_module
from ptbr.cpus import cpu_quota, usable_cpus


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_the_tightest_quota_of_the_group_and_those_above_it(tmp_path):
    root = tmp_path / "cgroup"
    write(root, cpu_stat="")  # the root group has no cpu.max
    write(root / "kubepods", cpu_max="400000 100000")
    write(root / "kubepods" / "pod", cpu_max="150000 100000")
    write(root / "kubepods" / "pod" / "ctr", cpu_max="max 100000")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/kubepods/pod/ctr\n")
    assert cpu_quota(root, proc) == 1.5
    write(root / "kubepods" / "pod", cpu_max="max 100000")
    assert cpu_quota(root, proc) == 4.0
    write(root / "kubepods", cpu_max="max 100000")
    assert cpu_quota(root, proc) is None
    # inside a container's own namespace the group is the root it sees
    write(root, cpu_max="200000 100000")
    proc.write_text("0::/elsewhere\n")
    assert cpu_quota(root, proc) == 2.0


def test_cgroup_v1_the_cpu_controllers_quota(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "docker" / "abc", cpu_cfs_quota_us="150000", cpu_cfs_period_us="100000")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_quota(root, proc) == 1.5
    write(root / "cpu,cpuacct" / "docker" / "abc", cpu_cfs_quota_us="-1")
    assert cpu_quota(root, proc) is None
    write(root / "cpu,cpuacct" / "docker", cpu_cfs_quota_us="300000", cpu_cfs_period_us="100000")  # a slice's quota
    assert cpu_quota(root, proc) == 3.0
    write(root / "cpu,cpuacct" / "docker", cpu_cfs_quota_us="-1")
    assert cpu_quota(tmp_path / "none", tmp_path / "none") is None  # no cgroup file system: no quota
    write(root / "cpu,cpuacct" / "docker" / "abc", cpu_cfs_quota_us="garbage")
    assert cpu_quota(root, proc) is None


@pytest.fixture
def quota(tmp_path, monkeypatch):
    """This process under a cgroup v2 CPU quota (set by the test), with four CPUs in its affinity."""
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    monkeypatch.setattr(ram_module, "CGROUP_ROOT", root)
    monkeypatch.setattr(ram_module, "PROC_CGROUP", proc)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def set_quota(value: str) -> None:
        write(root, cpu_max=value)

    return set_quota


def test_usable_cpus_are_the_affinity_capped_by_the_quota_rounded_up(quota):
    quota("max 100000")
    assert usable_cpus() == 4
    quota("150000 100000")
    assert usable_cpus() == 2
    quota("20000 100000")  # a fifth of a CPU is still one thread's worth
    assert usable_cpus() == 1
    quota("1600000 100000")  # a quota above the affinity: the affinity
    assert usable_cpus() == 4


def test_the_torch_backend_fits_its_cpu_threads_to_the_quota(quota, monkeypatch, capsys):
    import torch

    from ptbr.backends.torch import TorchBackend
    from ptbr.log import setup_console

    setup_console()  # (an earlier test may leave only pytest's handlers on ptbr's logger)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(4)
        quota("100000 100000")
        TorchBackend.create("cpu")
        assert torch.get_num_threads() == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "torch: 1 CPU thread, not 4: this process may use 1 CPU (a container's CPU quota or a CPU affinity), "
            "and more threads would be throttled")
        # OMP_NUM_THREADS is the user's (or a data-parallel launcher's) choice
        torch.set_num_threads(4)
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        TorchBackend.create("cpu")
        assert torch.get_num_threads() == 4 and "torch:" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
    assert cpus.usable_cpus() == 1
