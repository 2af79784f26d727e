"""What the engine needs from a dataset and from a collate to take the fast path, in one place.

The fast path builds whole batches straight into shared-memory slots. It applies to a map-style
dataset that is a :class:`BatchReader` and a collate that is a :class:`SlotCollate`; fastload's
readers and :class:`~fastload.PadCollate` implement them, and a user's own classes may too, with
no base class (see the README). Everything else the engine can use is an optional
*capability*, absent by default, so a class offers only what it can keep. The loader resolves
them once (``fastload._capabilities``): each is a Protocol below, and counts only where the
attribute is of the kind it declares.

Reader capabilities

* ``process_independent_reads: bool`` — ``read_batch`` of the same indices gives the same bytes
  in any process. With a collate that says the same of itself, a batch is the same whichever
  worker builds it, so the engine places each task on the worker that will have it ready in
  time instead of round-robin (NOTE [tasks placed in time] in ``_engine/_engine.py``). A reader
  that reads through per-process state (a ``worker_init_fn`` that changes it, a random
  augmentation) must not say so. With a ``worker_init_fn`` the tasks go round-robin, as torch's.
* ``reads_in_place: bool`` and ``read_batch_in_place(indices)`` (:class:`InPlaceReader`) — the
  same samples as ``read_batch``, but a memory-mapped ragged field may come back as
  :class:`~fastload._types.Spans` over the map, which the padding gathers from without a copy.
  Only where it reads exactly what ``read_batch`` reads (a subclass that overrides
  ``read_batch`` alone must see it called).
* ``mapped_ragged()`` (:class:`MappedReader`) — for a dataset of one ragged field whose values
  and int64 offsets lie in a memory map: ``(field, values, offsets)``, else ``None``. With it a
  collate may build a batch in one native call (:meth:`SlotCollate.one_call_builder`).
* ``check_mapped()`` — raise an error when a file the dataset reads through a memory map has
  shrunk since it was mapped (a truncated file: reading the map would kill the process with
  SIGBUS). The engine calls it before each one-call build, which reads the map directly.
* ``willneed(indices)`` — tell the kernel that the samples ``indices`` will be read soon
  (returns the bytes advised). With ``DataLoader(readahead=True)`` each worker calls it for the
  tasks queued behind the one it builds; an error it raises is ignored (the read reports it).
* ``storage_counts()`` — for a dataset read from remote storage, a
  :class:`~fastload._types.StorageCounts` of this process's reads so far (seconds blocked on
  downloads, bytes downloaded, cache hits and misses), or ``None``. Workers report its change
  with each batch, so that ``loader.stats()`` can tell when the storage is the bottleneck.

Collate capabilities

* ``process_independent: bool`` — the output is a function of the columnar batch alone.
* ``takes_spans: bool`` — a ragged column may come as :class:`~fastload._types.Spans` (left in
  a reader's memory map, from ``read_batch_in_place``) instead of
  :class:`~fastload._types.Ragged`; without it the engine reads with ``read_batch``.
* ``prepare(batch)`` — plans the batch once for both halves of the zero-copy path
  (:class:`PreparedBatch`: its ``layout``, ``fill(out)`` and ``counts``); without it the engine
  calls ``layout`` and ``collate_into``, and counts only the rows.
* ``one_call_builder(reader)`` — a :class:`OneCallBuilder` for this reader's batches, or
  ``None``.
* ``max_layout(reader)`` — the largest layout any batch of this reader can have (every array
  at its largest), or ``None`` where the collate cannot tell from the reader alone. A collate
  whose batches have a fixed shape (packing) says so, and the slots are sized exactly from it
  instead of from the sampler's batch size and the longest sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from fastload._types import Column, ColumnarBatch, Counts, Field, Spans

#: Output name → (shape, numpy dtype) of every array a collate writes for one batch.
Layout = dict[str, tuple[tuple[int, ...], np.dtype]]

#: Every array of a batch in a slot starts this many bytes apart from the slot's start, or a
#: multiple of it (a cache line; any dtype's alignment), in the order of its layout.
ALIGN = 64


@runtime_checkable
class BatchReader(Protocol):
    """What the fast path needs of a dataset.

    Contract: ``read_batch`` accepts indices in any order, duplicates included, and returns the
    samples in that order as a columnar batch (see :mod:`fastload._types`); ``lengths[i]`` is
    the length of sample ``i`` of the field that drives length grouping, available without
    reading any payload; ``fields`` describes every field ``read_batch`` returns.
    """

    @property
    def lengths(self) -> npt.NDArray[np.int64]: ...

    @property
    def fields(self) -> dict[str, Field]: ...

    def __len__(self) -> int: ...

    def read_batch(self, indices: npt.ArrayLike) -> ColumnarBatch: ...


class InPlaceReader(BatchReader, Protocol):
    """A reader that can leave memory-mapped samples where they lie (see the module text)."""

    reads_in_place: bool

    def read_batch_in_place(self, indices: npt.ArrayLike) -> Mapping[str, Column | Spans]: ...


class MappedReader(BatchReader, Protocol):
    """A reader of one ragged field held whole in a memory map (see the module text)."""

    def mapped_ragged(self) -> tuple[str, np.ndarray, np.ndarray] | None: ...


@runtime_checkable
class CheckedMapReader(Protocol):
    """A reader that can tell when a file it has memory-mapped has shrunk (see the module
    text): the engine asks before each one-call build, which reads the map directly."""

    def check_mapped(self) -> None: ...


class PreparedBatch(Protocol):
    """One batch as a collate planned it: the arrays it needs, and how to fill them."""

    @property
    def layout(self) -> Layout: ...

    @property
    def counts(self) -> Counts: ...

    def fill(self, out: Mapping[str, np.ndarray]) -> None:
        """Fill ``out``, arrays made exactly as :attr:`layout` says (not checked again)."""


class Built(NamedTuple):
    """A batch a :class:`OneCallBuilder` wrote: each array as ``(name, byte offset from the
    slot's start, shape, dtype string)``, laid out as the collate's layout (every offset a
    multiple of :data:`ALIGN`), the bytes used, and its counts."""

    arrays: tuple[tuple[str, int, tuple[int, ...], str], ...]
    nbytes: int
    counts: Counts


class TooLarge(NamedTuple):
    """The batch needs ``nbytes``, more than the buffer offered it."""

    nbytes: int


class OneCallBuilder(Protocol):
    """Builds a batch in one call from its sample indices straight into a buffer."""

    #: Seconds the last build spent (all of it reads the map).
    last_s: float

    def build_into(
        self, indices: bytes, buffer: np.ndarray, offset: int, capacity: int
    ) -> Built | TooLarge | None:
        """Build the batch of ``indices`` (int64, native order) into ``buffer[offset :
        offset + capacity]``: what was written, :class:`TooLarge`, or ``None`` where this
        batch cannot be built in one call (an index out of range: the general path says what
        is wrong)."""


@runtime_checkable
class SlotCollate(Protocol):
    """What the fast path needs of a collate: the arrays a batch needs, without allocating
    them, and a way to write the batch into arrays it is given (views of a batch slot)."""

    def layout(self, batch: Mapping[str, Any]) -> Layout: ...

    def collate_into(self, batch: Mapping[str, Any], out: Mapping[str, np.ndarray]) -> None: ...


# -- capabilities resolved once by the loader (fastload._capabilities) -------------------------
# Each optional capability below is a Protocol of one member, checked with ``isinstance`` and
# then by the kind of what it holds: a user's object whose same-named attribute is something
# else (a ``fields`` of lists, a ``remote`` flag on a plain dataset) does not have it.


@runtime_checkable
class RemoteReader(Protocol):
    """A dataset read from remote storage through fastload's node cache."""

    #: ``True`` where the shards are remote: its workers are forked from a fresh fork server
    #: (pyarrow's S3 client cannot be made again in a forked child of a process that used it).
    remote: bool

    def storage_counts(self) -> Any:
        """This process's reads so far (a :class:`~fastload._types.StorageCounts`), or ``None``
        for a dataset read from local files (see the module text)."""


@runtime_checkable
class CountsStorage(Protocol):
    """A dataset that counts what its reads of remote storage cost (see the module text)."""

    def storage_counts(self) -> Any:
        """A :class:`~fastload._types.StorageCounts` of this process's reads, or ``None``."""


@runtime_checkable
class PrefetchesShards(Protocol):
    """A remote dataset that can bring the shards of the coming batches to the local cache."""

    def prefetch(self, batches: Any, consumed: Any, **options: Any) -> Any:
        """Start bringing the shards of ``batches`` (the plan from the next batch on; the
        consumer's progress is ``consumed()``) to the cache; a prefetcher with ``close()``, or
        ``None``."""


@runtime_checkable
class HasShards(Protocol):
    """A dataset stored as shards, for ``shuffle_shards=K`` (windows of K shards)."""

    #: Samples per shard, in the order the dataset numbers its samples.
    shard_sizes: Sequence[int]


@runtime_checkable
class WarnsOfCacheWindow(Protocol):
    """A dataset read through a bounded cache, which can say when a shard window will not fit."""

    def cache_window_warning(self, shuffle_shards: int) -> str | None:
        """Why a window of ``shuffle_shards`` shards leaves the cache no room to fetch ahead, or
        ``None``."""


@runtime_checkable
class ShardPrefetch(Protocol):
    """What a :class:`PrefetchesShards` dataset's ``prefetch`` returns, as the loader counts it."""

    def close(self) -> None:
        """Stop fetching ahead (downloads in flight may finish)."""

    def downloaded_bytes(self) -> int:
        """Bytes it downloaded so far (counted in ``loader.stats()``)."""


@runtime_checkable
class MapsRagged(Protocol):
    """A dataset of one ragged field held whole in a memory map (:class:`MappedReader`)."""

    def mapped_ragged(self) -> tuple[str, np.ndarray, np.ndarray] | None: ...


@runtime_checkable
class AdvisesReads(Protocol):
    """A dataset that can tell the kernel which samples it will read soon (``readahead``)."""

    def willneed(self, indices: npt.ArrayLike) -> int:
        """Advise the byte ranges of the samples ``indices``; the bytes advised."""


@runtime_checkable
class ProcessIndependentReader(Protocol):
    """A dataset whose ``read_batch`` gives the same bytes in any process (see the module
    text): any worker may build any of its batches."""

    process_independent_reads: bool


@runtime_checkable
class ReadsInPlace(Protocol):
    """A dataset that can leave memory-mapped samples where they lie (:class:`InPlaceReader`)."""

    reads_in_place: bool

    def read_batch_in_place(self, indices: npt.ArrayLike) -> Mapping[str, Column | Spans]: ...


@runtime_checkable
class PreparingCollate(Protocol):
    """A slot collate that plans a batch once for both halves of the zero-copy path."""

    def prepare(self, batch: Mapping[str, Any]) -> PreparedBatch:
        """The batch planned once (:class:`PreparedBatch`)."""


@runtime_checkable
class OneCallCollate(Protocol):
    """A slot collate that may build a reader's batches in one native call."""

    def one_call_builder(self, reader: Any) -> OneCallBuilder | None:
        """A :class:`OneCallBuilder` for ``reader``'s batches, or ``None``."""


@runtime_checkable
class BoundedCollate(Protocol):
    """A slot collate that can tell the largest layout of any batch of a reader."""

    def max_layout(self, reader: Any) -> Layout | None:
        """The largest layout any batch of ``reader`` can have, or ``None``."""


@runtime_checkable
class SpanCollate(Protocol):
    """A slot collate that takes ragged columns as :class:`~fastload._types.Spans`."""

    takes_spans: bool


@runtime_checkable
class FinishingCollate(Protocol):
    """A slot collate whose written batches take a last step where they land: on the device
    after the copy (``device="cuda"``), else on the host (``PackCollate(device_labels=True)``
    builds its labels there). ``device_labels`` says whether it needs the step."""

    device_labels: bool

    def finish_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch as the collate's ``__call__`` returns it, from the arrays it wrote, with
        torch operations on the batch's own device."""


@runtime_checkable
class ProcessIndependentCollate(Protocol):
    """A slot collate whose output is a function of the columnar batch alone."""

    process_independent: bool
@runtime_checkable
class RoundingCollate(Protocol):
    """A collate that pads each batch's ragged fields to the batch's longest row rounded up to
    a multiple. The loader passes the multiple to a ``max_tokens`` plan, which then counts
    ``rows * round_up(longest, multiple)`` against the budget: the shape the collate builds.
    ``None`` or 1 means no rounding (Hugging Face's padding collators name it the same way)."""

    @property
    def pad_to_multiple_of(self) -> int | None: ...



@runtime_checkable
class GetsItems(Protocol):
    """A map-style dataset that reads a batch of samples in one call, as torch's DataLoader
    uses it: the engine's per-sample path calls it instead of ``dataset[i]`` for each index."""

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        """The samples of ``indices``, in their order."""


# -- sampler capabilities ------------------------------------------------------------------------
# What the loader may use of its index sampler, resolved once with the dataset's and the
# collate's (``fastload._capabilities.SamplerCapabilities``).


@runtime_checkable
class FollowsLoaderEpoch(Protocol):
    """A sampler that says whether the loader moves its epochs: ``False`` for one whose own
    epoch decides (a ``DistributedSampler``'s ``set_epoch`` the user calls), as with torch's
    loader; a sampler without it follows the loader's."""

    follows_loader_epoch: bool


@runtime_checkable
class KeepsEpoch(Protocol):
    """A sampler whose ``epoch`` is the epoch it plans; the loader reads it back after
    ``set_epoch`` and ``load_state_dict`` (a loaded state may name another epoch)."""

    epoch: int


@runtime_checkable
class PlansAhead(Protocol):
    """A sampler that knows its epoch's batches before they are drawn: a remote dataset's
    shards are brought to the cache in that order."""

    def upcoming(self) -> Any:
        """The batches not yet drawn this epoch, in order (each an index array)."""


@runtime_checkable
class CountsSkipped(Protocol):
    """A sampler that leaves samples out of its plan (too long to pack): ``stats()`` reports
    how many."""

    skipped: int


@runtime_checkable
class SaysBatchSize(Protocol):
    """A batch sampler whose batches hold at most ``batch_size`` samples: the fast path sizes
    its shared-memory slots from it."""

    batch_size: int


@runtime_checkable
class SaysTokenBudget(Protocol):
    """A batch sampler whose batches hold at most ``max_tokens`` tokens: the fast path sizes
    its shared-memory slots from it."""

    max_tokens: int


__all__ = [
    "ALIGN",
    "AdvisesReads",
    "BatchReader",
    "BoundedCollate",
    "Built",
    "CheckedMapReader",
    "CountsSkipped",
    "CountsStorage",
    "FinishingCollate",
    "FollowsLoaderEpoch",
    "GetsItems",
    "InPlaceReader",
    "KeepsEpoch",
    "Layout",
    "MappedReader",
    "MapsRagged",
    "OneCallBuilder",
    "OneCallCollate",
    "PlansAhead",
    "PrefetchesShards",
    "PreparedBatch",
    "PreparingCollate",
    "ProcessIndependentCollate",
    "ProcessIndependentReader",
    "ReadsInPlace",
    "RemoteReader",
    "RoundingCollate",
    "SaysBatchSize",
    "SaysTokenBudget",
    "SlotCollate",
    "SpanCollate",
    "TooLarge",
]
