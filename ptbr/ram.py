"""RAM this process can still use: the machine's, or a memory limit's where that is tighter.

A container started with a memory limit (`docker run --memory 8g`, a Kubernetes limit, a systemd
slice) is killed by the kernel when it passes the limit, however much RAM the host has; /proc/meminfo
and psutil report the host. The limit lives in the process's control group (cgroup):
- cgroup v2: `memory.max` of the process's group and of each group above it (`max` = none), used
  as `memory.current`;
- cgroup v1: `memory.limit_in_bytes` and `hierarchical_memory_limit` (the tightest above), used
  as `memory.usage_in_bytes`.
Usage counts the page cache; its inactive part (`inactive_file`) is reclaimed before the kernel
kills anything, so it counts as free, as `docker stats` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value; anything at or above
# 2**60 bytes is no limit in practice.
NO_LIMIT = 2**60
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup file systems are mounted
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's groups


@dataclass(frozen=True)
class Ram:
    total: int  # bytes: the machine's RAM, or the memory limit where lower
    available: int  # bytes this process can still get without swapping or being killed
    limit: int | None = None  # the cgroup memory limit that applies, if any

    def where(self) -> str:
        """How to name this memory in a message."""
        return "the container's memory limit" if self.limit is not None else "RAM"

    def free_with_swap(self) -> int:
        """What a process may still take before the kernel kills it: the memory available, and free
        swap where no memory limit caps the process (a container's limit counts swap apart)."""
        import psutil

        return self.available + (psutil.swap_memory().free if self.limit is None else 0)


def ram() -> Ram:
    """The machine's RAM (psutil), narrowed by a cgroup memory limit where one applies."""
    import psutil

    memory = psutil.virtual_memory()
    total, available = int(memory.total), int(memory.available)
    limited = cgroup_limit(CGROUP_ROOT, PROC_CGROUP)
    if limited is None or limited[0] >= total:
        return Ram(total, available)
    limit, free = limited
    return Ram(limit, max(0, min(available, free)), limit)


def cgroup_limit(cgroup_root: Path, proc_cgroup: Path) -> tuple[int, int] | None:
    """(limit, bytes left under it) of the tightest cgroup memory limit on this process; None
    where there is none or it cannot be read (not Linux, no cgroup file system)."""
    groups = process_groups(proc_cgroup)
    v1 = next((path for controllers, path in groups.items() if "memory" in controllers.split(",")), None)
    try:
        if v1 is not None and (cgroup_root / "memory").is_dir():
            return _v1(cgroup_root / "memory", v1)
        if "" in groups:
            return _v2(cgroup_root, groups[""])
    except (OSError, ValueError):
        return None
    return None


def process_groups(proc_cgroup: Path) -> dict[str, str]:
    """The process's cgroups by their controllers ("memory", "cpu,cpuacct"; "" for cgroup v2); {}
    where they cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    groups = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            groups[parts[1]] = parts[2]
    return groups


def groups_up(root: Path, path: str) -> Iterator[Path]:
    """A cgroup v2 group's folder, then each one above it up to the root (a limit anywhere on the
    way applies). Inside a container's own namespace the group is the root it sees."""
    folder = root / path.lstrip("/")
    if not folder.is_dir():
        folder = root
    while True:
        yield folder
        if folder == root or root not in folder.parents:
            return
        folder = folder.parent


def _v2(root: Path, path: str) -> tuple[int, int] | None:
    found = None
    for folder in groups_up(root, path):
        limit_file = folder / "memory.max"
        if limit_file.exists() and (text := limit_file.read_text().strip()) != "max":
            limit = int(text)
            used = int((folder / "memory.current").read_text()) - _stat(folder / "memory.stat", "inactive_file")
            if found is None or limit - used < found[1]:
                found = (limit, limit - used)
    return found


def _v1(root: Path, path: str) -> tuple[int, int] | None:
    folder = root / path.lstrip("/")
    if not (folder / "memory.limit_in_bytes").exists():  # a container's own namespace
        folder = root
    limit = int((folder / "memory.limit_in_bytes").read_text())
    limit = min(limit, _stat(folder / "memory.stat", "hierarchical_memory_limit", default=limit))
    if limit >= NO_LIMIT:
        return None
    used = int((folder / "memory.usage_in_bytes").read_text()) - _stat(folder / "memory.stat", "total_inactive_file")
    return limit, limit - used


def _stat(path: Path, key: str, default: int = 0) -> int:
    """A value of a cgroup memory.stat file (`key value` lines)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return default
