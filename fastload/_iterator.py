"""The iterator behind ``iter(fastload.DataLoader(...))``.

It keeps torch's observable behaviour to the letter — the order in which random numbers are
drawn (sampler iterator first, then the workers' base seed, from ``loader.generator`` or the
global generator), torch's dispatch rule, ``prefetch_factor × num_workers`` batches in flight,
the pin-memory warning, ``len()``, the IterableDataset length warning and persistent-worker
resets — while the work is done by fastload's own engine.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import time
import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from fastload._collate import PadCollate
from fastload._device import DevicePrefetcher, cuda_available, cuda_device, page_lock, pin_tree
from fastload._engine import DONE, FAILED, Engine, WorkerSpec, make_fetcher
from fastload._engine._arena import SlotArena, available_memory_bytes
from fastload._engine._cores import CONFINE, RELEASE, ConsumerCore
from fastload._engine._fastpath import SlotBuilder, SlotCodec, slot_bytes_bound
from fastload._engine._pump import ERROR, Pump, end_marker
from fastload._formats import ArrowDataset, HDF5Dataset
from fastload._metrics import AutoTuner, LoaderStats, StallMeter, available_cores
from fastload.errors import FastloadError

_log = logging.getLogger("fastload")

if TYPE_CHECKING:
    from torch.utils.data import DataLoader as TorchDataLoader

_live: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for it in list(_live):
        it._shutdown()


def fast_path_collate(loader: Any) -> Any:
    """The collate that can pad straight into shared memory, when the fast path applies: a
    map-style dataset with ``read_batch`` and ``lengths`` (the ``BatchReader`` protocol), batches
    of indices, and a collate with ``layout``/``collate_into`` (a ``PadCollate``); else ``None``."""
    ds, collate = loader.dataset, loader.collate_fn
    if isinstance(ds, IterableDataset) or not loader._auto_collation:
        return None
    if not (callable(getattr(ds, "read_batch", None)) and hasattr(ds, "lengths")):
        return None
    if not (callable(getattr(collate, "layout", None)) and callable(getattr(collate, "collate_into", None))):
        return None
    if loader.num_workers > 0 and not os.path.isdir("/proc/self/fd"):
        return None  # workers map the slots through /proc (Linux); elsewhere the generic path runs
    return collate


#: The readers whose every read is a function of the files and options alone, whichever
#: process reads (a subclass may read otherwise).
_OWN_READERS = (HDF5Dataset, ArrowDataset)


def _main_builder(loader: Any, collate: Any) -> Any:
    """What makes, given the arena, the builder with which the main process may build a batch
    itself while it would wait for a worker (see ``_engine/_claims.py``), or ``None``: for
    one-call builds, and for any batch of fastload's own readers padded by a plain
    ``PadCollate`` (the same bytes wherever they are built). Never with a ``worker_init_fn``:
    it may change what a worker's dataset reads, and the main process's copy would not
    follow."""
    dataset = loader.dataset
    if loader.worker_init_fn is not None:
        return None
    general = type(dataset) in _OWN_READERS and type(collate) is PadCollate

    def make(arena: SlotArena) -> SlotBuilder | None:
        builder = SlotBuilder(dataset, collate, os.getpid(), slots=arena)
        return builder if general or builder.one_call() else None

    return make


def _plan_rows_and_tokens(loader: Any) -> tuple[int | None, int | None]:
    """The most rows and the token budget of the batches the loader's sampler can make."""
    sampler = loader.batch_sampler
    rows = getattr(sampler, "batch_size", None)
    max_tokens = getattr(sampler, "max_tokens", None)
    if rows is None and max_tokens is None and isinstance(sampler, (list, tuple)):
        rows = max((len(b) for b in sampler), default=1)
    return rows, max_tokens


@dataclasses.dataclass(frozen=True)
class _SpecFactory:
    """Makes each worker's spec from one template (a plain object, so the engine holds no
    reference back to the iterator and garbage collection can close it)."""

    template: WorkerSpec
    cores: ConsumerCore | None = None  # the fast path's CPU placement, as it stands now

    def __call__(self, worker_id: int, epoch: int) -> WorkerSpec:
        cpus = None if self.cores is None else self.cores.worker_cpus
        return dataclasses.replace(self.template, worker_id=worker_id, epoch=epoch, cpus=cpus)


def _batch_counts(batch: Any) -> tuple[int, int | None, int | None]:
    """Rows, real tokens and padded tokens of a host batch: exact for ``PadCollate`` output
    (``lengths`` and ``attention_mask``), rows only for anything else."""
    if isinstance(batch, dict):
        lengths, mask = batch.get("lengths"), batch.get("attention_mask")
        if isinstance(lengths, torch.Tensor) and isinstance(mask, torch.Tensor) and lengths.ndim == 1:
            real = lengths.numpy().sum() if lengths.device.type == "cpu" and not lengths.requires_grad else lengths.sum()
            return len(lengths), int(real), mask.numel()
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = [batch]
    for v in values:
        if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim:
            return int(v.shape[0]), None, None
        if isinstance(v, (list, tuple, dict)):
            return _batch_counts(v)
    return 1, None, None


class _IndexSource:
    """The fast path's next task, taken on the engine thread: the sampler's next batch of
    indices with a slot reserved for it (holds no reference to the iterator)."""

    def __init__(self, sampler_iter: Any, codec: SlotCodec) -> None:
        self._it = sampler_iter
        self._codec = codec

    def __call__(self) -> Any:
        try:
            index = next(self._it)
        except StopIteration:
            return end_marker()
        return self._codec.task(index)


class LoaderIterator:
    def __init__(self, loader: TorchDataLoader) -> None:
        self._dataset = loader.dataset
        self._is_iterable = isinstance(loader.dataset, IterableDataset)
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._num_workers = loader.num_workers
        self._prefetch_factor = loader.prefetch_factor or 0
        self._in_order = loader.in_order
        self._persistent = loader.persistent_workers
        self._timeout = loader.timeout
        self._collate_fn = loader.collate_fn
        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{loader.pin_memory_device}'.",
                stacklevel=3,
            )
        if loader.pin_memory and not cuda_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
        self._pin = loader.pin_memory and cuda_available()
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        # torch's order of effects: the sampler's iterator, then the base seed.
        self._sampler_iter: Any = iter(self._index_sampler)
        self._base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )
        self._num_yielded = 0
        self._owner_pid = os.getpid()
        self._meter: StallMeter = getattr(loader, "_meter", None) or StallMeter()
        self._log_every_s: float | None = getattr(loader, "log_every_s", None)
        self._logged_at = time.monotonic()
        self._counts: deque[tuple[int, int | None, int | None]] = deque()  # per host batch
        self._epoch_ended = False
        self._last_fields: dict[str, Any] = {}
        self._epoch_done: Any = getattr(loader, "_on_epoch_end", None)
        self._report_final: Any = getattr(loader, "_on_shutdown", None)
        self._bar: Any = None
        self._tuner: AutoTuner | None = None
        self._skip_refills = 0  # after a worker retires: fewer tasks in flight
        self._progress = bool(getattr(loader, "progress", False))
        self._engine: Engine | None = None
        self._pump: Pump | None = None  # the fast path's engine thread
        self._cores: ConsumerCore | None = None  # the fast path's workers' CPUs, while confined
        self._host_counts: Any = None  # counts of the last batch, when the pump measured them
        self._arena: SlotArena | None = None
        self._codec: SlotCodec | None = None
        self._fetcher: Any = None
        self._fast_collate = fast_path_collate(loader)
        self._device = cuda_device(getattr(loader, "device", None))
        self._on_device: Any = None
        self._prefetcher: DevicePrefetcher | None = None
        if self._num_workers == 0:
            if self._fast_collate is not None:
                self._fetcher = _ColumnarFetcher(self._dataset, self._fast_collate)
            else:
                self._fetcher = make_fetcher(
                    self._dataset, self._auto_collation, self._collate_fn, self._drop_last
                )
        else:
            self._start_engine(loader)
            self._prime()
        _live.add(self)

    def _start_engine(self, loader: TorchDataLoader) -> None:
        ctx = loader.multiprocessing_context
        template = WorkerSpec(
            dataset=self._dataset,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=self._base_seed,
            worker_init_fn=loader.worker_init_fn,
            worker_id=0,
            num_workers=self._num_workers,
            main_pid=os.getpid(),
            epoch=0,
        )
        if self._fast_collate is not None:
            self._arena = self._new_arena(loader)
            self._codec = SlotCodec(self._arena, _main_builder(loader, self._fast_collate))
            template = dataclasses.replace(
                template, builder=SlotBuilder(self._dataset, self._fast_collate, os.getpid())
            )
            self._cores = ConsumerCore()
        self._engine = Engine(
            ctx=ctx,
            num_workers=self._num_workers,
            max_tasks=self._prefetch_factor * self._num_workers,
            in_order=self._in_order,
            timeout_s=self._timeout,
            restartable=not self._is_iterable,
            make_spec=_SpecFactory(template, self._cores),
            codec=self._codec,
            max_workers=available_cores() if getattr(loader, "auto_workers", False) else None,
            start_workers=1 if self._codec is not None else None,  # the rest in _prime()
        )
        if getattr(loader, "auto_workers", False):
            self._tuner = AutoTuner(min_workers=1, memory_ok=_memory_ok)
        if self._codec is not None:
            self._pump = Pump(
                self._engine,
                _IndexSource(self._sampler_iter, self._codec),
                _batch_counts,
                timeout_s=self._timeout,
            )
            assert self._arena is not None
            self._arena.on_release = self._pump.nudge

    def _new_arena(self, loader: TorchDataLoader) -> SlotArena:
        rows, max_tokens = _plan_rows_and_tokens(loader)
        reader: Any = self._dataset
        slot_bytes = slot_bytes_bound(
            self._fast_collate,
            reader.fields,
            np.asarray(reader.lengths),
            rows=rows,
            max_tokens=max_tokens,
        )
        max_bytes = getattr(loader, "max_shared_bytes", None)
        if max_bytes is None:
            max_bytes = max(256 << 20, (available_memory_bytes() or 4 << 30) // 4)
        pin = page_lock if (self._pin or self._device is not None) else None
        return SlotArena(
            slot_bytes=slot_bytes,
            slots=self._prefetch_factor * self._num_workers + 2,
            max_bytes=max_bytes,
            pin=pin,
        )

    def _prime(self) -> None:
        if self._pump is not None:
            # The first task goes to worker 0 before the other workers are forked: the first
            # batch comes 5-7 ms sooner per worker held back (the cycle still starts at worker 0).
            self._pump.grant(1)
            assert self._engine is not None
            self._engine.start_workers()
            self._pump.grant(self._prefetch_factor * self._num_workers - 1)
            return
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put()

    def _try_put(self) -> None:
        """torch's ``_try_put_index``: one more task, if the sampler has one and a worker is
        active (the index is consumed from the sampler either way)."""
        if self._pump is not None:
            self._pump.grant()
            return
        assert self._engine is not None
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            return
        self._engine.put(self._codec.task(index) if self._codec is not None else index)

    # -- the iterator protocol ------------------------------------------------------------------
    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __next__(self, _clock: Any = time.perf_counter) -> Any:  # a local: fewer cold lookups
        # The first and the last statements take the meter's times: all of next() counts as
        # waiting, as the caller's own clock around it would count it.
        started = _clock()
        if self._sampler_iter is None:
            raise StopIteration
        try:
            if self._device is not None:
                if self._on_device is None:
                    self._prefetcher = DevicePrefetcher(_HostBatches(self), self._device)
                    self._on_device = iter(self._prefetcher)
                data = next(self._on_device)
            else:
                data = self._next_data()
        except BaseException as exc:
            self._meter.begin_wait(started)  # a wait that delivered nothing: dropped
            if isinstance(exc, StopIteration):
                self._end_epoch()
            raise
        counts = self._counts.popleft()
        if self._progress:
            self._tick()
        if self._log_every_s is not None and time.monotonic() - self._logged_at >= self._log_every_s:
            self._logged_at = time.monotonic()
            _log.info("%s", self.stats())
        self._num_yielded += 1
        if (
            self._is_iterable
            and self._IterableDataset_len_called is not None
            and self._num_yielded > self._IterableDataset_len_called
        ):
            msg = (
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched. "
            )
            if self._num_workers > 0:
                msg += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker."
                )
            warnings.warn(msg, stacklevel=2)
        self._meter.record(started, *counts)[0] = _clock()
        return data

    def _next_data(self) -> Any:
        data = self._next_host_batch()
        counts, self._host_counts = self._host_counts, None
        self._counts.append(counts or _batch_counts(data))
        # The fast path's workers stay off the consumer's CPU unless a trial, begun when a
        # window of batches shows the consumer starved, finds them faster on every CPU
        # (``_engine/_cores.py``).
        cores, pump, engine = self._cores, self._pump, self._engine
        if cores is not None and cores.deciding and pump is not None and engine is not None:
            decision = cores.observe(time.perf_counter(), pump.waited_s)
            if decision == RELEASE:
                cores.release(engine.worker_pids)
            elif decision == CONFINE:
                cores.confine(engine.worker_pids)
        return data

    def _next_host_batch(self) -> Any:
        if self._engine is None:
            if self._num_workers > 0:
                raise StopIteration  # shut down after an error or at the end of the epoch
            data = self._fetcher.fetch(next(self._sampler_iter))
            return pin_tree(data) if self._pin else data
        try:
            if self._pump is not None:
                status, value, self._host_counts = self._pump.get()
                if status == ERROR:
                    raise value
            else:
                status, value, self._host_counts = self._engine.get(self._try_put)
        except BaseException as exc:
            if isinstance(exc, FastloadError) or self._pump is not None:
                self._shutdown(join_s=0.1)  # a dead or hung worker: this epoch cannot go on
            raise
        if status == DONE:
            if not self._persistent:
                self._shutdown()
            raise StopIteration
        if self._skip_refills:
            self._skip_refills -= 1
        elif self._pump is not None:
            self._pump.grant()  # what _try_put does on the fast path, one call less per batch
        else:
            self._try_put()
        if self._tuner is not None:
            self._tune()
        if status == FAILED:
            raise value
        return pin_tree(value) if self._pin and self._arena is None else value

    def _tune(self) -> None:
        """``num_workers="auto"``: let the tuner add or retire a worker. Only the speed changes:
        the batch plan and the delivery order do not depend on the worker count."""
        engine, tuner = self._engine, self._tuner
        assert engine is not None and tuner is not None
        decision = tuner.observe(
            wait_s=self._meter.wait_s, step_s=self._meter.step_s, busy_s=engine.busy_total_s
        )
        if decision == "hold":
            return
        with self._pump.lock if self._pump is not None else contextlib.nullcontext():
            if decision == "add":
                engine.add_worker()
                self._num_workers = engine.num_workers
            elif decision == "retire":
                engine.retire_worker()
                self._num_workers = tuner.num_workers
                self._skip_refills += self._prefetch_factor
        if decision == "add":
            for _ in range(self._prefetch_factor):
                self._try_put()
        if self._pump is not None:
            self._pump.wake()

    # -- statistics ---------------------------------------------------------------------------
    def _tick(self) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=len(self) if hasattr(self._index_sampler, "__len__") else None, unit="batch")
        self._bar.update(1)
        if self._bar.n % 20 == 1:
            snap = self._meter.snapshot(scope="epoch")
            self._bar.set_postfix(samples_s=f"{snap.samples_per_s:,.0f}", stall=f"{snap.stall_fraction:.1%}", refresh=False)

    def _end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self._epoch_ended:
            self._epoch_ended = True
            summary = self.stats(scope="epoch")
            self._meter.end_epoch()
            if self._epoch_done is not None:
                self._epoch_done(summary)

    def stats(self, scope: str = "run") -> LoaderStats:
        """A snapshot of the loader's timing (see :class:`~fastload.LoaderStats`): the consumer's
        wait and step, stall fraction, throughput, padding, and the engine's queue, slots,
        per-worker busy fractions, respawns and retries (as they were at shutdown, once the
        workers are gone)."""
        fields = self._engine_fields() if self._engine is not None else dict(self._last_fields)
        skipped = getattr(self._index_sampler, "skipped", None)
        if isinstance(skipped, int):
            fields["skipped_samples"] = skipped
        if self._prefetcher is not None:
            fields["gpu_idle_s"] = self._prefetcher.gpu_idle_s
        return self._meter.snapshot(scope=scope, num_workers=self._num_workers, **fields)

    def _engine_fields(self) -> dict[str, Any]:
        with self._pump.lock if self._pump is not None else contextlib.nullcontext():
            return self._engine_fields_locked()

    def _engine_fields_locked(self) -> dict[str, Any]:
        engine = self._engine
        assert engine is not None
        wall = max(1e-9, time.monotonic() - engine.started)
        busy = sum(engine.busy_s)
        fields: dict[str, Any] = {
            "queue_depth": engine.pending,
            "worker_busy": tuple(min(1.0, b / wall) for b in engine.busy_s),
            "worker_read_share": (sum(engine.read_s) / busy) if busy and self._codec else None,
            "respawns": engine.respawns,
            "retries": engine.retries,
            "main_batches": engine.main_batches,
        }
        if self._arena is not None:
            fields["slots_in_use"] = self._arena.in_use
        return fields

    # -- persistent workers and shutdown --------------------------------------------------------
    def _reset(self, loader: TorchDataLoader, first_iter: bool = False) -> None:
        """A new epoch on the same workers (called by ``DataLoader.__iter__``)."""
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._on_device = None
        self._counts.clear()
        self._epoch_ended = False
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        self._host_counts = None
        if self._engine is None:
            self._start_engine(loader)
        elif self._pump is not None:
            assert self._codec is not None
            self._pump.new_epoch(_IndexSource(self._sampler_iter, self._codec))
        else:
            self._engine.new_epoch()
        self._prime()

    @property
    def fast_path(self) -> bool:
        """Whether batches are built by ``read_batch`` + ``PadCollate`` (into shared-memory slots
        when there are workers) rather than by per-sample reads and ``collate_fn``."""
        return self._fast_collate is not None

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the current worker processes (a replaced worker has a new pid)."""
        return self._engine.worker_pids if self._engine is not None else []

    def _shutdown(self, join_s: float = 2.0) -> None:
        """Stop the workers (NOTE [shutdown order] in ``_engine/_pool.py``). Idempotent. In a
        process that merely inherited this iterator (a forked worker of another loader) it only
        drops the references: the workers and slots belong to the process that made them."""
        if os.getpid() != self._owner_pid:
            self._engine = self._arena = self._pump = None
            return
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.close()  # first: the thread must not touch the engine while it closes
        if self._engine is not None:
            self._last_fields = self._engine_fields()
            if self._report_final is not None:
                self._report_final(dict(self._last_fields), self._num_workers)
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close(join_s)
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()

    def __del__(self) -> None:
        self._shutdown()

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")


def _memory_ok() -> bool:
    """Room for one more worker: at least 1 GiB of memory still available."""
    available = available_memory_bytes()
    return available is None or available > 1 << 30


class _ColumnarFetcher:
    """``num_workers=0`` on the fast path: one ``read_batch`` and the collate, in-process."""

    def __init__(self, dataset: Any, collate: Any) -> None:
        self.dataset = dataset
        self.collate = collate

    def fetch(self, index: Any) -> Any:
        return self.collate(self.dataset.read_batch(np.asarray(index, dtype=np.int64)))


class _HostBatches:
    """The iterator's host-side batches, as an iterator for the device prefetcher. Not a
    generator: a batch that fails raises from ``next()`` and the batches after it still come."""

    def __init__(self, it: LoaderIterator) -> None:
        self._it = it

    def __iter__(self) -> _HostBatches:
        return self

    def __next__(self) -> Any:
        return self._it._next_data()
