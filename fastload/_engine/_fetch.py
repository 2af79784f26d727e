"""Turning a sampler's index into a batch, exactly as torch's DataLoader does, in a worker or in
the main process (``num_workers=0``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from fastload._capabilities import Capabilities, DatasetCapabilities, resolve, resolve_dataset
from fastload._types import Counts


class MapFetcher:
    """Map-style dataset: ``__getitems__`` for a whole batch when the dataset has one, else one
    ``dataset[i]`` per index; ``collate_fn`` on the result. Without auto-collation (``batch_size
    =None``) the index is a single key."""

    #: What the last batch holds: only the fast path's collate says (:class:`ColumnarFetcher`).
    last_counts: Counts | None = None

    def __init__(
        self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any], getitems: bool = False
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        # ``getitems``: a callable ``__getitems__``, as the loader resolved (fastload._capabilities).
        self._getitems = dataset.__getitems__ if getitems else None

    def fetch(self, index: Any) -> Any:
        if not self.auto_collation:
            return self.collate_fn(self.dataset[index])
        if self._getitems is not None:
            return self.collate_fn(self._getitems(index))
        return self.collate_fn([self.dataset[i] for i in index])


class IterableFetcher:
    """Iterable dataset: each fetch takes as many items as the index has entries (or one item
    without auto-collation). Raises ``StopIteration`` once the iterator is exhausted, and for a
    short last batch when ``drop_last`` is set."""

    last_counts: Counts | None = None  # see MapFetcher

    def __init__(
        self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any], drop_last: bool
    ) -> None:
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._it: Iterator[Any] = iter(dataset)
        self._ended = False

    def fetch(self, index: Any) -> Any:
        if self._ended:
            raise StopIteration
        if not self.auto_collation:
            return self.collate_fn(next(self._it))
        items = []
        for _ in index:
            try:
                items.append(next(self._it))
            except StopIteration:
                self._ended = True
                break
        if not items or (self.drop_last and len(items) < len(index)):
            raise StopIteration
        return self.collate_fn(items)


def make_fetcher(
    dataset: Any,
    auto_collation: bool,
    collate_fn: Callable[[Any], Any],
    drop_last: bool,
    capabilities: DatasetCapabilities | None = None,
) -> MapFetcher | IterableFetcher:
    if isinstance(dataset, IterableDataset):
        return IterableFetcher(dataset, auto_collation, collate_fn, drop_last)
    getitems = (resolve_dataset(dataset) if capabilities is None else capabilities).getitems
    return MapFetcher(dataset, auto_collation, collate_fn, getitems)


class ColumnarFetcher:
    """The fast path in the calling process: one ``read_batch``, then the slot collate writes
    the batch into new arrays as a worker writes it into a slot (``fastload._protocols``): the
    same arrays, in the same order, then the object fields."""

    def __init__(self, dataset: Any, collate: Any, capabilities: Capabilities | None = None) -> None:
        self.dataset = dataset
        self.collate = collate
        self._prepares = (resolve(dataset, collate) if capabilities is None else capabilities).collate.prepare
        #: What the last batch holds, where the collate says (``prepare``'s counts).
        self.last_counts: Counts | None = None

    def fetch(self, index: Any) -> dict[str, Any]:
        columnar = self.dataset.read_batch(np.asarray(index, dtype=np.int64))
        prepared = self.collate.prepare(columnar) if self._prepares else None
        self.last_counts = prepared.counts if prepared is not None else None
        layout = prepared.layout if prepared is not None else self.collate.layout(columnar)
        arrays = {name: np.empty(shape, dtype) for name, (shape, dtype) in layout.items()}
        if prepared is not None:
            prepared.fill(arrays)
        else:
            self.collate.collate_into(columnar, arrays)
        batch: dict[str, Any] = {name: torch.from_numpy(array) for name, array in arrays.items()}
        batch.update({k: v for k, v in columnar.items() if isinstance(v, list)})
        return batch


def in_process_fetcher(
    dataset: Any,
    collate_fn: Callable[[Any], Any],
    *,
    auto_collation: bool,
    drop_last: bool,
    fast: bool,
    capabilities: Capabilities | None = None,
) -> ColumnarFetcher | MapFetcher | IterableFetcher:
    """What builds the batches of a loader with ``num_workers=0``: the fast path's columnar
    read where it applies (``fast``), else torch's per-sample fetch."""
    if fast:
        return ColumnarFetcher(dataset, collate_fn, capabilities)
    return make_fetcher(dataset, auto_collation, collate_fn, drop_last, None if capabilities is None else capabilities.dataset)
