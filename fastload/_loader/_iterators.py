"""The iterators behind ``iter(fastload.DataLoader(...))``, one per mode, as torch has.

They keep torch's observable behaviour to the letter — the order in which random numbers are
drawn (sampler iterator first, then the workers' base seed, from ``loader.generator`` or the
global generator), ``prefetch_factor × num_workers`` batches in flight, the pin-memory
warning, ``len()``, the IterableDataset length warning and persistent-worker resets — while
the work is done in the calling process (:class:`InProcessIterator`, ``num_workers=0``) or by
fastload's engine (:class:`WorkerIterator`, through the one runner ``fastload._engine`` makes).
What both share is :class:`_BaseIterator`: torch's bookkeeping, the device copy, the stall
meter, the progress bar and the logged stats.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import dataclasses
import logging
import os
import time
import warnings
import weakref
from collections import deque
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from fastload._capabilities import Capabilities
from fastload._device import DevicePrefetcher, cuda_available, pin_tree, pinned_slots
from fastload._engine import (
    DONE,
    OK,
    HostPolicy,
    Kind,
    ParkingKey,
    Runner,
    RunnerOptions,
    available_memory_bytes,
    batch_counts,
    fast_path_collate,
    in_process_fetcher,
    park,
    park_seconds,
    parking_key,
    planned_counts,
    start_runner,
    take_parked,
)
from fastload._formats._base import ShardedDataset
from fastload._loader._datapipes import (
    SharedSeed,
    is_datapipe,
    shard_in_process,
    sharding_worker_init,
)
from fastload._loader._options import LoaderOptions
from fastload._loader._resume import EpochProgress, SkipPositions
from fastload._loader._shard_traffic import ShardTraffic
from fastload._metrics import AutoTuner, LoaderStats, StallMeter
from fastload._threads import on_own_thread, start_own_thread
from fastload._types import Counts

_log = logging.getLogger("fastload")



class IteratedLoader(Protocol):
    """What an iterator reads of the loader it iterates: torch's own attributes (the same names
    torch's iterators read, so the behaviour stays torch's) and the hooks ``DataLoader`` gives
    its iterators. Declared here so that the iterators do not import the loader that makes them."""

    dataset: Any
    collate_fn: Any
    num_workers: int
    pin_memory: bool
    pin_memory_device: str
    timeout: float
    worker_init_fn: Any
    multiprocessing_context: Any
    generator: Any
    prefetch_factor: int | None
    persistent_workers: bool
    in_order: bool
    drop_last: bool
    meter: StallMeter

    @property
    def _auto_collation(self) -> bool: ...
    @property
    def _IterableDataset_len_called(self) -> int | None: ...
    @property
    def options(self) -> LoaderOptions: ...
    @property
    def _index_sampler(self) -> Any: ...
    @property
    def _engine_dataset(self) -> Any: ...
    def _capabilities(self) -> Capabilities: ...
    def _draw_base_seed(self) -> int: ...
    def _take_worker_resume(self) -> tuple[int, int, dict[int, Any]] | None: ...
    def _replicas_keep_position(self) -> bool: ...
    def _on_epoch_end(self, summary: LoaderStats) -> None: ...
    def _on_shutdown(self, engine_fields: dict[str, Any], num_workers: int) -> None: ...

_live: weakref.WeakSet[_BaseIterator] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for it in list(_live):
        it._shutdown()


class _BaseIterator(abc.ABC):
    """torch's bookkeeping, the device copy and the measuring, for both modes. A mode provides
    :meth:`_next_host` (the next batch on the host and its counts, or ``StopIteration``)."""

    def __init__(self, loader: IteratedLoader) -> None:
        self._dataset = loader._engine_dataset
        # A DataPipe graph is seeded first, as torch's iterator seeds it (fastload/_loader/_datapipes.py).
        self._datapipe_seed = SharedSeed() if is_datapipe(self._dataset) else None
        if self._datapipe_seed is not None:
            self._dataset = self._datapipe_seed.apply(self._dataset, loader.generator)
        self._is_iterable = isinstance(loader.dataset, IterableDataset)
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._num_workers = loader.num_workers
        self._collate_fn = loader.collate_fn
        self._options: LoaderOptions = loader.options
        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{loader.pin_memory_device}'.",
                stacklevel=4,
            )
        if loader.pin_memory and not cuda_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=4,
            )
        self._pin = loader.pin_memory and cuda_available()
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        # torch's order of effects: the sampler's iterator, then the base seed.
        self._sampler_iter: Any = iter(self._index_sampler)
        self._meter: StallMeter = loader.meter
        self._capabilities = loader._capabilities()  # resolved once (fastload._capabilities)
        self._shards = ShardTraffic(
            self._dataset,
            self._meter,
            concurrency=self._options.download_concurrency,
            capabilities=self._capabilities.dataset,
        )
        self._base_seed = loader._draw_base_seed()
        self.progress = EpochProgress()  # the loader keeps it: it outlives this iterator
        # Out of order: the sampler positions of the batches next() is about to hand out, for
        # the progress (see fastload/_loader/_resume.py); None in order.
        self._positions: deque[int] | None = None if loader.in_order or loader.num_workers == 0 else deque()
        # The workers' random states after the batches next() is about to hand out.
        self._worker_rng: deque[tuple[int, Any]] = deque()
        self._owner_pid = os.getpid()
        self._start_shard_prefetch()
        self._logged_at = time.monotonic()
        self._epoch_ended = False
        self._epoch_done = _weakly(loader._on_epoch_end)
        self._bar: Any = None
        self._device = self._options.device
        self._on_device: Any = None  # the prefetcher's iterator, per epoch
        self._prefetcher: DevicePrefetcher | None = None
        self._finish = self._capabilities.collate.finish_batch  # built where the batch lands
        self._fast_collate = fast_path_collate(
            self._dataset, loader.collate_fn, loader._auto_collation, loader.num_workers, self._capabilities
        )
        self._meter.fast_path = self._fast_collate is not None  # the diagnosis advises by it
        # One test per batch for what most loaders never do (next() after a long step runs from
        # cold caches: each line it runs counts; benchmarks/README.md, "next() of a ready batch").
        self._extras = self._options.progress or self._options.log_every_s is not None or self._is_iterable
        _live.add(self)

    # -- the iterator protocol ------------------------------------------------------------------
    def __iter__(self) -> _BaseIterator:
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
            if self._device is None:
                data, counts = self._next_host()
                if self._finish is not None:
                    data = self._finish(data)
            else:
                data, counts = self._next_on_device()
        except BaseException as exc:
            self._meter.begin_wait(started)  # a wait that delivered nothing: dropped
            if isinstance(exc, StopIteration):
                self._end_epoch()
            elif self._positions:  # a batch that failed: received, as an exception
                self.progress.mark(self._positions.popleft())
            raise
        self.progress.delivered += 1
        if self._positions is not None:
            self.progress.mark(self._positions.popleft())
        if self._worker_rng:
            self._received_from_worker()
        if self._extras:
            self._after_batch()
        entry = self._meter.record(started, *counts)
        entry[0] = _clock()  # after record(): Python evaluates the right-hand side first
        return data

    def _received_from_worker(self) -> None:
        wid, states = self._worker_rng.popleft()
        if states:  # () when unchanged since that worker's previous batch
            self.progress.workers[wid] = states
        self.progress.last_worker = wid

    @property
    def _num_yielded(self) -> int:
        """Batches handed to the consumer this epoch (torch's name)."""
        return self.progress.delivered

    def _after_batch(self) -> None:
        """What some loaders do as a batch is handed out: the progress bar, the logged stats,
        torch's warning for an IterableDataset longer than its ``len()``."""
        options = self._options
        if options.progress:
            self._tick()
        if options.log_every_s is not None and time.monotonic() - self._logged_at >= options.log_every_s:
            self._logged_at = time.monotonic()
            _log.info("%s", self.stats())
        if self._is_iterable:
            self._warn_if_past_len()

    @abc.abstractmethod
    def _next_host(self) -> tuple[Any, Counts]:
        """The next batch on the host and its counts; ``StopIteration`` at the epoch's end."""

    def _next_on_device(self) -> tuple[Any, Counts]:
        if self._on_device is None:
            assert self._device is not None
            finish = self._finish
            self._prefetcher = DevicePrefetcher(
                _HostBatches(self), self._device, finish=None if finish is None else lambda pair: (finish(pair[0]), pair[1])
            )
            self._on_device = iter(self._prefetcher)
        return next(self._on_device)  # a (batch, counts) pair: see _HostBatches

    def _warn_if_past_len(self) -> None:
        if self._IterableDataset_len_called is not None and self._num_yielded > self._IterableDataset_len_called:
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
            warnings.warn(msg, stacklevel=3)

    # -- statistics ---------------------------------------------------------------------------
    def _tick(self) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=len(self) if hasattr(self._index_sampler, "__len__") else None, unit="batch")
        self._bar.update(1)
        if self._bar.n % 20 == 1:
            snap = self._meter.snapshot(scope="epoch")
            self._bar.set_postfix(samples_s=f"{snap.samples_per_s:,.0f}", stall=f"{snap.stall_fraction:.1%}", refresh=False)

    def _start_shard_prefetch(self) -> None:
        """For a remote dataset and a sampler that knows its plan: start bringing the epoch's
        shards to the local disk ahead of the workers (``_shards/_prefetch.py``)."""
        if self._shards.remote and os.getpid() == self._owner_pid:
            plans = self._capabilities.sampler.upcoming
            self._shards.start(self._index_sampler.upcoming() if plans else None, _consumed_weakly(self))

    def _stop_shard_prefetch(self) -> None:
        shards = self.__dict__.get("_shards")  # absent where __init__ raised before making it
        if shards is not None and shards.remote and os.getpid() == self._owner_pid:
            self._feed_storage()
            self._shards.stop()

    def _feed_storage(self) -> None:
        """Count what reads of a remote dataset cost since the last call (see ``stats``)."""
        self._shards.feed()

    def _end_epoch(self) -> None:
        self.progress.finished = True
        self._stop_shard_prefetch()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self._epoch_ended:
            self._epoch_ended = True
            summary = self.stats(scope="epoch")
            self._meter.end_epoch()
            self._epoch_done(summary)

    def stats(self, scope: str = "run") -> LoaderStats:
        """A snapshot of the loader's timing (see :class:`~fastload.LoaderStats`): the consumer's
        wait and step, stall fraction, throughput, padding, and the engine's queue, slots,
        per-worker busy fractions, respawns and retries (as they were at shutdown, once the
        workers are gone)."""
        if self._shards.remote:
            self._feed_storage()
        fields = self._engine_fields()
        if self._capabilities.sampler.skipped:
            fields["skipped_samples"] = int(self._index_sampler.skipped)
        if self._prefetcher is not None:
            fields["gpu_idle_s"] = self._prefetcher.gpu_idle_s
        return self._meter.snapshot(scope=scope, num_workers=self._num_workers, **fields)

    def _engine_fields(self) -> dict[str, Any]:
        return {}

    # -- epochs and shutdown -----------------------------------------------------------------
    def _reset(self, loader: IteratedLoader, first_iter: bool = False) -> None:
        """A new epoch on the same iterator (called by ``DataLoader.__iter__`` for persistent
        workers)."""
        self._sampler_iter = iter(self._index_sampler)
        if self._datapipe_seed is not None:
            self._dataset = self._datapipe_seed.apply(self._dataset, loader.generator)
        previous, self.progress = self.progress, EpochProgress()
        self.progress.base_seed = self._base_seed
        # Persistent workers' states carry on; the round-robin restarts at worker 0, as torch's.
        self.progress.workers = dict(previous.workers)
        if self._positions is not None:
            self._positions.clear()
        self._worker_rng.clear()
        self._start_shard_prefetch()
        self._on_device = None
        self._epoch_ended = False
        self._IterableDataset_len_called = loader._IterableDataset_len_called

    @property
    def fast_path(self) -> bool:
        """Whether batches are built by ``read_batch`` and a slot collate (into shared-memory
        slots when there are workers) rather than by per-sample reads and ``collate_fn``."""
        return self._fast_collate is not None

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the current worker processes (a replaced worker has a new pid)."""
        return []

    def _shutdown(self, join_s: float = 2.0) -> None:
        """Stop what the iterator started (in-process: only the shard prefetcher). Idempotent."""
        self._stop_shard_prefetch()

    def __del__(self) -> None:
        # NOTE [closing from a finalizer]: the cyclic collector may finalize this iterator on
        # any thread, one of ours included: the engine's thread in the middle of a step, with
        # the lock that closing takes held, or the shard prefetcher's, which closing joins.
        # There closing would wait for itself, and the collector with it, so no cycle in the
        # process would ever be collected again. On our threads a thread of its own closes it
        # (keeping it alive until then); on the caller's, ``del it`` stops the workers at once.
        if on_own_thread():
            # At interpreter exit no thread starts: multiprocessing's exit handler then ends the
            # workers (daemonic), as it does for an iterator never closed.
            with contextlib.suppress(RuntimeError):
                start_own_thread(self._shutdown, "fastload-close")
        else:
            self._shutdown()

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")


class InProcessIterator(_BaseIterator):
    """``num_workers=0``: every batch is built in ``next()``."""

    def __init__(self, loader: IteratedLoader) -> None:
        super().__init__(loader)
        shard_in_process(self._dataset)
        self._fetcher = in_process_fetcher(
            self._dataset,
            self._collate_fn,
            auto_collation=self._auto_collation,
            drop_last=self._drop_last,
            fast=self._fast_collate is not None,
            capabilities=self._capabilities,
        )

    def _next_host(self) -> tuple[Any, Counts]:
        fetcher = self._fetcher
        index = next(self._sampler_iter)
        data = fetcher.fetch(index)
        if self._pin:
            data = pin_tree(data)
        counts = fetcher.last_counts  # the fast path's collate says
        if counts is None:
            counts = planned_counts(index)  # a packed plan says, whatever collated it
        return data, counts if counts is not None else batch_counts(data)


class WorkerIterator(_BaseIterator):
    """Worker processes build the batches, through the runner ``fastload._engine`` makes."""

    _runner: Runner | None = None  # also for __del__ of an iterator whose __init__ raised
    _park_key: ParkingKey | None = None  # where its runner may wait for the next iterator
    _park_s = 0.0

    def __init__(self, loader: IteratedLoader) -> None:
        super().__init__(loader)
        self._persistent = loader.persistent_workers
        self._tuner = (
            AutoTuner(min_workers=1, memory_ok=_memory_ok, cpu_clock=time.thread_time)
            if self._options.auto_workers
            else None
        )
        self._host_extras = self._tuner is not None or self._pin
        self._last_fields: dict[str, Any] = {}
        self._report_final = _weakly(loader._on_shutdown)
        resume = loader._take_worker_resume()
        if resume is not None:
            self._base_seed = resume[0]  # the interrupted epoch's (torch's draw was made)
            self.progress.workers.update(resume[2])  # where the workers start from
        self.progress.base_seed = self._base_seed
        self._runner_options = RunnerOptions(
            dataset=self._dataset,
            collate_fn=self._collate_fn,
            auto_collation=self._auto_collation,
            drop_last=self._drop_last,
            num_workers=self._num_workers,
            prefetch_factor=loader.prefetch_factor or 0,
            in_order=loader.in_order,
            timeout_s=loader.timeout,
            worker_init_fn=sharding_worker_init(self._dataset, loader.worker_init_fn),
            mp_context=loader.multiprocessing_context,
            base_seed=self._base_seed,
            host=HostPolicy.resolve(self._options.host_tuning),
            index_sampler=self._index_sampler,
            pin=pinned_slots() if (self._pin or self._device is not None) else None,
            max_shared_bytes=self._options.max_shared_bytes,
            auto_workers=self._options.auto_workers,
            readahead=self._options.readahead,
            resolved=self._capabilities,
            snapshot_rng=loader.in_order and self._fast_collate is None,
            snapshot_dataset=loader._replicas_keep_position(),
            resume_rng=None if resume is None else resume[2],
            first_worker=0 if resume is None else resume[1],
        )
        self._runner = self._parked_or_new_runner()
        if self._datapipe_seed is not None:
            # torch's iterator draws one more seed here (its first reset), unused by the workers.
            self._dataset = self._datapipe_seed.apply(self._dataset, loader.generator)

    def _parked_or_new_runner(self) -> Runner:
        """A runner parked by an earlier iterator that would be this one's (NOTE [parked
        workers] in ``_engine/_parking.py``), restarted for this epoch; else a new one."""
        self._park_s = 0.0 if self._persistent or self._device is not None else park_seconds()
        if self._park_s > 0:
            self._park_key = parking_key(self._runner_options, *_read_where(self._runner_options.dataset))
        parked = take_parked(self._park_key) if self._park_key is not None else None
        if parked is None:
            return start_runner(self._runner_options, self._sampler_iter)
        parked.restart(self._sampler_iter, self._base_seed)
        return parked

    def _next_host(self) -> tuple[Any, Counts]:
        runner = self._runner
        if runner is None:
            raise StopIteration  # shut down after an error or at the end of the epoch
        try:
            kind, value, counts, seq, worker = runner.get()
        except BaseException:
            if runner.closed:  # the runner ended the epoch: keep its last figures
                self._shutdown()
            raise
        if self._positions is not None and seq >= 0:
            self._positions.append(self._position_of(seq))
        if worker is not None:
            self._worker_rng.append(worker)
        if kind is not OK:
            return self._not_a_batch(runner, kind, value)
        if self._host_extras:
            return self._host_extras_for(runner, value, counts)
        return value, counts or batch_counts(value)

    def _position_of(self, seq: int) -> int:
        """The position in the sampler's order of the iteration's ``seq``-th batch (a resumed
        iteration out of order skips the positions received before the checkpoint)."""
        sampler = self._index_sampler
        return sampler.position_of(seq) if isinstance(sampler, SkipPositions) else seq

    def _not_a_batch(self, runner: Runner, kind: Kind, value: Any) -> tuple[Any, Counts]:
        if kind is DONE:
            # With device copies the epoch's last batch may still be copied out of its slot:
            # the workers and slots go once the copies are synchronized (_end_epoch).
            if not self._persistent and self._device is None:
                self._shutdown()
            raise StopIteration
        if self._tuner is not None:
            self._tune(runner)
        raise value  # FAILED: the epoch goes on after it

    def _host_extras_for(self, runner: Runner, value: Any, counts: Counts | None) -> tuple[Any, Counts]:
        """A batch, for a loader that tunes its workers or pins generic-path batches."""
        if self._tuner is not None:
            self._tune(runner)
        if self._pin and not runner.fast:
            value = pin_tree(value)
        return value, counts or batch_counts(value)

    def _tune(self, runner: Runner) -> None:
        """``num_workers="auto"``: let the tuner add or retire a worker. Only the speed changes:
        the batch plan and the delivery order do not depend on the worker count."""
        assert self._tuner is not None
        decision = self._tuner.observe(
            wait_s=self._meter.wait_s, step_s=self._meter.step_s, busy_s=runner.busy_s
        )
        if decision == "add":
            runner.add_worker()
        elif decision == "retire":
            runner.retire_worker()
        self._num_workers = runner.num_workers if decision != "retire" else self._tuner.num_workers

    def _engine_fields(self) -> dict[str, Any]:
        return self._runner.fields() if self._runner is not None else dict(self._last_fields)

    def _feed_storage(self) -> None:
        runner = self._runner
        if runner is None:
            self._shards.feed()
        else:
            self._shards.feed(runner.storage, runner.busy_s)

    def _end_epoch(self) -> None:
        super()._end_epoch()
        if self._device is not None and not self._persistent:
            self._shutdown()  # the prefetcher has synchronized its copies by now

    def _reset(self, loader: IteratedLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        # A later epoch starts where the workers stand, not where a loaded state had them.
        self._runner_options = dataclasses.replace(self._runner_options, resume_rng=None, first_worker=0)
        if self._runner is None:
            self._runner = start_runner(self._runner_options, self._sampler_iter)
        else:
            seed = self._datapipe_seed.last if self._datapipe_seed is not None else None
            self._runner.new_epoch(self._sampler_iter, shared_seed=seed)

    @property
    def worker_pids(self) -> list[int]:
        return self._runner.worker_pids if self._runner is not None else []

    def _shutdown(self, join_s: float = 2.0) -> None:
        """Stop the workers (NOTE [shutdown order] in ``_engine/_pool.py``). Idempotent. In a
        process that merely inherited this iterator (a forked worker of another loader) it only
        drops the references: the workers and slots belong to the process that made them."""
        self._stop_shard_prefetch()
        runner, self._runner = self._runner, None
        if runner is None or os.getpid() != self._owner_pid:
            return
        if self._on_device is not None:
            self._on_device.close()  # copies still reading a slot finish before the slots go
        self._last_fields = runner.fields()
        key = self._park_key
        if key is None or not runner.parkable or not park(key, runner, self._park_s):
            runner.close(join_s)
            self._last_fields = runner.fields()
        if self._shards.remote:
            self._shards.feed(runner.storage, runner.busy_s)
        self._report_final(dict(self._last_fields), self._num_workers)


def _read_where(dataset: Any) -> tuple[list[str], list[str]]:
    """Where the workers of ``dataset`` read (NOTE [parked workers] in ``_engine/_parking.py``):
    a fastload dataset's local files, or its shard cache's folder; for any other dataset
    nothing (it does not say, so its runner is never parked)."""
    if not isinstance(dataset, ShardedDataset):
        return [], []
    cache = dataset.shard_cache_plan()
    return ([], [cache[0]]) if cache is not None else (dataset.read_files, [])


def _weakly(method: Any) -> Any:
    """``method`` of the loader, called only while the loader lives: the loader holds its
    persistent iterator, so an iterator that held the loader would keep both, and the workers,
    alive until the cyclic garbage collector ran (torch's end at ``del loader``)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _consumed_weakly(iterator: _BaseIterator) -> Any:
    """The batches ``iterator`` has yielded, for the shard prefetcher's thread, without keeping
    the iterator alive: a thread that held it would keep it, its workers and their slots after
    the loop that used it let go (a ``break``, an error), since only its collection stops the
    prefetcher. 0 once it is gone (it stopped the prefetcher then)."""
    ref = weakref.ref(iterator)

    def consumed() -> int:
        it = ref()
        return 0 if it is None else it._num_yielded

    return consumed


def _memory_ok() -> bool:
    """Room for one more worker: at least 1 GiB of memory still available."""
    available = available_memory_bytes()
    return available is None or available > 1 << 30


class _HostBatches:
    """The iterator's host batches, each paired with its counts, as an iterator for the device
    prefetcher. The pair travels the prefetcher as one item (the counts hold no tensor, so they
    stay as they are), and a batch that fails, when it is taken or when its copy is started,
    takes its counts with it. Not a generator: a batch that fails raises from ``next()`` and the
    batches after it still come."""

    def __init__(self, it: _BaseIterator) -> None:
        self._it = it

    def __iter__(self) -> _HostBatches:
        return self

    def __next__(self) -> tuple[Any, Counts]:
        return self._it._next_host()
