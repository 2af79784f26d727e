"""``fastload doctor`` and ``fastload.doctor(loader)``: a check before the first step of what
would otherwise surface hours into a run (a small ``/dev/shm``, a low open-file or process
limit, a cgroup memory limit below what the loader plans, a dataset of millions of Python
objects that each worker copies, an unguarded main script, missing native kernels, unpinnable
memory, a shard cache without room, workers or ranks that get no data).

:func:`doctor` runs every check; :func:`startup` runs the cheap ones (no pickling, no batch
built, a bounded look at the dataset) once, when a loader first starts, and warns with
:class:`~fastload.errors.PreflightWarning` naming the doctor.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import tempfile
import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from fastload._capabilities import resolve_collate, resolve_dataset, resolve_sampler
from fastload._doctor import _checks, _system
from fastload._doctor._census import census
from fastload._doctor._checks import Plan
from fastload._doctor._findings import Finding, Report, Severity, sort
from fastload.errors import PreflightWarning

#: The compiled kernels, and what running without each costs.
KERNELS = (
    (
        "fastload._collate._native",
        "padding kernel (fastload._collate._native)",
        "padding a batch takes about 3x as long (about 78 us against 28 us for 64 rows of "
        "~1,200 tokens) and packed batches lose their one-call build",
    ),
    (
        "fastload._sampling._binpack",
        "packing kernel (fastload._sampling._binpack)",
        "planning a packed epoch (pack_length=) takes about 100x as long",
    ),
)

_kernels_warned = False


def missing_kernels() -> list[tuple[str, str]]:
    """``(kernel, cost)`` of each compiled kernel that cannot be imported here."""
    out = []
    for module, name, cost in KERNELS:
        try:
            importlib.import_module(module)
        except ImportError:
            out.append((name, cost))
    return out


def _first_batch_bytes(loader: Any) -> tuple[int, int] | None:
    """``(bytes, arrays)`` of one batch built here, as the loader's collate builds it (the
    generic path's batches travel through ``/dev/shm``); ``None`` where none can be built."""
    dataset = loader.dataset
    try:
        if isinstance(dataset, IterableDataset):
            return None
        rows = loader.batch_size or resolve_sampler(loader.batch_sampler).batch_size or 1
        if loader.batch_sampler is None:
            batch = loader.collate_fn(dataset[0])
        else:
            batch = loader.collate_fn([dataset[i] for i in range(min(len(dataset), int(rows)))])
    except Exception:  # a dataset that cannot be read here says so in its own run
        return None
    total, count = 0, 0
    stack = [batch]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total, count = total + x.numel() * x.element_size(), count + 1
        elif isinstance(x, np.ndarray):
            total, count = total + x.nbytes, count + 1
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total, count


class _Counter(io.RawIOBase):
    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n


def _pickled_bytes(dataset: Any) -> int | None:
    sink = _Counter()
    try:
        pickle.dump(dataset, sink, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    return sink.n


def _empty_workers(dataset: Any, num_workers: int) -> tuple[int, ...]:
    """The workers whose replica of an iterable dataset yields nothing, found by iterating it
    here as each worker would (``get_worker_info()`` set to that worker's)."""
    from torch.utils.data import IterDataPipe
    from torch.utils.data._utils import worker as torch_worker

    if not isinstance(dataset, IterableDataset) or isinstance(dataset, IterDataPipe) or num_workers < 2:
        return ()
    empty = []
    try:
        for wid in range(num_workers):
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=wid, num_workers=num_workers, seed=0, dataset=dataset
            )
            if next(iter(dataset), _NOTHING) is _NOTHING:
                empty.append(wid)
    except Exception:
        return ()
    finally:
        torch_worker._worker_info = None
    return tuple(empty)


_NOTHING = object()


def plan(loader: Any, *, full: bool) -> Plan:
    """What ``loader`` will need (see :class:`~fastload._doctor._checks.Plan`); ``full`` adds
    what costs time: the dataset pickled, one batch built, an iterable dataset's first sample
    per worker."""
    from fastload._engine._main_guard import start_method
    from fastload._formats._base import ShardedDataset
    from fastload._shards import MAX_OPEN_REMOTE_SHARDS

    dataset = loader.dataset
    workers = int(loader.num_workers)
    iterable = isinstance(dataset, IterableDataset)
    own = resolve_dataset(dataset)
    collate = resolve_collate(loader.collate_fn)
    fast = not iterable and loader.batch_sampler is not None and own.batch_reader and collate.slot_collate
    prefetch = int(loader.prefetch_factor or 2) if workers else 0
    slot_bytes = _slot_bytes(loader, own.fields) if fast else None
    shards = 1
    if isinstance(dataset, ShardedDataset):
        shards = len(dataset.shard_sizes)
    cache = dataset.shard_cache_plan() if isinstance(dataset, ShardedDataset) else None
    if cache is not None:
        shards = min(shards, MAX_OPEN_REMOTE_SHARDS)
    plain = dataset is not None and not iterable and not own.reads_batches
    batches: int | None = None
    if not iterable:
        try:
            batches = len(loader)
        except TypeError:
            batches = None
    measured = _first_batch_bytes(loader) if full and not fast and workers else None
    return Plan(
        num_workers=workers,
        prefetch_factor=prefetch,
        start_method=start_method(loader.multiprocessing_context) if workers else None,
        fast_path=fast,
        slots=prefetch * workers + 2 if fast else 0,
        slot_bytes=slot_bytes,
        batch_bytes=None if measured is None else measured[0],
        tensors_per_batch=None if measured is None else measured[1],
        shards=shards,
        plain_dataset=plain,
        census=census(dataset) if plain and workers else None,
        pickled_bytes=_pickled_bytes(dataset) if full and plain and workers else None,
        batches=batches,
        empty_workers=_empty_workers(dataset, workers) if full else (),
        cache=cache,
    )


def _slot_bytes(loader: Any, fields: Any) -> int | None:
    """One fast-path slot's bytes, where the sampler says how large its batches can be."""
    from fastload._engine._sizing import slot_bytes_bound
    from fastload._sampling import MixtureBatchSampler, PackedBatchSampler

    sampler = loader.batch_sampler
    said = resolve_sampler(sampler)  # what it declares (fastload._capabilities), never a name probe
    rows, budget = said.batch_size, said.max_tokens
    packs = isinstance(sampler, PackedBatchSampler) or (
        isinstance(sampler, MixtureBatchSampler) and sampler.pack_length is not None
    )
    if fields is None or (rows is None and budget is None) or packs:
        return None
    try:
        lengths = np.asarray(loader.dataset.lengths)
        return int(slot_bytes_bound(loader.collate_fn, fields, lengths, rows=rows, max_tokens=budget))
    except Exception:
        return None


def _findings(loader: Any, p: Plan, *, full: bool) -> list[Finding]:
    import resource

    from fastload._device import cuda_available, pin_failure
    from fastload._engine._main_guard import unguarded_line

    shm, tmp = "/dev/shm", tempfile.gettempdir()
    soft, hard = _system.limit(resource.RLIMIT_NOFILE)
    nproc_soft, _ = _system.limit(resource.RLIMIT_NPROC)
    uid = os.getuid()
    found = [
        *_checks.shared_memory(p, shm, tmp, _system.memfd_works(), _system.free_bytes(shm), _system.free_bytes(tmp)),
        *_checks.open_files(p, soft, hard, _system.open_fds()),
        *_checks.processes(p, nproc_soft, uid, _system.user_tasks(uid) if nproc_soft is not None and uid else 0),
        *_checks.memory(p, _system.cgroup_memory()),
        *_checks.objects(p),
        *_checks.shard_cache(p, uid),
    ]
    if full or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        found += _checks.shares(p)  # as a loader starts, only where an empty rank hangs the others
    if full:
        wants_pin = bool(loader.pin_memory) or loader.device is not None
        cuda = cuda_available()
        found += _checks.start(p, unguarded_line())
        found += _checks.kernels(missing_kernels())
        found += _checks.pinned(wants_pin, cuda, pin_failure() if wants_pin and cuda else None)
    return found


def doctor(loader: Any) -> Report:
    """Check, before the first step, what would stop or slow ``loader``'s run on this machine
    (see the module text): a :class:`Report` of findings, each with what to change. It builds
    one batch in this process for a generic-path loader and pickles a plain dataset, so it
    may take a few seconds on a large one; it starts no worker."""
    return Report(sort(_findings(loader, plan(loader, full=True), full=True)))


def startup(loader: Any) -> list[Finding]:
    """The cheap checks, as a loader first starts: each warning or error is also warned
    (:class:`~fastload.errors.PreflightWarning`) with its remedy and the doctor's name. The
    first loader of the process also says when native kernels are missing."""
    global _kernels_warned
    found = _findings(loader, plan(loader, full=False), full=False)
    if not _kernels_warned:
        _kernels_warned = True
        found += _checks.kernels(missing_kernels())
    for f in found:
        if f.severity >= Severity.WARNING:
            warnings.warn(
                f"fastload: {f.message}; {f.remedy} (`fastload doctor` or fastload.doctor(loader) "
                "checks all of this before a run)",
                PreflightWarning,
                stacklevel=5,
            )
    return found


__all__ = ["Finding", "Report", "Severity", "doctor", "missing_kernels", "plan", "startup"]
