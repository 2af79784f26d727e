"""The engine's one front door for the loader: :func:`start_runner` builds the whole machinery
for an iterator from one :class:`RunnerOptions`, and returns a :class:`Runner`.

Two runners behind one small API:

* the **slot runner** (the fast path: a batch reader and a slot collate): batch slots in shared
  memory (``_arena.py``, sized by ``_sizing.py``), a codec that turns slot descriptors into
  tensors (``_slots.py``), workers that build into the slots (``_builder.py``), and the pump
  (``_pump.py``) that drives the engine on the consumer's thread or on its own, as the
  consumer's pace calls for; the host policy (``_host.py``) places them;
* the **generic runner** (any dataset, any ``collate_fn``): torch's protocol to the letter, the
  consumer's ``next()`` driving the engine and refilling from the sampler.

Protocol, for either: ``get()`` the next :class:`~fastload._engine._messages.Delivery` in order
(``OK``, ``FAILED`` — raise it, the epoch goes on — or ``DONE``), having sent the next task
for it (torch's refill: at most ``prefetch_factor × num_workers`` batches ahead of the
consumer); an error that ends the epoch is raised by ``get()`` itself, the runner closed first.
``new_epoch(sampler_iter)`` starts over on the same workers; ``close()`` stops everything
(NOTE [shutdown order] in ``_pool.py``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch.utils.data import IterableDataset

from fastload._engine._arena import Pinner, SlotArena, available_memory_bytes
from fastload._engine._builder import SlotBuilder
from fastload._engine._cores import CONFINE, RELEASE, WARMUP, WINDOW, ConsumerCore
from fastload._engine._counts import batch_counts
from fastload._engine._engine import Engine
from fastload._engine._host import HostPolicy
from fastload._engine._messages import DONE, ERROR, Delivery
from fastload._engine._pump import Pump, end_marker
from fastload._engine._sizing import BatchBytes, slot_bytes_bound
from fastload._engine._slots import SlotCodec
from fastload._engine._worker import WorkerSpec
from fastload.errors import FastloadError, SharedMemoryError

_MIN_SHARED_BYTES = 256 << 20  # the default bound never goes below this


@dataclass(frozen=True)
class RunnerOptions:
    """Everything the engine needs to serve one iterator (the loader's, torch's and fastload's
    options, resolved)."""

    dataset: Any
    collate_fn: Callable[[Any], Any]
    auto_collation: bool
    drop_last: bool
    num_workers: int
    prefetch_factor: int
    in_order: bool
    timeout_s: float  # as the user gave it: the error message quotes it unchanged
    worker_init_fn: Callable[[int], None] | None
    mp_context: Any  # None: the default start method
    base_seed: int
    host: HostPolicy
    #: The index sampler (for the fast path's slot sizing: what its batches can hold).
    index_sampler: Any = None
    #: How the fast path's slots are page-locked (``fastload._device.page_lock``), or None.
    pin: Pinner | None = None
    max_shared_bytes: int | None = None
    auto_workers: bool = False  # num_workers="auto": the pool may grow to every core

    @property
    def fast_collate(self) -> Any:
        """The slot collate when the fast path applies (see :func:`fast_path_collate`)."""
        return fast_path_collate(self.dataset, self.collate_fn, self.auto_collation, self.num_workers)


def fast_path_collate(dataset: Any, collate: Any, auto_collation: bool, num_workers: int) -> Any:
    """``collate`` when the fast path applies, else ``None``: a map-style dataset that is a
    ``BatchReader`` (``read_batch`` and ``lengths``), batches of indices, and a collate that is
    a ``SlotCollate`` (``layout`` and ``collate_into``); see ``fastload._protocols``."""
    if isinstance(dataset, IterableDataset) or not auto_collation:
        return None
    if not (callable(getattr(dataset, "read_batch", None)) and hasattr(dataset, "lengths")):
        return None
    if not (callable(getattr(collate, "layout", None)) and callable(getattr(collate, "collate_into", None))):
        return None
    if num_workers > 0 and not os.path.isdir("/proc/self/fd"):
        return None  # workers map the slots through /proc (Linux); elsewhere the generic path runs
    return collate


class Runner(Protocol):
    """What an iterator drives (see the module text)."""

    fast: bool  # the fast path (batches built into shared-memory slots)

    @property
    def worker_pids(self) -> list[int]: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def busy_s(self) -> float:
        """Seconds the workers have spent building batches, retired workers included."""
        ...

    def get(self) -> Delivery: ...

    def new_epoch(self, sampler_iter: Iterator[Any]) -> None: ...

    def add_worker(self) -> None: ...

    def retire_worker(self) -> None: ...

    def fields(self) -> dict[str, Any]: ...

    def close(self, join_s: float = 2.0) -> None: ...


def start_runner(options: RunnerOptions, sampler_iter: Iterator[Any]) -> Runner:
    """Start the workers for ``options`` and send them the first tasks from ``sampler_iter``."""
    collate = options.fast_collate
    if collate is not None:
        return _SlotRunner(options, collate, sampler_iter)
    return _GenericRunner(options, sampler_iter)


@dataclass(frozen=True)
class _SpecFactory:
    """Makes each worker's spec from one template (a plain object, so the engine holds no
    reference back to the iterator and garbage collection can close it)."""

    template: WorkerSpec
    host: HostPolicy
    cores: ConsumerCore | None = None  # the fast path's CPU placement, as it stands now

    def __call__(self, worker_id: int, epoch: int) -> WorkerSpec:
        return dataclasses.replace(
            self.template, worker_id=worker_id, epoch=epoch, host=self.host.worker(self.cores)
        )


def _spec(options: RunnerOptions, builder: SlotBuilder | None) -> WorkerSpec:
    return WorkerSpec(
        dataset=options.dataset,
        auto_collation=options.auto_collation,
        collate_fn=options.collate_fn,
        drop_last=options.drop_last,
        base_seed=options.base_seed,
        worker_init_fn=options.worker_init_fn,
        worker_id=0,
        num_workers=options.num_workers,
        main_pid=os.getpid(),
        epoch=0,
        builder=builder,
    )


def _engine(options: RunnerOptions, specs: _SpecFactory, codec: Any, start: int | None) -> Engine:
    return Engine(
        ctx=options.mp_context or multiprocessing.get_context(),
        num_workers=options.num_workers,
        max_tasks=options.prefetch_factor * options.num_workers,
        in_order=options.in_order,
        timeout_s=options.timeout_s,
        restartable=not isinstance(options.dataset, IterableDataset),
        make_spec=specs,
        codec=codec,
        max_workers=_usable_cores() if options.auto_workers else None,
        start_workers=start,
    )


def _usable_cores() -> int:
    """The CPUs this process may run on (``num_workers="auto"`` grows the pool up to it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _engine_fields(engine: Engine, fast: bool) -> dict[str, Any]:
    wall = max(1e-9, time.monotonic() - engine.started)
    busy = sum(engine.busy_s)
    return {
        "queue_depth": engine.pending,
        "worker_busy": tuple(min(1.0, b / wall) for b in engine.busy_s),
        "worker_read_share": (sum(engine.read_s) / busy) if busy and fast else None,
        "respawns": engine.respawns,
        "retries": engine.retries,
        "main_batches": engine.main_batches,
    }


class _GenericRunner:
    """torch's protocol: ``next()`` drives the engine, then refills from the sampler."""

    fast = False

    def __init__(self, options: RunnerOptions, sampler_iter: Iterator[Any]) -> None:
        self._options = options
        self._sampler_iter = sampler_iter
        self._skip_refills = 0  # after a worker retires: fewer tasks in flight
        self._final: dict[str, Any] | None = None
        self._engine = _engine(options, _SpecFactory(_spec(options, None), options.host), None, None)
        self._prime()

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._final is not None else self._engine.worker_pids

    @property
    def num_workers(self) -> int:
        return self._engine.num_workers

    @property
    def closed(self) -> bool:
        return self._final is not None

    @property
    def busy_s(self) -> float:
        return self._engine.busy_total_s

    def _prime(self) -> None:
        for _ in range(self._options.prefetch_factor * self._engine.num_workers):
            self._try_put()

    def _try_put(self) -> None:
        """torch's ``_try_put_index``: one more task, if the sampler has one and a worker is
        active (the index is consumed from the sampler either way)."""
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            return
        self._engine.put(index)

    def get(self) -> Delivery:
        try:
            item = self._engine.get(self._try_put)
        except FastloadError:
            self.close(join_s=0.1)  # a dead or hung worker: this epoch cannot go on
            raise
        if item.kind is not DONE:
            if self._skip_refills:
                self._skip_refills -= 1
            else:
                self._try_put()
        return item

    def new_epoch(self, sampler_iter: Iterator[Any]) -> None:
        self._sampler_iter = sampler_iter
        self._engine.new_epoch()
        self._prime()

    def add_worker(self) -> None:
        self._engine.add_worker()
        for _ in range(self._options.prefetch_factor):
            self._try_put()

    def retire_worker(self) -> None:
        self._engine.retire_worker()
        self._skip_refills += self._options.prefetch_factor

    def fields(self) -> dict[str, Any]:
        return dict(self._final) if self._final is not None else _engine_fields(self._engine, False)

    def close(self, join_s: float = 2.0) -> None:
        if self._final is None:
            self._final = _engine_fields(self._engine, False)
        self._engine.close(join_s)


class _IndexSource:
    """The fast path's next task, taken on whichever thread drives: the sampler's next batch
    of indices with a slot reserved for it (holds no reference to the iterator)."""

    def __init__(self, sampler_iter: Iterator[Any], codec: SlotCodec) -> None:
        self._it = sampler_iter
        self._codec = codec

    def __call__(self) -> Any:
        try:
            index = next(self._it)
        except StopIteration:
            return end_marker()
        return self._codec.task(index)


class _SlotRunner:
    """The fast path (see the module text)."""

    fast = True

    def __init__(self, options: RunnerOptions, collate: Any, sampler_iter: Iterator[Any]) -> None:
        self._options = options
        self._final: dict[str, Any] | None = None
        host = options.host
        self._arena, batch_bytes = _new_arena(options, collate)
        self._codec = SlotCodec(self._arena, _main_builder(options, collate), batch_bytes)
        self._cores = host.consumer_core()
        self._window_left = WARMUP  # deliveries until the next window of the placement closes
        builder = SlotBuilder(options.dataset, collate, os.getpid())
        specs = _SpecFactory(_spec(options, builder), host, self._cores)
        # Worker 0 is forked first and gets the first task before the others are forked, so
        # the first batch is built while they start.
        self._engine = _engine(options, specs, self._codec, 1)
        self._pump = Pump(
            self._engine, _IndexSource(sampler_iter, self._codec), batch_counts, options.timeout_s, host
        )
        self._arena.on_release = self._pump.nudge
        self._lock = threading.Lock()  # close() may come from a finalizer on another thread
        self._prime(first=True)

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._final is not None else self._engine.worker_pids

    @property
    def num_workers(self) -> int:
        return self._engine.num_workers

    @property
    def closed(self) -> bool:
        return self._final is not None

    @property
    def busy_s(self) -> float:
        return self._engine.busy_total_s

    def _prime(self, first: bool = False) -> None:
        budget = self._options.prefetch_factor * self._engine.num_workers
        if first:
            self._pump.grant(1)
            self._engine.start_workers()
            budget -= 1
        self._pump.grant(budget)

    def get(self) -> Delivery:
        try:
            item = self._pump.take()
        except BaseException:
            self.close(join_s=0.1)  # the engine thread died, a timeout: this epoch cannot go on
            raise
        if item.kind is ERROR:
            self.close(join_s=0.1)
            raise item.value
        left = self._window_left - 1
        if left:
            self._window_left = left
        else:
            self._window_closed()
        return item

    def _window_closed(self) -> None:
        """A window of deliveries closed: the workers stay off the consumer's CPU unless a
        trial, begun when a window shows the consumer starved, finds them faster on every CPU
        (``_cores.py``)."""
        self._window_left = WINDOW
        cores = self._cores
        if cores is None or not cores.deciding:
            return
        decision = cores.observe_window(time.perf_counter(), self._pump.waited_s)
        if decision == RELEASE:
            cores.release(self._engine.worker_pids)
        elif decision == CONFINE:
            cores.confine(self._engine.worker_pids)

    def new_epoch(self, sampler_iter: Iterator[Any]) -> None:
        self._pump.new_epoch(_IndexSource(sampler_iter, self._codec))
        self._prime()

    def add_worker(self) -> None:
        with self._pump.lock:
            self._engine.add_worker()
        self._pump.grant(self._options.prefetch_factor)
        self._pump.wake()

    def retire_worker(self) -> None:
        with self._pump.lock:
            self._engine.retire_worker()
        self._pump.skip_grants(self._options.prefetch_factor)
        self._pump.wake()

    def fields(self) -> dict[str, Any]:
        if self._final is not None:
            return dict(self._final)
        with self._pump.lock:
            fields = _engine_fields(self._engine, True)
        fields["slots_in_use"] = self._arena.in_use
        return fields

    def close(self, join_s: float = 2.0) -> None:
        """Stop the thread, then the workers, then free the slots (NOTE [shutdown order] in
        ``_pool.py``). Idempotent."""
        with self._lock:
            if self._final is not None:
                return
            self._pump.close()  # first: the thread must not touch the engine while it closes
            self._final = _engine_fields(self._engine, True)
            self._final["slots_in_use"] = self._arena.in_use
            self._engine.close(join_s)
            self._arena.close()


def _new_arena(options: RunnerOptions, collate: Any) -> tuple[SlotArena, BatchBytes | None]:
    """The slots, sized for the largest batch the sampler can make where it says so and that
    fits, else from the batches that come (``_sizing.py``)."""
    reader = options.dataset
    lengths = np.asarray(reader.lengths)
    max_bytes = options.max_shared_bytes
    if max_bytes is None:
        max_bytes = max(_MIN_SHARED_BYTES, (available_memory_bytes() or 4 << 30) // 4)
    slots = options.prefetch_factor * options.num_workers + 2
    rows, max_tokens = _plan_rows_and_tokens(options.index_sampler)
    if rows is not None or max_tokens is not None:
        bound = slot_bytes_bound(collate, reader.fields, lengths, rows=rows, max_tokens=max_tokens)
        try:
            return SlotArena(slot_bytes=bound, slots=slots, max_bytes=max_bytes, pin=options.pin), None
        except SharedMemoryError:
            pass  # the largest possible batch does not fit: size from the batches that come
    arena = SlotArena(slot_bytes=0, slots=slots, max_bytes=max_bytes, pin=options.pin)
    return arena, BatchBytes(collate, reader.fields, lengths)


def _plan_rows_and_tokens(sampler: Any) -> tuple[int | None, int | None]:
    """The most rows and the token budget of the batches ``sampler`` says it makes (``None``
    where it does not say)."""
    rows = getattr(sampler, "batch_size", None)
    max_tokens = getattr(sampler, "max_tokens", None)
    if rows is None and max_tokens is None and isinstance(sampler, (list, tuple)):
        rows = max((len(b) for b in sampler), default=1)
    return (rows if isinstance(rows, int) else None), (max_tokens if isinstance(max_tokens, int) else None)


def _main_builder(options: RunnerOptions, collate: Any) -> Callable[[SlotArena], SlotBuilder | None] | None:
    """What makes, given the arena, the builder with which the main process may build a batch
    itself while it would wait for a worker (``_claims.py``), or ``None``: for one-call builds,
    and for any batch of a reader and a collate that both say their output is the same in any
    process (``fastload._protocols``). Never with a ``worker_init_fn``: it may change what a
    worker's dataset reads, and the main process's copy would not follow."""
    if not options.host.main_builds or options.worker_init_fn is not None:
        return None
    dataset = options.dataset
    general = bool(getattr(dataset, "process_independent_reads", False)) and bool(
        getattr(collate, "process_independent", False)
    )

    def make(arena: SlotArena) -> SlotBuilder | None:
        builder = SlotBuilder(dataset, collate, os.getpid(), slots=arena)
        return builder if general or builder.one_call() else None

    return make


__all__ = ["Runner", "RunnerOptions", "fast_path_collate", "start_runner"]
