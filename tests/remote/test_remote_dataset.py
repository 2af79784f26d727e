"""Remote datasets on a real S3-compatible server (moto, behind the logging fault proxy): the
same API and the same samples as the shards on local disk, the index read once per node, each
shard downloaded once per node however many workers and loaders read it, identical batches
under injected faults, and clear errors."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from _servers import Faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import indexed_token_shards

import fastload
from fastload._formats._indexing import build_index, write_index
from fastload._remote import INDEX_NAME
from fastload.errors import DataFileNotFoundError, FieldNotFoundError, StoragePermissionError

SHARDS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four HDF5 shards of token sequences and their index, on local disk."""
    return indexed_token_shards(tmp_path_factory.mktemp("corpus"), SHARDS, 150, 400, label=True)


def shard_gets(server: Any) -> Counter[str]:
    """Complete downloads per shard: GETs of a shard whose range starts at byte 0 (a shard
    smaller than one part is one GET)."""
    return Counter(
        r.path.rsplit("/", 1)[-1]
        for r in server.requests()
        if r.method == "GET" and r.path.endswith(".h5") and (r.range or "bytes=0-").startswith("bytes=0-")
    )


def index_requests(server: Any) -> int:
    return sum(1 for r in server.requests() if r.path.endswith(INDEX_NAME) and r.method == "GET")


def owned(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_same_api_and_samples_as_local_disk_and_no_shard_read_to_plan(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    url = s3_server.upload(corpus, bucket)
    local = fastload.HDF5Dataset(sorted(corpus.glob("*.h5")))
    s3_server.proxy.reset()
    remote = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path / "cache")
    assert (len(remote), remote.fields, remote.length_field) == (len(local), local.fields, local.length_field)
    assert np.array_equal(remote.lengths, local.lengths)
    assert remote.files == [f"{url}part-{s:05d}.h5" for s in range(SHARDS)]
    assert index_requests(s3_server) == 1 and not shard_gets(s3_server)  # planned from the index
    indices = np.random.default_rng(0).permutation(len(local))[:300]
    got, expected = remote.read_batch(indices), local.read_batch(indices)
    for name in expected:
        a, b = got[name], expected[name]
        assert (np.array_equal(a.values, b.values) and np.array_equal(a.lengths, b.lengths)) if hasattr(a, "values") else np.array_equal(a, b)
    assert sorted(shard_gets(s3_server).values()) == [1] * SHARDS


def test_workers_and_two_loaders_on_a_node_download_each_shard_once(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    url = s3_server.upload(corpus, bucket)
    local = fastload.HDF5Dataset(sorted(corpus.glob("*.h5")))
    s3_server.proxy.reset()
    cache = tmp_path / "node-cache"
    runs = []
    for rank in range(2):  # two loaders standing for two ranks on one node, 2 workers each
        remote = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=cache)
        sampler = fastload.LengthGroupedBatchSampler(remote.lengths, max_tokens=2048, num_replicas=2, rank=rank, seed=4)
        loader = fastload.DataLoader(remote, batch_sampler=sampler, num_workers=2)
        runs.append([owned(b) for b in loader])
    assert index_requests(s3_server) == 1
    assert sorted(shard_gets(s3_server).values()) == [1] * SHARDS
    for rank in range(2):  # the same batches as the shards on local disk
        sampler = fastload.LengthGroupedBatchSampler(local.lengths, max_tokens=2048, num_replicas=2, rank=rank, seed=4)
        expected = list(fastload.DataLoader(local, batch_sampler=sampler, num_workers=0))
        assert len(expected) == len(runs[rank])
        for a, b in zip(runs[rank], expected, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)


def test_identical_batches_with_five_percent_injected_faults(
    faulty_s3: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    url = faulty_s3.upload(corpus, bucket)
    clean = fastload.DataLoader(
        fastload.HDF5Dataset(url, storage_options=faulty_s3.options, cache_dir=tmp_path / "a"),
        max_tokens=4096, num_workers=2, seed=1,
    )  # fmt: skip
    expected = [owned(b) for b in clean]
    faulty_s3.set_faults(Faults(error_rate=0.05, drop_rate=0.05, seed=3))
    faulted = fastload.DataLoader(
        fastload.HDF5Dataset(url, storage_options=faulty_s3.options, cache_dir=tmp_path / "b"),
        max_tokens=4096, num_workers=2, seed=1,
    )  # fmt: skip
    got = [owned(b) for b in faulted]
    assert any(r.fault for r in faulty_s3.requests())  # faults did happen
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_glob_selects_shards_from_the_index(s3_server: Any, bucket: str, corpus: Path, tmp_path: Path) -> None:
    url = s3_server.upload(corpus, bucket)
    two = fastload.HDF5Dataset(url + "part-0000[13].h5", storage_options=s3_server.options, cache_dir=tmp_path)
    local = fastload.HDF5Dataset([corpus / "part-00001.h5", corpus / "part-00003.h5"])
    assert len(two) == len(local) and np.array_equal(two.lengths, local.lengths)
    assert np.array_equal(two.read_batch([0, 299])["tokens"].values, local.read_batch([0, 299])["tokens"].values)
    with pytest.raises(DataFileNotFoundError, match=r"no shard of the index .* matches 'x\*\.h5'"):
        fastload.HDF5Dataset(url + "x*.h5", storage_options=s3_server.options, cache_dir=tmp_path)


def test_arrow_shards_too(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    folder = tmp_path / "arrow"
    folder.mkdir()
    table = pa.table({"ids": [[1, 2, 3], [4], [5, 6]] * 20, "label": list(range(60))})
    for shard in range(2):
        with pa.OSFile(str(folder / f"s{shard}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)
    write_index(folder, build_index(folder))
    url = s3_server.upload(folder, bucket, "arrow")
    remote = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path / "c")
    local = fastload.ArrowDataset(sorted(folder.glob("*.arrow")))
    assert len(remote) == 120 and np.array_equal(remote.lengths, local.lengths)
    got = remote.read_batch([0, 61, 119])
    assert got["label"].tolist() == [0, 1, 59]
    assert np.array_equal(got["ids"].values, local.read_batch([0, 61, 119])["ids"].values)
    with pytest.raises(FieldNotFoundError, match=r"no field 'nope'; the shards hold ids, label"):
        fastload.ArrowDataset(url, fields=["nope"], storage_options=s3_server.options, cache_dir=tmp_path / "c")


def test_clear_errors(s3_server: Any, bucket: str, corpus: Path, tmp_path: Path) -> None:
    url = s3_server.upload(corpus, bucket)
    with pytest.raises(ValueError, match=r"indexes hdf5 shards; read them with HDF5Dataset"):
        fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    wrong = {**s3_server.options, "access_key": s3_server.credentials.access_key, "secret_key": "not-the-secret"}
    with pytest.raises(StoragePermissionError, match=rf"s3://{bucket}/corpus/"):
        fastload.HDF5Dataset(url, storage_options=wrong, cache_dir=tmp_path / "other")
    with pytest.raises(ValueError, match=r"storage_options apply to remote datasets"):
        fastload.HDF5Dataset(corpus / "part-00000.h5", storage_options={})  # type: ignore[arg-type]


def epochs_of(loader: fastload.DataLoader, epochs: int) -> list[list[dict[str, Any]]]:
    return [[owned(b) for b in loader] for _ in range(epochs)]


def test_a_full_cache_downloads_nothing_in_epoch_two(s3_server: Any, bucket: str, corpus: Path, tmp_path: Path) -> None:
    url = s3_server.upload(corpus, bucket)
    remote = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    loader = fastload.DataLoader(remote, max_tokens=2048, num_workers=2, seed=2)
    s3_server.proxy.reset()
    first = [owned(b) for b in loader]
    assert sorted(shard_gets(s3_server).values()) == [1] * SHARDS  # the prefetcher or a worker
    s3_server.proxy.reset()
    second = [owned(b) for b in loader]
    assert not [r for r in s3_server.requests() if r.method == "GET"]
    assert len(first) == len(second)


@pytest.mark.parametrize("limit_share", [1.0, 0.25])
def test_a_small_cache_with_shard_windows_gives_the_local_batches(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, limit_share: float
) -> None:
    url = s3_server.upload(corpus, bucket)
    total = sum(p.stat().st_size for p in corpus.glob("*.h5"))
    local = fastload.HDF5Dataset(sorted(corpus.glob("*.h5")))
    expected = epochs_of(fastload.DataLoader(local, max_tokens=2048, shuffle_shards=1, seed=5), 2)
    remote = fastload.HDF5Dataset(
        url, storage_options=s3_server.options, cache_dir=tmp_path, cache_limit=int(total * limit_share)
    )
    s3_server.proxy.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = fastload.DataLoader(remote, max_tokens=2048, shuffle_shards=1, seed=5, num_workers=2)
    # a quarter of the data is one shard: too small to hold the window and the next one
    assert any("cannot be downloaded ahead" in str(w.message) for w in caught) == (limit_share < 0.5)
    got = epochs_of(loader, 2)
    for epoch_got, epoch_expected in zip(got, expected, strict=True):
        assert len(epoch_got) == len(epoch_expected)
        for a, b in zip(epoch_got, epoch_expected, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)
    downloads = sum(shard_gets(s3_server).values())
    if limit_share >= 1:
        assert downloads == SHARDS  # epoch 2 from the cache
    else:  # a quarter of the data: each shard comes again in epoch 2, but only once per epoch
        assert SHARDS < downloads <= 2 * SHARDS
    cache = tmp_path / "shards"
    held = sum(p.stat().st_size for p in cache.iterdir() if not p.name.startswith("."))
    assert limit_share >= 1 or held <= total * limit_share + max(p.stat().st_size for p in corpus.glob("*.h5"))


def test_boto3_option_names_load_the_same_batches(s3_server: Any, bucket: str, corpus: Path, tmp_path: Path) -> None:
    url = s3_server.upload(corpus, bucket)
    local = fastload.HDF5Dataset(sorted(corpus.glob("*.h5")))
    options = {"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"}  # boto3's names
    remote = fastload.HDF5Dataset(url, storage_options=options, cache_dir=tmp_path)
    got = [owned(b) for b in fastload.DataLoader(remote, max_tokens=4096, num_workers=1, seed=2)]
    expected = list(fastload.DataLoader(local, max_tokens=4096, num_workers=0, seed=2))
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
