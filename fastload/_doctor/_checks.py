"""The checks: each turns what the loader plans (:class:`Plan`) and what the machine allows
(read by ``_system``, passed in so that a test can point a check at another folder, limit or
cgroup) into findings that say what to change."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fastload._doctor._census import Census
from fastload._doctor._findings import Finding, Severity
from fastload._doctor._system import MemoryLimit
from fastload.errors import DISTRIBUTION

#: A rough figure for one worker's own memory (interpreter, torch, reader buffers).
WORKER_BYTES = 150 << 20
#: Descriptors a worker process holds besides its shards (interpreter, torch, pipes, maps).
WORKER_BASE_FDS = 64
#: Descriptors the main process takes per worker (two pipes, a sentinel, a spare).
FDS_PER_WORKER = 4
#: Python objects in a dataset from which copy-on-read is worth a warning.
MANY_OBJECTS = 1_000_000
#: Free ``/dev/shm`` under which the generic path's worker batches are at risk.
SMALL_SHM = 256 << 20

_MB = 1 << 20


def _mb(n: float) -> str:
    return f"{n / _MB:,.0f} MiB" if n < 10 << 30 else f"{n / (1 << 30):,.1f} GiB"


@dataclass(frozen=True)
class Plan:
    """What a loader will need, as far as it is known before its first batch (``None``: not
    known)."""

    num_workers: int
    prefetch_factor: int = 2
    start_method: str | None = None
    fast_path: bool = False
    slots: int = 0  # fast path: regular batch slots
    slot_bytes: int | None = None  # fast path: bytes of one slot
    batch_bytes: int | None = None  # generic path: bytes of one batch's tensors and arrays
    tensors_per_batch: int | None = None
    shards: int = 1  # files each worker keeps open
    plain_dataset: bool = False  # a map-style dataset of the user's own (not a batch reader)
    census: Census | None = None
    pickled_bytes: int | None = None
    batches: int | None = None  # this rank's batches per epoch (map-style)
    empty_workers: tuple[int, ...] = ()  # iterable data: workers that get no sample
    cache: tuple[str, int | None, int] | None = None  # remote: folder, cache_limit, dataset bytes

    @property
    def in_flight(self) -> int:
        """Batches between the workers and the consumer at most (one held by the consumer)."""
        return self.prefetch_factor * self.num_workers + 1 if self.num_workers else 0

    @property
    def slot_total(self) -> int | None:
        return None if self.slot_bytes is None else self.slots * self.slot_bytes

    @property
    def generic_total(self) -> int | None:
        if self.fast_path or not self.num_workers or self.batch_bytes is None:
            return None
        return self.in_flight * self.batch_bytes


def kernels(missing: list[tuple[str, str]]) -> list[Finding]:
    """``missing``: ``(kernel, what its fallback costs)`` for each compiled kernel not built
    (one finding for all of them: the remedy is the same)."""
    if not missing:
        return []
    what = "; ".join(f"without the {name}, {cost}" for name, cost in missing)
    return [Finding(
        "native-kernels",
        Severity.WARNING,
        f"fastload was installed without its C kernels, so numpy/Python fallbacks do their work: {what}",
        "install a C compiler (gcc; build-essential and python3-dev on Debian/Ubuntu) and "
        f"reinstall fastload from source (pip install --force-reinstall --no-deps --no-binary "
        f"{DISTRIBUTION} {DISTRIBUTION}, or pip install -e . in a checkout)",
    )]


def shared_memory(plan: Plan, shm_folder: str, tmp_folder: str, memfd: bool,
                  shm_free: int | None, tmp_free: int | None) -> list[Finding]:
    """Where the batches between processes live, against the room there: the fast path's slots
    in ``memfd`` (or a deleted file in ``tmp_folder``), the generic path's tensors in
    ``shm_folder`` (torch shares them there)."""
    if not plan.num_workers:
        return []
    out: list[Finding] = []
    if plan.fast_path:
        total = plan.slot_total
        if not memfd and total is not None and tmp_free is not None and total > tmp_free:
            out.append(Finding(
                "shm", Severity.ERROR,
                f"memfd_create is unavailable, so the {plan.slots} batch slots ({_mb(total)}) go to "
                f"{tmp_folder}, which has {_mb(tmp_free)} free",
                f"set TMPDIR to a tmpfs with at least {_mb(total)} free, or lower num_workers or "
                "prefetch_factor",
            ))
        return out
    if shm_free is None:
        return [Finding("shm", Severity.WARNING, f"{shm_folder} does not exist: torch shares the "
                        "workers' batches there", f"mount a tmpfs at {shm_folder}")]
    need = plan.generic_total
    remedy = (
        f"give {shm_folder} more room (docker run --shm-size=..., or mount -o remount,size=... "
        f"{shm_folder}), lower num_workers or prefetch_factor, or use the fast path (a dataset "
        "with read_batch and lengths, such as HDF5Dataset, whose slots do not use "
        f"{shm_folder})"
    )
    if need is not None and need > shm_free:
        out.append(Finding(
            "shm", Severity.ERROR,
            f"{plan.in_flight} batches of {_mb(plan.batch_bytes or 0)} in flight need "
            f"{_mb(need)} of {shm_folder}, which has {_mb(shm_free)} free: workers will fail with "
            "a bus error or 'No space left on device'",
            f"{remedy}; it needs at least {_mb(need)}",
        ))
    elif need is None and shm_free < SMALL_SHM:
        out.append(Finding(
            "shm", Severity.WARNING,
            f"{shm_folder} has only {_mb(shm_free)} free, and torch shares the workers' batches "
            f"there ({plan.in_flight} in flight)",
            remedy,
        ))
    return out


def open_files(plan: Plan, soft: int | None, hard: int | None, open_now: int) -> list[Finding]:
    """Descriptors the main process and each worker will hold, against ``RLIMIT_NOFILE``."""
    if not plan.num_workers or soft is None:
        return []
    tensors = plan.tensors_per_batch if plan.tensors_per_batch is not None else 2
    shared = 4 if plan.fast_path else plan.in_flight * tensors  # slot segments, or torch's fds
    main = open_now + FDS_PER_WORKER * plan.num_workers + shared
    worker = WORKER_BASE_FDS + plan.shards
    need = max(main, worker)
    if need <= soft:
        return []
    who = (
        f"the main process ({open_now} open now + {FDS_PER_WORKER} per worker for "
        f"{plan.num_workers} workers + {shared} for shared batches)"
        if main >= worker
        else f"each worker (about {WORKER_BASE_FDS} + one per shard for {plan.shards} shards)"
    )
    raise_to = max(need * 2, 4096)
    if hard is None or hard >= raise_to:
        remedy = (
            f"raise the soft limit: `ulimit -n {raise_to}` in the shell, or at the top of the "
            f"script `resource.setrlimit(resource.RLIMIT_NOFILE, ({raise_to}, {hard if hard is not None else 'resource.RLIM_INFINITY'}))`"
        )
    else:
        remedy = (
            f"the hard limit is {hard}: raise it (docker run --ulimit nofile={raise_to}, "
            "/etc/security/limits.conf, LimitNOFILE= for systemd), or lower num_workers"
        )
    return [Finding(
        "open-files", Severity.ERROR,
        f"RLIMIT_NOFILE is {soft}, but {who} needs about {need} descriptors: "
        "'Too many open files' will stop the run",
        remedy,
    )]


def processes(plan: Plan, soft: int | None, uid: int, tasks: int) -> list[Finding]:
    """Processes the workers add, against ``RLIMIT_NPROC`` (which counts every process and
    thread of the user; root is not held to it)."""
    if not plan.num_workers or soft is None or uid == 0:
        return []
    need = tasks + plan.num_workers + 2  # a fork server, a spare
    if need <= soft:
        return []
    return [Finding(
        "processes", Severity.ERROR,
        f"RLIMIT_NPROC is {soft} and your user runs {tasks} processes and threads: "
        f"{plan.num_workers} workers would take it to {need}, and starting one will fail",
        f"raise it (`ulimit -u {max(need * 2, 4096)}`, docker run --pids-limit / --ulimit nproc=...) "
        f"or lower num_workers to {max(0, soft - tasks - 2)}",
    )]


def copied_bytes(plan: Plan) -> float:
    """Bytes of the dataset's Python objects each worker ends up copying."""
    if not plan.plain_dataset or plan.census is None or not plan.num_workers:
        return 0.0
    return plan.census.bytes


def memory(plan: Plan, limit: MemoryLimit | None) -> list[Finding]:
    """The memory the loader plans (slots or batches in flight, and per worker a rough figure
    plus the dataset objects it copies), against the room the cgroup's limit leaves."""
    if limit is None or not plan.num_workers:
        return []
    room = limit.limit - limit.usage
    batches = plan.slot_total if plan.fast_path else plan.generic_total
    per_worker = WORKER_BYTES + copied_bytes(plan)
    planned = (batches or 0) + plan.num_workers * per_worker
    if planned <= room:
        return []
    parts = [f"{plan.num_workers} workers x ~{_mb(per_worker)}"]
    if batches:
        parts.insert(0, f"{_mb(batches)} of batches in shared memory")
    severity = Severity.ERROR if (batches or 0) > room else Severity.WARNING
    return [Finding(
        "memory", severity,
        f"the cgroup allows {_mb(limit.limit)} ({limit.where}) and {_mb(limit.usage)} are used, "
        f"leaving {_mb(room)}; the loader plans about {_mb(planned)} "
        f"({' + '.join(parts)}): the kernel's OOM killer may end the run",
        "raise the container's memory limit, lower num_workers or prefetch_factor, or pass "
        "max_shared_bytes= to bound the slots",
    )]


def objects(plan: Plan) -> list[Finding]:
    """A plain dataset of many Python objects, which every worker copies as it reads."""
    census = plan.census
    out: list[Finding] = []
    if plan.plain_dataset and plan.pickled_bytes is not None and plan.num_workers:
        how = "is pickled into" if plan.start_method in ("spawn", "forkserver") else "is forked into"
        out.append(Finding("dataset", Severity.INFO, f"the dataset pickles to {_mb(plan.pickled_bytes)} and {how} each of {plan.num_workers} workers"))
    if not plan.plain_dataset or census is None or not plan.num_workers or census.objects < MANY_OBJECTS:
        return out
    out.insert(0, Finding(
        "copy-on-read", Severity.WARNING,
        f"the dataset holds about {census.objects / 1e6:,.1f} million Python objects "
        f"(~{_mb(census.bytes)}); each of {plan.num_workers} workers writes their reference counts "
        f"as it reads them and so copies them: up to {_mb(census.bytes * plan.num_workers)} more "
        "memory over an epoch",
        "keep samples in numpy arrays (one values array and an offsets array instead of a "
        "list of tuples), or in a file (`fastload convert` to HDF5, then HDF5Dataset)",
    ))
    return out


def start(plan: Plan, unguarded: tuple[str, int] | None) -> list[Finding]:
    """How workers start, and whether the main script would run again in each."""
    if not plan.num_workers or plan.start_method is None:
        return []
    out = [Finding("start-method", Severity.INFO, f"workers start by {plan.start_method!r}")]
    if plan.start_method != "fork" and unguarded is not None:
        script, line = unguarded
        out.append(Finding(
            "main-guard", Severity.ERROR,
            f"{script}, line {line} is not under `if __name__ == \"__main__\":`, and "
            f"{plan.start_method!r} runs the script again in each worker: the loader's workers "
            "would start workers of their own and crash",
            "put the code that builds and iterates the loader in a function called under "
            "`if __name__ == \"__main__\":`",
        ))
    return out


def pinned(wants: bool, cuda: bool, failure: str | None) -> list[Finding]:
    if not (wants and cuda) or failure is None:
        return []
    return [Finding(
        "pinned-memory", Severity.ERROR,
        f"page-locking host memory fails here ({failure}), so pinned slots and non_blocking "
        "copies cannot work",
        "raise the locked-memory limit (`ulimit -l unlimited`, docker run --ulimit memlock=-1) "
        "or pass pin_memory=False and device=None",
    )]


def shard_cache(plan: Plan, uid: int) -> list[Finding]:
    """A remote dataset's shard cache: the folder's owner, and its free space against
    ``cache_limit`` (or, unbounded, against the dataset's size)."""
    if plan.cache is None:
        return []
    folder, limit, total = plan.cache
    existing = folder
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    out: list[Finding] = []
    try:
        st = os.stat(existing)
    except OSError:
        return out
    if existing == folder and st.st_uid != uid:
        out.append(Finding(
            "shard-cache", Severity.ERROR,
            f"the shard cache {folder} belongs to uid {st.st_uid}, not to you (uid {uid}): "
            "fastload refuses a cache others can write",
            "pass cache_dir= a folder of your own (or set XDG_CACHE_HOME)",
        ))
    vfs = os.statvfs(existing)
    free = vfs.f_bavail * vfs.f_frsize
    want = total if limit is None else min(limit, total)
    if want > free:
        what = f"cache_limit={limit:,}" if limit is not None else f"no cache_limit and a {_mb(total)} dataset"
        out.append(Finding(
            "shard-cache", Severity.WARNING,
            f"the shard cache {folder} has {_mb(free)} free, with {what}: downloads will fail "
            "with 'No space left on device'",
            f"pass cache_limit= below {_mb(free)} (e.g. cache_limit='{max(1, int(free * 0.8) >> 30)}GB') "
            "or cache_dir= a folder with more room",
        ))
    return out


def shares(plan: Plan) -> list[Finding]:
    """Whether every worker (and this rank) gets something to load."""
    out: list[Finding] = []
    if plan.batches == 0:
        out.append(Finding(
            "shares", Severity.ERROR,
            "this rank gets no batch in an epoch: its training loop would end at once (or "
            "hang the other ranks)",
            "use fewer ranks or a smaller batch_size, or drop_last=False",
        ))
    elif plan.batches is not None and 0 < plan.batches < plan.num_workers:
        out.append(Finding(
            "shares", Severity.WARNING,
            f"an epoch has {plan.batches} batches for {plan.num_workers} workers: "
            f"{plan.num_workers - plan.batches} of them never get one",
            f"lower num_workers to {plan.batches}",
        ))
    if plan.empty_workers:
        listed = ", ".join(str(w) for w in plan.empty_workers)
        out.append(Finding(
            "shares", Severity.WARNING,
            f"workers {listed} of {plan.num_workers} get no sample from the iterable dataset "
            "(its split gives them nothing: fewer shards or files than workers)",
            f"lower num_workers to {plan.num_workers - len(plan.empty_workers)}, or split the "
            "data into at least as many shards as workers x ranks",
        ))
    return out


__all__ = ["Plan", "copied_bytes", "kernels", "memory", "objects", "open_files", "pinned", "processes", "shard_cache", "shared_memory", "shares", "start"]
