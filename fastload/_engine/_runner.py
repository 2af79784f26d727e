"""The engine's one front door for the loader: :func:`start_runner` builds the whole machinery
for an iterator from one :class:`RunnerOptions`, and returns a :class:`Runner`.

Two runners behind one small API:

* the **slot runner** (:class:`SlotRunner`; the fast path: a batch reader and a slot
  collate): batch slots in shared memory (``_arena.py``, sized by ``_sizing.py``), a codec that
  turns slot descriptors into tensors (``_slots.py``), workers that build into the slots
  (``_builder.py``), and the pump (``_pump.py``) that drives the engine on the consumer's
  thread or on its own, as the consumer's pace calls for;
* the **generic runner** (:class:`GenericRunner`; any dataset, any ``collate_fn``): torch's
  protocol to the letter, the consumer's ``next()`` driving the engine and refilling from the
  sampler.

Both build their engine the same way (:class:`SpecFactory`, :func:`start_engine`) and report
the same figures (:func:`engine_fields`, :class:`RunnerBase`).

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
from dataclasses import dataclass, replace
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from fastload._capabilities import Capabilities, resolve
from fastload._engine._arena import SlotDevice
from fastload._engine._builder import SlotBuilder
from fastload._engine._counts import batch_counts
from fastload._engine._engine import Engine
from fastload._engine._host import HostPolicy
from fastload._engine._messages import DONE, ERROR, Delivery
from fastload._engine._pump import Pump, end_marker
from fastload._engine._sizing import slot_arena
from fastload._engine._slots import SlotCodec
from fastload._engine._worker import WorkerSpec
from fastload._engine._zygote import WorkerServer, worker_server
from fastload._types import StorageCounts
from fastload.errors import FastloadError


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
    #: The device the fast path's slots are page-locked for and whose copies from them are
    #: fenced (``fastload._device.PinnedSlots``), or None: pageable slots.
    pin: SlotDevice | None = None
    max_shared_bytes: int | None = None
    auto_workers: bool = False  # num_workers="auto": the pool may grow to every core
    #: Workers tell the kernel which byte ranges the tasks queued behind their current one read
    #: (``willneed``, ``fastload._protocols``), so that a cold disk reads them ahead.
    readahead: bool = False
    #: The generic path's workers send their random states with each batch (``Delivery.worker``).
    snapshot_rng: bool = False
    #: With it, each worker's iterable dataset replica's own state (it has ``state_dict``).
    snapshot_dataset: bool = False
    #: A resumed epoch: the workers' random states to start from (``WorkerSpec.resume_rng``),
    #: and the worker the first task goes to.
    resume_rng: dict[int, Any] | None = None
    first_worker: int = 0
    #: What the engine may use of the dataset and the collate, as the loader resolved them
    #: (``fastload._capabilities``); ``None``: resolved here, from the two.
    resolved: Capabilities | None = None

    @property
    def capabilities(self) -> Capabilities:
        return self.resolved if self.resolved is not None else resolve(self.dataset, self.collate_fn)

    @property
    def fast_collate(self) -> Any:
        """The slot collate when the fast path applies (see :func:`fast_path_collate`)."""
        return fast_path_collate(
            self.dataset, self.collate_fn, self.auto_collation, self.num_workers, self.capabilities
        )


def fast_path_collate(
    dataset: Any, collate: Any, auto_collation: bool, num_workers: int, capabilities: Capabilities | None = None
) -> Any:
    """``collate`` when the fast path applies, else ``None``: a map-style dataset that is a
    ``BatchReader`` (``read_batch``, ``lengths`` and ``fields`` of fastload's), batches of
    indices, and a collate that is a ``SlotCollate`` whose ``__call__`` they compute (see
    ``fastload._capabilities``)."""
    if isinstance(dataset, IterableDataset) or not auto_collation:
        return None
    if not (capabilities if capabilities is not None else resolve(dataset, collate)).fast_path:
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

    @property
    def storage(self) -> StorageCounts | None:
        """What the workers' reads of remote storage cost so far (``None``: none reported)."""
        ...

    def get(self) -> Delivery: ...

    def new_epoch(self, sampler_iter: Iterator[Any], shared_seed: int | None = None) -> None:
        """Start over on the same workers; ``shared_seed`` seeds a DataPipe graph in each."""

    def add_worker(self) -> None: ...

    def retire_worker(self) -> None: ...

    def fields(self) -> dict[str, Any]: ...

    @property
    def parkable(self) -> bool:
        """Whether it may wait for another iterator (NOTE [parked workers] in ``_parking.py``)."""
        ...

    def restart(self, sampler_iter: Iterator[Any], base_seed: int) -> None:
        """Serve another iterator (a parked runner taken)."""

    def close(self, join_s: float = 2.0) -> None: ...


def start_runner(options: RunnerOptions, sampler_iter: Iterator[Any]) -> Runner:
    """Start the workers for ``options`` and send them the first tasks from ``sampler_iter``."""
    capabilities = options.capabilities
    if options.resolved is None:
        options = replace(options, resolved=capabilities)
    collate = options.fast_collate
    if collate is not None:
        return SlotRunner(options, collate, sampler_iter)
    return GenericRunner(options, sampler_iter)


@dataclass(frozen=True)
class SpecFactory:
    """Makes each worker's spec from one template (a plain object, so the engine holds no
    reference back to the iterator and garbage collection can close it)."""

    template: WorkerSpec
    host: HostPolicy

    def __call__(self, worker_id: int, epoch: int) -> WorkerSpec:
        return dataclasses.replace(self.template, worker_id=worker_id, epoch=epoch, host=self.host.worker())


def worker_spec(options: RunnerOptions, builder: SlotBuilder | None) -> WorkerSpec:
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
        readahead=options.readahead,
        capabilities=options.capabilities.dataset,
        snapshot_rng=options.snapshot_rng and builder is None,
        snapshot_dataset=options.snapshot_dataset and builder is None,
        resume_rng=options.resume_rng,
    )


def start_engine(
    options: RunnerOptions,
    specs: SpecFactory,
    codec: Any,
    start: int | None,
    place_in_time: bool = False,
    server: WorkerServer | None = None,
) -> Engine:
    return Engine(
        ctx=options.mp_context or multiprocessing.get_context(),
        num_workers=options.num_workers,
        max_tasks=options.prefetch_factor * options.num_workers,
        in_order=options.in_order,
        timeout_s=options.timeout_s,
        restartable=not isinstance(options.dataset, IterableDataset),
        make_spec=specs,
        codec=codec,
        max_workers=usable_cores() if options.auto_workers else None,
        start_workers=start,
        place_in_time=place_in_time,
        server=server,
    )


def served_workers(options: RunnerOptions) -> WorkerServer | None:
    """The worker server to fork this iterator's workers (``_zygote.py``), where fork would
    be used and a batch is the same in any process (:func:`same_in_any_worker`) and the server
    is ready; ``None``: fork here (the first call starts the server for later iterators)."""
    if options.mp_context is not None or multiprocessing.get_context().get_start_method() != "fork":
        return None
    return worker_server() if same_in_any_worker(options) else None


def same_in_any_worker(options: RunnerOptions) -> bool:
    """Whether a batch is the same whichever worker builds it: a reader and a collate that say
    their output depends on nothing of the process (``fastload._protocols``), and no
    ``worker_init_fn`` to make the workers differ. Then tasks are placed in time (NOTE [tasks
    placed in time] in ``_engine.py``), not round-robin."""
    capabilities = options.capabilities
    return (
        capabilities.dataset.process_independent_reads
        and capabilities.collate.process_independent
        and options.worker_init_fn is None
    )


def usable_cores() -> int:
    """The CPUs this process may run on (``num_workers="auto"`` grows the pool up to it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_fields(engine: Engine, fast: bool) -> dict[str, Any]:
    wall = max(1e-9, time.monotonic() - engine.started)
    busy = sum(engine.busy_s)
    return {
        "queue_depth": engine.pending,
        "worker_busy": tuple(min(1.0, b / wall) for b in engine.busy_s),
        "worker_read_share": (sum(engine.read_s) / busy) if busy and fast else None,
        "respawns": engine.respawns,
        "retries": engine.retries,
    }


class RunnerBase:
    """What both runners say of themselves the same way (``_runner.Runner``): their engine's
    workers, and whether they are closed (then ``_final`` holds the engine's last figures)."""

    _engine: Engine
    _final: dict[str, Any] | None = None

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._final is not None else self._engine.worker_pids

    @property
    def parkable(self) -> bool:
        return False  # only the slot runner's workers are parked

    def restart(self, sampler_iter: Iterator[Any], base_seed: int) -> None:
        raise RuntimeError(f"a {type(self).__name__} is never parked, so never restarted")

    @property
    def num_workers(self) -> int:
        return self._engine.num_workers

    @property
    def closed(self) -> bool:
        return self._final is not None

    @property
    def busy_s(self) -> float:
        return self._engine.busy_total_s

    @property
    def storage(self) -> StorageCounts | None:
        """What the workers' reads of remote storage cost so far (``None``: none reported)."""
        return self._engine.storage


class GenericRunner(RunnerBase):
    """Any dataset, any ``collate_fn``: torch's protocol to the letter, ``next()`` driving the
    engine, then refilling from the sampler."""

    fast = False

    def __init__(self, options: RunnerOptions, sampler_iter: Iterator[Any]) -> None:
        self._options = options
        self._sampler_iter = sampler_iter
        self._skip_refills = 0  # after a worker retires: fewer tasks in flight
        self._final: dict[str, Any] | None = None
        self._engine = start_engine(options, SpecFactory(worker_spec(options, None), options.host), None, None)
        self._engine.dispatch_from(options.first_worker)
        self._prime()

    def _prime(self) -> None:
        for _ in range(self._options.prefetch_factor * self._engine.staying_workers):
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

    def new_epoch(self, sampler_iter: Iterator[Any], shared_seed: int | None = None) -> None:
        self._sampler_iter = sampler_iter
        self._engine.new_epoch(shared_seed)
        self._skip_refills = 0  # the new epoch is primed for the workers that stay
        self._prime()

    def add_worker(self) -> None:
        self._engine.add_worker()
        for _ in range(self._options.prefetch_factor):
            self._try_put()

    def retire_worker(self) -> None:
        if self._engine.retire_worker():
            self._skip_refills += self._options.prefetch_factor

    def fields(self) -> dict[str, Any]:
        return dict(self._final) if self._final is not None else engine_fields(self._engine, False)

    def close(self, join_s: float = 2.0) -> None:
        if self._final is None:
            self._final = engine_fields(self._engine, False)
        self._engine.close(join_s)


class SlotSource:
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


class SlotRunner(RunnerBase):
    """The fast path: batch slots in shared memory, a codec that turns slot descriptors into
    tensors, workers that build into the slots, and the pump that drives the engine on the
    consumer's thread or on its own (see the module text)."""

    fast = True

    def __init__(self, options: RunnerOptions, collate: Any, sampler_iter: Iterator[Any]) -> None:
        self._options = options
        self._final: dict[str, Any] | None = None
        self._arena, batch_bytes = slot_arena(
            collate,
            options.dataset,
            options.index_sampler,
            slots=options.prefetch_factor * options.num_workers + 2,
            max_bytes=options.max_shared_bytes,
            pin=options.pin,
            capabilities=options.capabilities,
        )
        self._codec = SlotCodec(self._arena, batch_bytes)
        builder = SlotBuilder(options.dataset, collate, os.getpid(), capabilities=options.capabilities)
        specs = SpecFactory(worker_spec(options, builder), options.host)
        # Worker 0 is forked first and gets the first task before the others are forked, so
        # the first batch is built while they start.
        self._engine = start_engine(
            options,
            specs,
            self._codec,
            1,
            place_in_time=same_in_any_worker(options),
            server=served_workers(options),
        )
        self._pump = Pump(
            self._engine, SlotSource(sampler_iter, self._codec), batch_counts, options.timeout_s
        )
        self._lock = threading.Lock()  # close() may come from a finalizer on another thread
        try:
            self._prime(first=True)
        except BaseException:  # a fork that failed: nothing started may outlive the runner
            self.close(join_s=0.1)
            raise

    def _prime(self, first: bool = False) -> None:
        budget = self._options.prefetch_factor * self._engine.staying_workers
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
        return item

    def new_epoch(self, sampler_iter: Iterator[Any], shared_seed: int | None = None) -> None:
        # shared_seed is for DataPipe graphs, which are iterable: never on the fast path.
        self._pump.new_epoch(SlotSource(sampler_iter, self._codec))
        self._prime()

    @property
    def parkable(self) -> bool:
        """Whether this runner may wait for another iterator (NOTE [parked workers] in
        ``_parking.py``): open, and every worker running."""
        if self._final is not None:
            return False
        with self._pump.lock:
            return self._engine.all_alive()

    def restart(self, sampler_iter: Iterator[Any], base_seed: int) -> None:
        """Serve a new iterator: a new epoch from ``sampler_iter``, the workers seeded again
        from ``base_seed`` and the figures counted from now (a parked runner taken)."""
        with self._pump.lock:
            self._engine.restart_figures()
        self._pump.new_epoch(SlotSource(sampler_iter, self._codec), base_seed=base_seed)
        self._prime()

    def add_worker(self) -> None:
        with self._pump.lock:
            self._engine.add_worker()
        self._pump.grant(self._options.prefetch_factor)
        self._pump.wake()

    def retire_worker(self) -> None:
        with self._pump.lock:
            leaving = self._engine.retire_worker()
        if leaving:
            self._pump.skip_grants(self._options.prefetch_factor)
            self._pump.wake()

    def fields(self) -> dict[str, Any]:
        if self._final is not None:
            return dict(self._final)
        with self._pump.lock:
            fields = engine_fields(self._engine, True)
        fields["slots_in_use"] = self._arena.in_use
        return fields

    def close(self, join_s: float = 2.0) -> None:
        """Stop the thread, then the workers, then free the slots (NOTE [shutdown order] in
        ``_pool.py``). Idempotent."""
        with self._lock:
            if self._final is not None:
                return
            self._pump.close()  # first: the thread must not touch the engine while it closes
            self._final = engine_fields(self._engine, True)
            self._final["slots_in_use"] = self._arena.in_use
            self._engine.close(join_s)
            self._arena.close()


__all__ = ["GenericRunner", "Runner", "RunnerOptions", "SlotRunner", "fast_path_collate", "start_runner"]


def fresh_process_context() -> Any:
    """A process context whose workers do not inherit the main process's threads: a fork
    server, started as a new interpreter with fastload imported, forks each worker.

    For datasets whose clients are not safe across ``fork`` (the AWS SDK behind pyarrow's S3
    filesystem: a worker forked while its threads hold a lock hangs creating its own client),
    at the cost of one interpreter start per loader process, not per worker."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fastload"])
    return context
