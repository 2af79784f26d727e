"""The iterator behind ``iter(fastload.DataLoader(...))``.

It keeps torch's observable behaviour to the letter — the order in which random numbers are
drawn (sampler iterator first, then the workers' base seed, from ``loader.generator`` or the
global generator), torch's dispatch rule, ``prefetch_factor × num_workers`` batches in flight,
the pin-memory warning, ``len()``, the IterableDataset length warning and persistent-worker
resets — while the work is done by fastload's own engine.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from fastload._device import DevicePrefetcher, cuda_device, page_lock, pin_tree
from fastload._engine import DONE, FAILED, Engine, WorkerSpec, make_fetcher
from fastload._engine._arena import SlotArena, available_memory_bytes
from fastload._engine._fastpath import SlotBuilder, SlotCodec, slot_bytes_bound
from fastload.errors import FastloadError

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
    return collate


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

    def __call__(self, worker_id: int, epoch: int) -> WorkerSpec:
        return dataclasses.replace(self.template, worker_id=worker_id, epoch=epoch)


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
        if loader.pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
        self._pin = loader.pin_memory and torch.cuda.is_available()
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        # torch's order of effects: the sampler's iterator, then the base seed.
        self._sampler_iter: Any = iter(self._index_sampler)
        self._base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )
        self._num_yielded = 0
        self._owner_pid = os.getpid()
        self._engine: Engine | None = None
        self._arena: SlotArena | None = None
        self._codec: SlotCodec | None = None
        self._fetcher: Any = None
        self._fast_collate = fast_path_collate(loader)
        self._device = cuda_device(getattr(loader, "device", None))
        self._on_device: Any = None
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
        ctx = loader.multiprocessing_context or multiprocessing.get_context()
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
            self._codec = SlotCodec(self._arena)
            template = dataclasses.replace(
                template, builder=SlotBuilder(self._dataset, self._fast_collate, os.getpid())
            )
        self._engine = Engine(
            ctx=ctx,
            num_workers=self._num_workers,
            max_tasks=self._prefetch_factor * self._num_workers,
            in_order=self._in_order,
            timeout_s=self._timeout,
            restartable=not self._is_iterable,
            make_spec=_SpecFactory(template),
            codec=self._codec,
        )

    def _new_arena(self, loader: TorchDataLoader) -> SlotArena:
        rows, max_tokens = _plan_rows_and_tokens(loader)
        slot_bytes = slot_bytes_bound(
            self._fast_collate,
            self._dataset.fields,
            np.asarray(self._dataset.lengths),
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
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put()

    def _try_put(self) -> None:
        """torch's ``_try_put_index``: one more task, if the sampler has one and a worker is
        active (the index is consumed from the sampler either way)."""
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

    def __next__(self) -> Any:
        if self._sampler_iter is None:
            raise StopIteration
        if self._device is not None:
            if self._on_device is None:
                self._on_device = iter(DevicePrefetcher(_HostBatches(self), self._device))
            data = next(self._on_device)
        else:
            data = self._next_data()
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
        return data

    def _next_data(self) -> Any:
        if self._engine is None:
            if self._num_workers > 0:
                raise StopIteration  # shut down after an error or at the end of the epoch
            data = self._fetcher.fetch(next(self._sampler_iter))
            return pin_tree(data) if self._pin else data
        try:
            status, value = self._engine.get(self._try_put)
        except FastloadError:
            self._shutdown(join_s=0.1)  # a dead or hung worker: this epoch cannot go on
            raise
        if status == DONE:
            if not self._persistent:
                self._shutdown()
            raise StopIteration
        self._try_put()
        if status == FAILED:
            raise value
        return pin_tree(value) if self._pin and self._arena is None else value

    # -- persistent workers and shutdown --------------------------------------------------------
    def _reset(self, loader: TorchDataLoader, first_iter: bool = False) -> None:
        """A new epoch on the same workers (called by ``DataLoader.__iter__``)."""
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._on_device = None
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        if self._engine is None:
            self._start_engine(loader)
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
            self._engine = self._arena = None
            return
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


class _ColumnarFetcher:
    """``num_workers=0`` on the fast path: one ``read_batch`` and the collate, in-process."""

    def __init__(self, dataset: Any, collate: Any) -> None:
        self.dataset = dataset
        self.collate = collate

    def fetch(self, index: Any) -> Any:
        return self.collate(self.dataset.read_batch(np.asarray(index, dtype=np.int64)))


class _HostBatches:
    """The iterator's host-side batches, as an iterable for the device prefetcher."""

    def __init__(self, it: LoaderIterator) -> None:
        self._it = it

    def __iter__(self) -> Any:
        while True:
            try:
                yield self._it._next_data()
            except StopIteration:
                return
