"""Building an engine for one iterator: each worker's spec, the engine itself, and the figures
the loader's statistics read off it. Shared by the two runners."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset

from fastload._engine._builder import SlotBuilder
from fastload._engine._cores import ConsumerCore
from fastload._engine._engine import Engine
from fastload._engine._host import HostPolicy
from fastload._engine._worker import WorkerSpec
from fastload._types import StorageCounts

if TYPE_CHECKING:
    from fastload._engine._runner import RunnerOptions


@dataclass(frozen=True)
class SpecFactory:
    """Makes each worker's spec from one template (a plain object, so the engine holds no
    reference back to the iterator and garbage collection can close it)."""

    template: WorkerSpec
    host: HostPolicy
    cores: ConsumerCore | None = None  # the fast path's CPU placement, as it stands now

    def __call__(self, worker_id: int, epoch: int) -> WorkerSpec:
        return dataclasses.replace(
            self.template, worker_id=worker_id, epoch=epoch, host=self.host.worker(self.cores)
        )


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


def start_engine(options: RunnerOptions, specs: SpecFactory, codec: Any, start: int | None) -> Engine:
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
        "main_batches": engine.main_batches,
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
