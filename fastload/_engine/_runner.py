"""The engine's one front door for the loader: :func:`start_runner` builds the whole machinery
for an iterator from one :class:`RunnerOptions`, and returns a :class:`Runner`.

Two runners behind one small API:

* the **slot runner** (``_slot_runner.py``; the fast path: a batch reader and a slot collate):
  batch slots in shared memory (``_arena.py``, sized by ``_sizing.py``), a codec that turns
  slot descriptors into tensors (``_slots.py``), workers that build into the slots
  (``_builder.py``), and the pump (``_pump.py``) that drives the engine on the consumer's
  thread or on its own, as the consumer's pace calls for; the host policy (``_host.py``) places
  them;
* the **generic runner** (``_generic_runner.py``; any dataset, any ``collate_fn``): torch's
  protocol to the letter, the consumer's ``next()`` driving the engine and refilling from the
  sampler.

Protocol, for either: ``get()`` the next :class:`~fastload._engine._messages.Delivery` in order
(``OK``, ``FAILED`` — raise it, the epoch goes on — or ``DONE``), having sent the next task
for it (torch's refill: at most ``prefetch_factor × num_workers`` batches ahead of the
consumer); an error that ends the epoch is raised by ``get()`` itself, the runner closed first.
``new_epoch(sampler_iter)`` starts over on the same workers; ``close()`` stops everything
(NOTE [shutdown order] in ``_pool.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from torch.utils.data import IterableDataset

from fastload._capabilities import Capabilities, resolve
from fastload._engine._arena import SlotDevice
from fastload._engine._generic_runner import GenericRunner
from fastload._engine._host import HostPolicy
from fastload._engine._messages import Delivery
from fastload._engine._slot_runner import SlotRunner
from fastload._types import StorageCounts


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


__all__ = ["Runner", "RunnerOptions", "fast_path_collate", "start_runner"]


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

