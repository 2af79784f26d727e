"""DataPipe pipelines load as torch's DataLoader loads them: shuffled with the loader's seed
and sharded across the workers (``sharding_filter``), so each item comes once per epoch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper

import fastload


def _pipe() -> Any:
    return IterableWrapper(range(20)).shuffle().sharding_filter()


def _epochs(cls: Any, epochs: int = 2, **kwargs: Any) -> list[list[int]]:
    generator = torch.Generator()
    generator.manual_seed(7)
    loader = cls(_pipe(), batch_size=3, generator=generator, **kwargs)
    return [[int(x) for batch in loader for x in batch] for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shuffled_sharded_datapipe_gives_torchs_items_once_each(num_workers: int) -> None:
    expected = _epochs(torch.utils.data.DataLoader, num_workers=num_workers)
    got = _epochs(fastload.DataLoader, num_workers=num_workers)
    for epoch, ours in zip(expected, got, strict=True):
        assert sorted(ours) == list(range(20))
        assert ours == epoch  # the same seed, drawn when torch draws it: the same order
    assert got[0] != got[1]  # each epoch reshuffles


def test_persistent_workers_shard_and_reseed_a_datapipe_every_epoch_as_torchs_do() -> None:
    expected = _epochs(torch.utils.data.DataLoader, epochs=3, num_workers=2, persistent_workers=True)
    got = _epochs(fastload.DataLoader, epochs=3, num_workers=2, persistent_workers=True)
    for epoch, ours in zip(expected, got, strict=True):
        assert sorted(ours) == list(range(20))
        assert ours == epoch
