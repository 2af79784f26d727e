"""What a dataset and a collate can do for the engine, decided once by the loader.

The loader resolves the capabilities of its dataset and of its collate here, by ``isinstance``
on the Protocols of :mod:`fastload._protocols` and a check of what each attribute holds, into
one frozen :class:`Capabilities` that it hands to the engine. Nothing below the loader looks at
a user's object by attribute name: a dataset whose own ``fields`` is a dict of lists, or whose
``remote`` is a flag of its own, is simply a dataset without those capabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from fastload._protocols import (
    AdvisesReads,
    BoundedCollate,
    CheckedMapReader,
    CountsSkipped,
    CountsStorage,
    FinishingCollate,
    FollowsLoaderEpoch,
    GetsItems,
    HasShards,
    KeepsEpoch,
    MapsRagged,
    OneCallCollate,
    PlansAhead,
    PrefetchesShards,
    PreparingCollate,
    ProcessIndependentCollate,
    ProcessIndependentReader,
    ReadsInPlace,
    RemoteReader,
    RoundingCollate,
    SaysBatchSize,
    SaysTokenBudget,
    SlotCollate,
    SpanCollate,
    WarnsOfCacheWindow,
)
from fastload._types import Field


@dataclass(frozen=True)
class DatasetCapabilities:
    """What the engine may use of a dataset (see :mod:`fastload._protocols`)."""

    #: ``read_batch``, ``lengths`` and a ``fields`` of :class:`~fastload._types.Field`.
    batch_reader: bool = False
    #: A ``read_batch`` that can be called and ``lengths`` (a reader that may lack ``fields``).
    reads_batches: bool = False
    #: Its ``fields`` where they are fastload's field descriptions, else ``None``.
    fields: Mapping[str, Field] | None = None
    remote: bool = False
    storage_counts: bool = False
    prefetch: bool = False
    willneed: bool = False
    process_independent_reads: bool = False
    reads_in_place: bool = False
    #: ``mapped_ragged()``, with ``reads_in_place``: a one-call build may gather from the map.
    mapped_ragged: bool = False
    #: ``check_mapped()``: whether a file it has memory-mapped has shrunk since (a one-call
    #: build reads the map without calling the dataset, so the engine asks first).
    check_mapped: bool = False
    #: A ``__getitems__`` that can be called: torch's per-sample path reads a batch with it.
    getitems: bool = False
    #: ``shard_sizes`` (samples per shard, for ``shuffle_shards``), else ``None``.
    shard_sizes: Sequence[int] | None = None
    #: ``cache_window_warning(shuffle_shards)``.
    cache_window_warning: bool = False


@dataclass(frozen=True)
class CollateCapabilities:
    """What the engine may use of a collate (see :mod:`fastload._protocols`)."""

    #: ``layout`` and ``collate_into``, which compute what the collate's ``__call__`` returns
    #: (a subclass that overrides ``__call__`` alone is not one: the engine would bypass it).
    slot_collate: bool = False
    #: ``prepare``, which plans what its ``layout`` and ``collate_into`` write (a subclass that
    #: overrides either of those is asked through them instead).
    prepare: bool = False
    one_call_builder: bool = False
    max_layout: bool = False
    takes_spans: bool = False
    process_independent: bool = False
    #: The multiple it pads ragged fields up to (:class:`~fastload._protocols.RoundingCollate`),
    #: ``None`` for none.
    pad_to_multiple_of: int | None = None
    #: Why its ``pad_to_multiple_of`` cannot be used (not a positive int), else ``None``: an
    #: error where a ``max_tokens`` plan needs the multiple.
    rounding_error: str | None = None
    #: The last step of a written batch, run where it lands (``FinishingCollate``), or None.
    finish_batch: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class SamplerCapabilities:
    """What the loader and the engine may use of the index sampler (see
    :mod:`fastload._protocols`)."""

    #: ``False`` for a sampler whose own epoch decides (the loader does not move it).
    follows_loader_epoch: bool = True
    #: An int ``epoch``, read back after ``set_epoch`` and ``load_state_dict``.
    epoch: bool = False
    #: ``upcoming()``: the batches not yet drawn this epoch.
    upcoming: bool = False
    #: An int ``skipped``: samples the plan leaves out.
    skipped: bool = False
    #: The most samples of a batch and the token budget, where the sampler says them.
    batch_size: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class Capabilities:
    """The dataset's and the collate's capabilities, as the loader resolved them."""

    dataset: DatasetCapabilities = DatasetCapabilities()
    collate: CollateCapabilities = CollateCapabilities()
    sampler: SamplerCapabilities = SamplerCapabilities()

    @property
    def fast_path(self) -> bool:
        """Whether the pair can build whole batches straight into slots: a batch reader and a
        slot collate."""
        return self.dataset.batch_reader and self.collate.slot_collate


def _flag(obj: Any, name: str) -> bool:
    """``True`` only where the attribute is the boolean ``True`` (numpy's included)."""
    value = getattr(obj, name, False)
    return isinstance(value, (bool, np.bool_)) and bool(value)


def _int(obj: Any, name: str) -> int | None:
    """The attribute where it is an int (numpy's included; not a bool), else ``None``."""
    try:
        value = getattr(obj, name, None)
    except Exception:  # a property that cannot say
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def has_lengths(dataset: Any) -> bool:
    """Whether ``dataset`` has ``lengths`` (tokens per sample), which a plan of its batches by
    length needs (an explicit option's requirement, not a capability)."""
    return _has(dataset, "lengths")


def reads_batches(dataset: Any) -> bool:
    """Whether ``dataset`` reads batches: a ``read_batch`` that can be called, and ``lengths``.
    The one test of it (a :class:`~fastload._protocols.BatchReader` has ``fields`` too)."""
    if isinstance(dataset, IterableDataset):
        return False
    try:
        return callable(getattr(dataset, "read_batch", None)) and _has(dataset, "lengths")
    except Exception:  # a property that cannot say
        return False


def dataset_fields(dataset: Any) -> Mapping[str, Field] | None:
    """``dataset.fields`` where it is a mapping of names to :class:`~fastload._types.Field`
    (fastload's readers'), else ``None`` (a dataset's own attribute of that name)."""
    try:
        fields = getattr(dataset, "fields", None)
    except Exception:  # a property that cannot say (a wrapper whose dataset has none)
        return None
    if not isinstance(fields, Mapping) or not all(isinstance(f, Field) for f in fields.values()):
        return None
    return fields


def resolve_dataset(dataset: Any) -> DatasetCapabilities:
    """The capabilities of ``dataset`` (see the module text)."""
    if isinstance(dataset, IterableDataset):
        return DatasetCapabilities()
    fields = dataset_fields(dataset)
    batches = reads_batches(dataset)
    # BatchReader's members, ``__len__`` aside: a reader driven by a batch sampler needs none.
    reader = batches and fields is not None
    in_place = (
        reader
        and isinstance(dataset, ReadsInPlace)
        and _flag(dataset, "reads_in_place")
        and callable(dataset.read_batch_in_place)
    )
    return DatasetCapabilities(
        batch_reader=reader,
        reads_batches=batches,
        fields=fields,
        remote=isinstance(dataset, RemoteReader) and _flag(dataset, "remote") and callable(dataset.storage_counts),
        storage_counts=isinstance(dataset, CountsStorage) and callable(dataset.storage_counts),
        prefetch=isinstance(dataset, PrefetchesShards) and callable(dataset.prefetch),
        willneed=isinstance(dataset, AdvisesReads) and callable(dataset.willneed),
        process_independent_reads=reader and isinstance(dataset, ProcessIndependentReader)
        and _flag(dataset, "process_independent_reads"),
        reads_in_place=in_place,
        mapped_ragged=in_place and isinstance(dataset, MapsRagged) and callable(dataset.mapped_ragged),
        check_mapped=isinstance(dataset, CheckedMapReader) and callable(dataset.check_mapped),
        getitems=isinstance(dataset, GetsItems) and callable(dataset.__getitems__),
        shard_sizes=_shard_sizes(dataset),
        cache_window_warning=isinstance(dataset, WarnsOfCacheWindow) and callable(dataset.cache_window_warning),
    )


def _shard_sizes(dataset: Any) -> Sequence[int] | None:
    """``dataset.shard_sizes`` where it is a sequence of sample counts, else ``None``."""
    if not isinstance(dataset, HasShards):
        return None
    sizes = dataset.shard_sizes
    if not isinstance(sizes, (Sequence, np.ndarray)) or not all(isinstance(n, (int, np.integer)) for n in sizes):
        return None
    return sizes


def resolve_collate(collate: Any) -> CollateCapabilities:
    """The capabilities of ``collate`` (see the module text and :class:`CollateCapabilities`)."""
    multiple, rounding_error = _rounding(collate)
    if not (
        isinstance(collate, SlotCollate) and callable(collate.layout) and callable(collate.collate_into)
    ):
        return CollateCapabilities(pad_to_multiple_of=multiple, rounding_error=rounding_error)
    cls = type(collate)
    slot = _below(cls, "layout", "__call__") and _below(cls, "collate_into", "__call__")
    prepare = (
        isinstance(collate, PreparingCollate)
        and callable(collate.prepare)
        and _below(cls, "prepare", "layout")
        and _below(cls, "prepare", "collate_into")
    )
    return CollateCapabilities(
        slot_collate=slot,
        prepare=prepare,
        # A one-call build writes what ``prepare`` plans: only where that is what counts.
        one_call_builder=prepare and isinstance(collate, OneCallCollate) and callable(collate.one_call_builder),
        max_layout=isinstance(collate, BoundedCollate) and callable(collate.max_layout),
        takes_spans=isinstance(collate, SpanCollate) and _flag(collate, "takes_spans"),
        process_independent=isinstance(collate, ProcessIndependentCollate) and _flag(collate, "process_independent"),
        pad_to_multiple_of=multiple,
        rounding_error=rounding_error,
        finish_batch=(
            collate.finish_batch
            if isinstance(collate, FinishingCollate) and _flag(collate, "device_labels") and callable(collate.finish_batch)
            else None
        ),
    )


def _rounding(collate: Any) -> tuple[int | None, str | None]:
    """The multiple a :class:`~fastload._protocols.RoundingCollate` pads up to (``None`` for
    none), or why what it holds is not one."""
    if not isinstance(collate, RoundingCollate):
        return None, None
    multiple = collate.pad_to_multiple_of
    if multiple is None:
        return None, None
    if isinstance(multiple, (bool, np.bool_)) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        return None, (
            f"collate_fn {type(collate).__name__}.pad_to_multiple_of must be a positive int or "
            f"None (the multiple it rounds padded lengths up to); got {multiple!r}"
        )
    return (int(multiple) if multiple > 1 else None), None


def resolve_sampler(sampler: Any) -> SamplerCapabilities:
    """The capabilities of the index ``sampler`` (see :class:`SamplerCapabilities`)."""
    follows = not isinstance(sampler, FollowsLoaderEpoch) or _said(sampler, "follows_loader_epoch", True)
    return SamplerCapabilities(
        follows_loader_epoch=follows,
        epoch=isinstance(sampler, KeepsEpoch) and _int(sampler, "epoch") is not None,
        upcoming=isinstance(sampler, PlansAhead) and callable(sampler.upcoming),
        skipped=isinstance(sampler, CountsSkipped) and _int(sampler, "skipped") is not None,
        batch_size=_int(sampler, "batch_size") if isinstance(sampler, SaysBatchSize) else None,
        max_tokens=_int(sampler, "max_tokens") if isinstance(sampler, SaysTokenBudget) else None,
    )


def _said(obj: Any, name: str, default: bool) -> bool:
    """The attribute where it is a boolean (numpy's included), else ``default``."""
    value = getattr(obj, name, default)
    return bool(value) if isinstance(value, (bool, np.bool_)) else default


def resolve(dataset: Any, collate: Any, sampler: Any = None) -> Capabilities:
    """The capabilities of the pair the engine reads and collates with, and of the index
    sampler that plans their batches."""
    return Capabilities(resolve_dataset(dataset), resolve_collate(collate), resolve_sampler(sampler))


def _has(obj: Any, name: str) -> bool:
    try:
        return getattr(obj, name, None) is not None
    except Exception:
        return False


def _below(cls: type, method: str, other: str) -> bool:
    """Whether ``cls`` takes ``method`` from the class that defines its ``other``, or from a
    subclass of it: an ``other`` overridden below ``method`` is a change ``method`` knows
    nothing of. A class that defines neither (an instance attribute) counts as consistent."""
    owner, other_owner = _owner(cls, method), _owner(cls, other)
    if owner is None or other_owner is None or other_owner is object:
        return True
    return issubclass(owner, other_owner)


def _owner(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


__all__ = [
    "Capabilities",
    "CollateCapabilities",
    "DatasetCapabilities",
    "SamplerCapabilities",
    "dataset_fields",
    "has_lengths",
    "reads_batches",
    "resolve",
    "resolve_collate",
    "resolve_dataset",
    "resolve_sampler",
]
