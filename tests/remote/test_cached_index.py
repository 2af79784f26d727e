"""The node's cached copy of a remote dataset's index: used only while it is the file we fetched,
fresh for a while after we fetched it (by our own record, never a file time), then revalidated
with a HEAD instead of fetched again; a link at its lock file is refused, never followed."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import write_token_file

import fastload
from fastload._formats._indexing import build_index, write_index
from fastload._remote import INDEX_NAME
from fastload._shards import _remote_source
from fastload.errors import CacheError

_TEN_YEARS_S = 10 * 365 * 24 * 3600


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Four HDF5 shards with their index, and the index of the first two alone."""
    full = tmp_path_factory.mktemp("full")
    half = tmp_path_factory.mktemp("half")
    for shard in range(4):
        write_token_file(full / f"part-{shard}.h5", 60, 200, seed=shard, label=True)
        if shard < 2:
            (half / f"part-{shard}.h5").write_bytes((full / f"part-{shard}.h5").read_bytes())
    write_index(full, build_index(full))
    write_index(half, build_index(half))
    return full, half


def _cached(cache: Path, url: str) -> Path:
    return cache / "indexes" / f"{hashlib.sha256((url + INDEX_NAME).encode()).hexdigest()[:32]}.json"


def _index_gets(server: Any) -> int:
    return sum(1 for r in server.requests() if r.method == "GET" and r.path.endswith(INDEX_NAME))


def _open(url: str, server: Any, cache: Path) -> fastload.HDF5Dataset:
    return fastload.HDF5Dataset(url, storage_options=server.options, cache_dir=cache)


def test_a_planted_index_with_a_future_mtime_is_not_used(
    s3_server: Any, bucket: str, folders: tuple[Path, Path], tmp_path: Path
) -> None:
    full, half = folders
    url = s3_server.upload(full, bucket)
    cache = tmp_path / "cache"
    assert len(_open(url, s3_server, cache).files) == 4
    planted = _cached(cache, url)
    planted.unlink()
    planted.write_bytes((half / INDEX_NAME).read_bytes())
    ahead = time.time() + _TEN_YEARS_S
    os.utime(planted, (ahead, ahead))
    assert len(_open(url, s3_server, cache).files) == 4  # the bucket's index, not the planted one


def test_freshness_counts_from_our_fetch_and_a_fetch_time_ahead_is_revalidated(
    s3_server: Any, bucket: str, folders: tuple[Path, Path], tmp_path: Path
) -> None:
    full, half = folders
    url = s3_server.upload(full, bucket)
    cache = tmp_path / "cache"
    assert len(_open(url, s3_server, cache).files) == 4
    record = _cached(cache, url).with_name(f".{_cached(cache, url).name}.ok")
    facts = json.loads(record.read_bytes())
    facts["fetched_at"] = time.time() + _TEN_YEARS_S  # a record (or clock) claiming a future fetch
    record.write_text(json.dumps(facts))
    s3_server.put(f"{bucket}/corpus/{INDEX_NAME}", (half / INDEX_NAME).read_bytes())
    assert len(_open(url, s3_server, cache).files) == 2  # revalidated: the bucket's new index


def test_a_stale_index_the_store_still_has_is_revalidated_without_a_get(
    s3_server: Any, bucket: str, folders: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, half = folders
    url = s3_server.upload(full, bucket)
    cache = tmp_path / "cache"
    monkeypatch.setattr(_remote_source, "INDEX_FRESH_S", 0.0)  # every cached index is stale
    s3_server.proxy.reset()
    _open(url, s3_server, cache)
    assert _index_gets(s3_server) == 1
    assert len(_open(url, s3_server, cache).files) == 4
    assert _index_gets(s3_server) == 1  # a HEAD said it is unchanged
    s3_server.put(f"{bucket}/corpus/{INDEX_NAME}", (half / INDEX_NAME).read_bytes())
    assert len(_open(url, s3_server, cache).files) == 2
    assert _index_gets(s3_server) == 2


def test_a_link_at_the_index_lock_is_refused_and_its_target_left_alone(
    s3_server: Any, bucket: str, folders: tuple[Path, Path], tmp_path: Path
) -> None:
    url = s3_server.upload(folders[0], bucket)
    cache = tmp_path / "cache"
    (cache / "indexes").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine\n")
    lock = _cached(cache, url).with_suffix(".lock")
    lock.symlink_to(victim)
    with pytest.raises(CacheError, match=rf"{lock.name}.* symbolic link"):
        _open(url, s3_server, cache)
    assert victim.read_bytes() == b"mine\n"


def test_a_stale_index_deleted_from_the_store_gives_way_to_a_derived_one(
    s3_server: Any, bucket: str, folders: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_server.upload(folders[0], bucket)
    cache = tmp_path / "cache"
    monkeypatch.setattr(_remote_source, "INDEX_FRESH_S", 0.0)
    _open(url, s3_server, cache)
    s3_server.filesystem().delete_file(f"{bucket}/corpus/{INDEX_NAME}")
    with pytest.warns(UserWarning, match=r"not found: listed 4 shards"):
        assert len(_open(url, s3_server, cache).files) == 4
