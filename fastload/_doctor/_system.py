"""What the machine allows, read from the kernel: free space of a folder, whether ``memfd``
works, the process's resource limits, its cgroup's memory limit. Every reader takes the path it
reads, so a check can be pointed at another filesystem or cgroup."""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass
from pathlib import Path

#: The value a cgroup v1 ``memory.limit_in_bytes`` holds when no limit is set (or more).
_V1_UNLIMITED = 1 << 60


def free_bytes(folder: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use in ``folder``'s filesystem (``None``: no such
    folder)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def memfd_works() -> bool:
    """Whether ``memfd_create`` works here (the batch slots' shared memory; without it they go
    to a deleted file in the temp folder)."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        fd = os.memfd_create("fastload-doctor", os.MFD_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def open_fds() -> int:
    """Descriptors this process holds now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def limit(which: int) -> tuple[int | None, int | None]:
    """``(soft, hard)`` of resource limit ``which``; ``None`` for unlimited."""
    soft, hard = resource.getrlimit(which)
    return (None if soft == resource.RLIM_INFINITY else soft), (None if hard == resource.RLIM_INFINITY else hard)


def user_tasks(uid: int, proc: str = "/proc") -> int:
    """Processes and threads of ``uid`` now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(entry.path).st_uid == uid:
                count += len(os.listdir(os.path.join(entry.path, "task")))
    return count


@dataclass(frozen=True)
class MemoryLimit:
    """A cgroup's memory limit and what it holds now, in bytes; ``where``: the file read."""

    limit: int
    usage: int
    where: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory(root: str | os.PathLike[str] = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> MemoryLimit | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 ``memory.max``,
    else v1 ``memory.limit_in_bytes``), with that cgroup's usage; ``None`` where none is set."""
    base = Path(root)
    v2_path, v1_path = "/", "/"
    with contextlib.suppress(OSError):
        for line in Path(self_cgroup).read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
                v2_path = parts[2]
            elif len(parts) == 3 and "memory" in parts[1].split(","):
                v1_path = parts[2]
    candidates: list[tuple[Path, str, str]] = []
    for folder, rel in ((base, v2_path), (base / "memory", v1_path)):
        here = folder.joinpath(rel.lstrip("/"))
        if not here.is_dir():
            here = folder  # a container sees its own cgroup as the root
        chain = [here, *[p for p in here.parents if str(p).startswith(str(folder))]]
        for p in chain:
            if folder == base:
                candidates.append((p, "memory.max", "memory.current"))
            else:
                candidates.append((p, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: MemoryLimit | None = None
    for folder, limit_name, usage_name in candidates:
        value = _read_int(folder / limit_name)
        if value is None or value >= _V1_UNLIMITED:
            continue
        usage = _read_int(folder / usage_name) or 0
        if best is None or value - usage < best.limit - best.usage:
            best = MemoryLimit(value, usage, str(folder / limit_name))
    return best


__all__ = ["MemoryLimit", "cgroup_memory", "free_bytes", "limit", "memfd_works", "open_fds", "user_tasks"]
