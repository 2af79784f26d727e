"""A changing mixture through ``fastload.DataLoader``: exact resume with workers running and
batches prefetched, ``set_proportions`` through a resume, and per-source accounting."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from test_fastpath import _write

N = 600
CUTS = [0, 300, 480, N]  # three sources: rows 0-299, 300-479, 480-599


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixture") / "data.h5"
    _write(path, N)
    with h5py.File(path, "a") as f:
        f.create_dataset("idx", data=np.arange(N, dtype=np.int64))  # which sample a row is
    return path


def _loader(h5: Path, workers: int, **options: Any) -> fastload.DataLoader:
    lengths = fastload.HDF5Dataset(h5).lengths
    parts = [lengths[a:b] for a, b in itertools.pairwise(CUTS)]
    settings: dict[str, Any] = {
        "proportions": [(0, [3, 2, 1]), (10, [1, 1, 2])],
        "batch_size": 8,
        "seed": 4,
        "exhausted": "renormalize",
    }
    settings.update(options)
    sampler = fastload.MixtureBatchSampler(parts, **settings)
    return fastload.DataLoader(
        fastload.HDF5Dataset(h5, fields=["tokens", "idx"]), batch_sampler=sampler, num_workers=workers
    )


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return sorted(batch["idx"].tolist())


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_7th_batch_equals_the_uninterrupted_run(h5: Path, workers: int) -> None:
    full = [_ids(b) for b in _loader(h5, workers)]
    assert sorted(i for b in full for i in b) == list(range(N))
    for stop in range(7, len(full), 7):
        loader = _loader(h5, workers)
        it = iter(loader)
        head = [_ids(next(it)) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = _loader(h5, workers)
        resumed.load_state_dict(state)
        assert head + [_ids(b) for b in resumed] == full, stop


@pytest.mark.parametrize("workers", [0, 2])
def test_set_proportions_through_the_loader_and_a_resume(h5: Path, workers: int) -> None:
    loader = _loader(h5, workers)
    sampler = loader.batch_sampler
    assert isinstance(sampler, fastload.MixtureBatchSampler)
    it = iter(loader)
    [next(it) for _ in range(5)]
    sampler.set_proportions([0, 0, 1], step=12)
    rest = [_ids(b) for b in it]
    assert all(max(b) >= CUTS[2] and min(b) >= CUTS[2] for b in rest[7:12])  # steps 12 .. 16

    loader = _loader(h5, workers)
    it = iter(loader)
    [next(it) for _ in range(5)]
    loader.batch_sampler.set_proportions([0, 0, 1], step=12)  # type: ignore[union-attr]
    head = [_ids(next(it)) for _ in range(3)]
    state = loader.state_dict()
    del it
    resumed = _loader(h5, workers)
    resumed.load_state_dict(state)
    assert head + [_ids(b) for b in resumed] == rest


def test_consumed_counts_the_delivered_batches_not_the_prefetched_ones(h5: Path) -> None:
    loader = _loader(h5, 2)
    lengths = fastload.HDF5Dataset(h5).lengths
    it = iter(loader)
    got = [_ids(next(it)) for _ in range(9)]
    state = loader.state_dict()
    counted = state["sampler"]["mixture"]["consumed"]["epoch"]
    flat = np.array([i for b in got for i in b])
    source = np.searchsorted(CUTS, flat, side="right") - 1
    assert counted["samples"] == np.bincount(source, minlength=3).tolist()
    assert counted["tokens"] == [int(lengths[flat[source == d]].sum()) for d in range(3)]
    stats = loader.stats()
    assert stats.sources is not None
    assert stats.sources["epoch"]["samples"] == counted["samples"]
    del it


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_by_tokens_resumes_exactly_through_the_loader(h5: Path, workers: int) -> None:
    full = [_ids(b) for b in _loader(h5, workers, share="tokens")]
    assert sorted(i for b in full for i in b) == list(range(N))
    for stop in (5, 17):
        loader = _loader(h5, workers, share="tokens")
        it = iter(loader)
        head = [_ids(next(it)) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = _loader(h5, workers, share="tokens")
        resumed.load_state_dict(state)
        assert head + [_ids(b) for b in resumed] == full, stop
