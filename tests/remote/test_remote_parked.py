"""A remote dataset's workers are parked between iterators as a local dataset's are (NOTE [parked
workers] in ``fastload/_engine/_parking.py``): the next epoch, or a new loader over the same
shards and cache, takes them with the shards they hold open; a cache folder replaced in
between, another cache folder or other storage options, and it does not. Against the S3 server, with the
worker processes and the cache on disk, every batch checked against the same loader over the
shards on local disk."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _procs import alive
from _token_files import indexed_token_shards

import fastload
from fastload._engine import _parking

SHARDS = 4
pytestmark = pytest.mark.parked_workers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return indexed_token_shards(tmp_path_factory.mktemp("corpus"), SHARDS, 60, 90)


def _loader(dataset: Any, workers: int = 2) -> fastload.DataLoader:
    return fastload.DataLoader(
        dataset, batch_size=16, length_grouped=True, seed=5, num_workers=workers,
        collate_fn=fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool),
    )  # fmt: skip


def _epoch(loader: fastload.DataLoader) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    it = iter(loader)
    pids = list(it.worker_pids)
    return pids, [{k: v.clone() for k, v in batch.items()} for batch in it]


def _same(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"batch {i}"


def _gets(server: Any) -> int:
    return sum(1 for r in server.requests() if r.method == "GET")


def test_the_next_epoch_and_a_new_loader_take_a_remote_datasets_workers(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    url = s3_server.upload(corpus, bucket)

    def remote() -> fastload.HDF5Dataset:
        return fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path / "cache")

    local = _loader(fastload.HDF5Dataset(sorted(corpus.glob("*.h5"))), workers=0)
    expected = [_epoch(local)[1] for _ in range(2)]  # the local shards' epochs 0 and 1
    loader = _loader(remote())
    first, batches = _epoch(loader)
    _same(batches, expected[0])
    assert _parking.parked() == 1 and all(alive(p) for p in first)
    # The next epoch: the same workers, the same batches as over local shards, and nothing
    # asked of the store (every shard is in the cache, and open in the workers).
    s3_server.proxy.reset()
    second, batches = _epoch(loader)
    assert second == first
    _same(batches, expected[1])
    assert _gets(s3_server) == 0
    stats = loader.stats("epoch")
    assert (stats.downloaded_bytes, stats.cache_misses) == (0, 0) and stats.cache_hits
    # A new loader over a new dataset object, the same shards and cache: the same workers.
    third, batches = _epoch(_loader(remote()))
    assert third == first
    _same(batches, expected[0])


@pytest.mark.parametrize("change", ["the cache folder replaced", "another cache folder", "other storage options"])
def test_a_remote_dataset_read_otherwise_is_not_taken(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, change: str
) -> None:
    url = s3_server.upload(corpus, bucket)
    cache = tmp_path / "cache"

    def remote(folder: Path, **options: Any) -> fastload.HDF5Dataset:
        return fastload.HDF5Dataset(url, storage_options={**s3_server.options, **options}, cache_dir=folder)

    first, expected = _epoch(_loader(remote(cache)))
    assert _parking.parked() == 1
    if change == "the cache folder replaced":
        shutil.rmtree(cache)  # the same path, another folder: its shards fetched again
        cache.mkdir()
    elif change == "another cache folder":
        cache = tmp_path / "other"
    s3_server.proxy.reset()
    options = {"request_timeout": 30.0} if change == "other storage options" else {}
    second, batches = _epoch(_loader(remote(cache, **options)))
    assert not set(second) & set(first)
    _same(batches, expected)
    if "cache" in change:
        assert _gets(s3_server) >= SHARDS  # read through its own cache, fetched into it
    assert _parking.parked() == 2
