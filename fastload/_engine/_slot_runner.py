"""The slot runner: the fast path (a batch reader and a slot collate). Batch slots in shared
memory, a codec that turns slot descriptors into tensors, workers that build into the slots, and
the pump that drives the engine on the consumer's thread or on its own; the host policy places
them. See ``_runner.py``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastload._engine._builder import SlotBuilder, main_builder
from fastload._engine._cores import CONFINE, RELEASE, WARMUP, WINDOW
from fastload._engine._counts import batch_counts
from fastload._engine._messages import ERROR, Delivery
from fastload._engine._pump import Pump, end_marker
from fastload._engine._sizing import slot_arena
from fastload._engine._slots import SlotCodec
from fastload._engine._wiring import (
    RunnerBase,
    SpecFactory,
    engine_fields,
    start_engine,
    worker_spec,
)

if TYPE_CHECKING:
    from fastload._engine._runner import RunnerOptions


class IndexSource:
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
    """The fast path (see the module text)."""

    fast = True

    def __init__(self, options: RunnerOptions, collate: Any, sampler_iter: Iterator[Any]) -> None:
        self._options = options
        self._final: dict[str, Any] | None = None
        host = options.host
        self._arena, batch_bytes = slot_arena(
            collate,
            options.dataset,
            options.index_sampler,
            slots=options.prefetch_factor * options.num_workers + 2,
            max_bytes=options.max_shared_bytes,
            pin=options.pin,
            capabilities=options.capabilities,
        )
        main = None
        if host.main_builds and options.worker_init_fn is None:
            main = main_builder(options.dataset, collate, options.capabilities)
        self._codec = SlotCodec(self._arena, main, batch_bytes)
        self._cores = host.consumer_core()
        self._window_left = WARMUP  # deliveries until the next window of the placement closes
        builder = SlotBuilder(options.dataset, collate, os.getpid(), capabilities=options.capabilities)
        specs = SpecFactory(worker_spec(options, builder), host, self._cores)
        # Worker 0 is forked first and gets the first task before the others are forked, so
        # the first batch is built while they start.
        self._engine = start_engine(options, specs, self._codec, 1)
        self._pump = Pump(
            self._engine, IndexSource(sampler_iter, self._codec), batch_counts, options.timeout_s
        )
        self._arena.on_release = self._pump.nudge
        self._lock = threading.Lock()  # close() may come from a finalizer on another thread
        self._prime(first=True)

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

    def new_epoch(self, sampler_iter: Iterator[Any], shared_seed: int | None = None) -> None:
        # shared_seed is for DataPipe graphs, which are iterable: never on the fast path.
        self._pump.new_epoch(IndexSource(sampler_iter, self._codec))
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
