"""What a job may still take of the machine: memory (the machine's, its cgroup's, its
ulimit's), and what to say when the disk is full."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


def available_memory() -> tuple[int, str]:
    """Bytes this process may still take, and what limits it: the least of the memory
    Linux reports available, the cgroup's limit less its use (v1 and v2), and the address
    space ulimit. Elsewhere (macOS) the physical memory."""
    import resource

    limits = []
    meminfo = _read_ints(Path("/proc/meminfo"), "MemAvailable:")
    if meminfo is not None:
        limits.append((meminfo * 1024, "available memory"))
    for folder in _cgroup_memory_folders():
        for limit_file, use_file in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit, use = _read_ints(folder / limit_file), _read_ints(folder / use_file)
            if limit is not None and use is not None and limit < 2**60:
                limits.append((limit - use, f"the cgroup's memory limit ({folder})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "the address-space ulimit (ulimit -v)"))
    if not limits:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        limits.append((pages * size, "physical memory"))
    return min(limits)


def _read_ints(path: Path, key: str | None = None) -> int | None:
    """The number in a /proc or /sys file (on the line that starts with ``key``)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    if key is not None:
        text = next(
            (line.removeprefix(key) for line in text.splitlines() if line.startswith(key)), ""
        )
    words = text.split()
    return int(words[0]) if words and words[0].isdigit() else None


def _cgroup_memory_folders() -> list[Path]:
    """The memory cgroup folders of this process (cgroup v2's, or v1's memory controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            folders.append(Path("/sys/fs/cgroup") / where.lstrip("/"))
            folders.append(Path("/sys/fs/cgroup/unified") / where.lstrip("/"))
        elif "memory" in controllers.split(","):
            folders.append(Path("/sys/fs/cgroup/memory") / where.lstrip("/"))
    return folders


def disk_full(folder: Path) -> str:
    """What to say when a disk is full: which one, and how much is free now."""
    import shutil

    free = shutil.disk_usage(folder).free / 2**20
    return (
        f"no space left on the disk that holds {folder} ({free:.0f} MiB free now that this "
        "job's partial files are removed): free some space, then rerun"
    )
