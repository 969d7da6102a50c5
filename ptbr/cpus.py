"""CPUs this process may use: the machine's, narrowed by its CPU affinity (a cpuset: `docker run
--cpuset-cpus`, taskset) and by a cgroup CPU quota (`docker run --cpus 4`, a Kubernetes CPU limit).

torch sizes its thread pool by the machine's cores: in a container given 4 CPUs of a 64-core host it
runs dozens of threads against a quota of 4, and the kernel throttles them all, every step (a CPU
run many times slower than it could be). The quota lives in the process's control group:
- cgroup v2: `cpu.max` ("QUOTA PERIOD", or "max PERIOD" for none) of the group and each one above it;
- cgroup v1: `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us` of the cpu controller's group and
  each one above it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ptbr import ram


def processes_on_this_machine(default: int = 1) -> int:
    """How many of a launch's processes share this machine's CPUs and RAM: the launcher's
    LOCAL_WORLD_SIZE (torchrun, accelerate and `ptbr --num-processes` set it), else `default`."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", default)))
    except ValueError:
        return max(1, default)


def usable_cpus() -> int:
    """Whole CPUs this process may keep busy: its affinity, capped by a CPU quota (rounded up)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity to read
        count = os.cpu_count() or 1
    quota = cpu_quota(ram.CGROUP_ROOT, ram.PROC_CGROUP)
    return max(1, min(count, math.ceil(quota))) if quota is not None else max(1, count)


def cpu_quota(cgroup_root: Path, proc_cgroup: Path) -> float | None:
    """The tightest cgroup CPU quota on this process, in CPUs (1.5: one and a half); None where
    there is none or it cannot be read."""
    groups = ram.process_groups(proc_cgroup)
    v1 = next((path for controllers, path in groups.items() if "cpu" in controllers.split(",")), None)
    try:
        if v1 is not None:
            folder = next((cgroup_root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                           if (cgroup_root / name).is_dir()), None)
            if folder is not None:
                return _v1(folder, v1)
        if "" in groups:
            return _v2(cgroup_root, groups[""])
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return None


def _v2(root: Path, path: str) -> float | None:
    found = None
    for folder in ram.groups_up(root, path):
        limit_file = folder / "cpu.max"
        if limit_file.exists():
            quota, _, period = limit_file.read_text().strip().partition(" ")
            if quota != "max":
                cpus = int(quota) / int(period or 100_000)
                found = cpus if found is None else min(found, cpus)
    return found


def _v1(root: Path, path: str) -> float | None:
    found = None
    for folder in ram.groups_up(root, path):  # (a systemd slice's CPUQuota sits on a group above)
        quota_file = folder / "cpu.cfs_quota_us"
        if quota_file.exists() and (quota := int(quota_file.read_text())) > 0:  # -1: no quota
            cpus = quota / int((folder / "cpu.cfs_period_us").read_text())
            found = cpus if found is None else min(found, cpus)
    return found
