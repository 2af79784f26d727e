"""The loader's record of what a dataset and a collate can do: decided by the Protocols and by
what each attribute holds, never by an attribute's name alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import fastload
from fastload._capabilities import (
    reads_batches,
    resolve,
    resolve_collate,
    resolve_dataset,
    resolve_sampler,
)


class Reader(torch.utils.data.Dataset[Any]):
    process_independent_reads = True

    def __init__(self) -> None:
        self.lengths = np.array([3, 1])
        self.fields = {"ids": fastload.Field("ids", "ragged", np.dtype(np.int32))}

    def __len__(self) -> int:
        return 2

    def read_batch(self, indices: Any) -> dict[str, Any]:
        return {}


class Impostor(torch.utils.data.Dataset[Any]):
    """Attributes named like every dataset capability, none of them of its kind."""

    fields = {"ids": [1, 2]}
    lengths = [3, 1]
    remote = True
    read_batch = "not a method"
    process_independent_reads = "yes"
    reads_in_place = 1
    read_batch_in_place = None
    storage_counts = 0
    prefetch = 2
    willneed = False
    check_mapped = "yes"
    __getitems__ = ("not", "a", "method")


def test_a_reader_has_what_it_declares() -> None:
    found = resolve_dataset(Reader())
    assert found.batch_reader and found.reads_batches and found.process_independent_reads
    assert found.fields is not None and list(found.fields) == ["ids"]
    assert not (found.remote or found.reads_in_place or found.storage_counts or found.willneed)


def test_attributes_named_like_capabilities_but_of_another_kind_are_not_capabilities() -> None:
    found = resolve_dataset(Impostor())
    assert found == type(found)()  # nothing at all


def test_a_pad_collate_has_the_slot_capabilities_and_a_subclass_keeps_what_it_does_not_change() -> None:
    plain = resolve_collate(fastload.PadCollate())
    assert plain.slot_collate and plain.prepare and plain.one_call_builder and plain.takes_spans
    assert plain.process_independent

    class Calls(fastload.PadCollate):
        def __call__(self, batch: Any) -> dict[str, Any]:
            return super().__call__(batch)

    class Writes(fastload.PadCollate):
        def collate_into(self, batch: Any, out: Any) -> None:
            super().collate_into(batch, out)

    assert not resolve_collate(Calls()).slot_collate  # the engine would bypass its __call__
    writes = resolve_collate(Writes())
    assert writes.slot_collate and not writes.prepare and not writes.one_call_builder


def test_the_fast_path_needs_both_halves() -> None:
    assert resolve(Reader(), fastload.PadCollate()).fast_path
    assert not resolve(Impostor(), fastload.PadCollate()).fast_path
    assert not resolve(Reader(), lambda batch: batch).fast_path


def test_a_callable_getitems_is_a_capability_and_a_reader_is_tested_in_one_place() -> None:
    class Gets(Reader):
        def __getitems__(self, indices: list[int]) -> list[Any]:
            return [self[i] for i in indices]

    assert resolve_dataset(Gets()).getitems and not resolve_dataset(Reader()).getitems
    assert reads_batches(Reader()) and not reads_batches(Impostor())


class PlanningSampler:
    """A batch sampler that says all the sampler capabilities."""

    follows_loader_epoch = False
    epoch = 3
    skipped = 2
    batch_size = 8
    max_tokens = 4096

    def upcoming(self) -> list[Any]:
        return []


class SamplerImpostor:
    """Attributes named like the sampler capabilities, none of them of its kind."""

    follows_loader_epoch = "no"
    epoch = "third"
    skipped = [1, 2]
    batch_size = True
    max_tokens = 4096.0
    upcoming = ["next"]


def test_a_sampler_has_what_it_declares_and_an_impostor_nothing() -> None:
    found = resolve_sampler(PlanningSampler())
    assert not found.follows_loader_epoch and found.epoch and found.skipped and found.upcoming
    assert (found.batch_size, found.max_tokens) == (8, 4096)
    impostor = resolve_sampler(SamplerImpostor())
    assert impostor == type(impostor)()  # follows the loader's epochs; says nothing else
    assert resolve_sampler(torch.utils.data.BatchSampler(range(10), 4, False)).batch_size == 4
    assert resolve(Reader(), fastload.PadCollate(), PlanningSampler()).sampler == found


def test_a_collates_rounding_is_in_its_record_and_a_bad_one_says_why() -> None:
    class Rounds(fastload.PadCollate):
        def __init__(self, multiple: Any) -> None:
            super().__init__()
            self.multiple = multiple

        @property
        def pad_to_multiple_of(self) -> Any:
            return self.multiple

    assert resolve_collate(Rounds(8)).pad_to_multiple_of == 8
    assert resolve_collate(Rounds(None)).pad_to_multiple_of is None
    bad = resolve_collate(Rounds("8"))
    assert bad.pad_to_multiple_of is None and bad.rounding_error is not None and "'8'" in bad.rounding_error
class ShardedImpostor(Reader):
    """Shard capabilities by name only: sizes that are not counts, a warning that is a string."""

    shard_sizes = {"a": 1, "b": 1}
    cache_window_warning = "never"


def test_shard_capabilities_are_declared_not_found_by_name() -> None:
    found = resolve_dataset(ShardedImpostor())
    assert found.shard_sizes is None and not found.cache_window_warning
    remote = resolve_dataset(fastload.HDF5Dataset.__new__(fastload.HDF5Dataset))
    assert remote.cache_window_warning


def test_shuffle_shards_over_a_dataset_whose_shard_sizes_are_something_else_says_so() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"shuffle_shards= needs the dataset's shards .* ShardedImpostor has none"):
        fastload.DataLoader(ShardedImpostor(), batch_size=1, length_grouped=True, shuffle_shards=1)
