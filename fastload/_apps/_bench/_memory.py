"""Memory of the benchmark's process tree: the PSS of this process and all its descendants.

PSS (proportional set size) counts each shared page once across the processes that map it,
split between them, so the sum over the main process and its workers is the tree's real
footprint — RSS would count shared memory once per worker.

When to read it: reading PSS costs the kernel a walk of each process's page tables (about
10 ms for a process that has imported torch) and psutil's process listing holds the GIL for a
few more, so a sampling thread would stall the very loop being timed. The bench reads it once
per configuration, at an untimed point where the tree is at its fullest: after the last batch's
step, before the end of the epoch stops the workers (slots allocated, caches warm, the last
batch alive).

psutil reads it; without psutil (not a dependency of fastload) the result is ``None`` and the
table says so.
"""

from __future__ import annotations

import contextlib
import importlib.util


def pss_available() -> bool:
    return importlib.util.find_spec("psutil") is not None


def tree_pss_bytes() -> int | None:
    """The summed PSS of this process and its descendants in bytes; ``None`` without psutil."""
    if not pss_available():
        return None
    import psutil

    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        # A process that exited between the listing and the read has no memory left to count.
        with contextlib.suppress(psutil.Error, OSError):
            total += process.memory_full_info().pss
    return total
