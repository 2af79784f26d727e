"""What a user meets when the store fails for good, through the dataset and the loader: a shard
that is gone (404) and one whose bytes never match the index's checksum are
:class:`StorageError` subclasses naming the URL (so ``except StorageError`` catches both), and
the 404 is also a ``FileNotFoundError``, the refusal a ``PermissionError``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from _servers import Faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import indexed_token_shards

import fastload
from fastload.errors import (
    StorageChecksumError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return indexed_token_shards(tmp_path_factory.mktemp("corpus"), 2, 60, 200)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_shard_gone_from_the_bucket_is_a_storage_not_found_error(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, num_workers: int
) -> None:
    url = s3_server.upload(corpus, bucket)
    dataset = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    s3_server.filesystem().delete_file(f"{bucket}/corpus/part-00001.h5")
    loader = fastload.DataLoader(dataset, batch_size=200, num_workers=num_workers)
    with pytest.raises(StorageError) as caught:
        list(loader)
    assert isinstance(caught.value, StorageNotFoundError) and isinstance(caught.value, FileNotFoundError)
    assert f"{url}part-00001.h5: not found" in str(caught.value)
    if num_workers == 0:  # a worker's error comes back rebuilt from its message
        assert caught.value.filename == f"{url}part-00001.h5"


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_checksum_that_stays_wrong_is_a_storage_checksum_error(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, num_workers: int
) -> None:
    url = s3_server.upload(corpus, bucket)
    data = bytearray((corpus / "part-00000.h5").read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the checksum tells
    s3_server.put(f"{bucket}/corpus/part-00000.h5", bytes(data))
    dataset = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    loader = fastload.DataLoader(dataset, batch_size=200, num_workers=num_workers)
    with pytest.raises(StorageError) as caught:
        list(loader)
    assert isinstance(caught.value, StorageChecksumError)
    assert f"{url}part-00000.h5: the download of shard" in str(caught.value) and "sha256" in str(caught.value)
    if num_workers == 0:
        assert caught.value.filename == f"{url}part-00000.h5"


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_refusal_after_planning_is_a_storage_permission_error(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, num_workers: int
) -> None:
    url = s3_server.upload(corpus, bucket)
    dataset = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    s3_server.set_faults(Faults(error_rate=1.0, error_statuses=(403,)))
    loader = fastload.DataLoader(dataset, batch_size=200, num_workers=num_workers)
    with pytest.raises(StorageError) as caught:
        list(loader)
    assert isinstance(caught.value, StoragePermissionError) and isinstance(caught.value, PermissionError)
    assert f"{url}part-0000" in str(caught.value)
