"""The node cache against another local user: links planted where the cache keeps its lock files
and downloads are refused, never followed; a cache folder that someone else owns or may write to
is refused; and a file planted (or replaced) under a shard's or a decoded copy's name is never
served: the cache trusts only the very file it verified."""

from __future__ import annotations

import hashlib
import os
import pwd
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastload import ArrowDataset
from fastload._remote import ShardCache
from fastload._storage import publish
from fastload._storage._publish import lock_path
from fastload.errors import CacheError

_VICTIM = b"a file of the user's that nobody may overwrite\n" * 100


class _Origin:
    """A shard's bytes and the fetch that copies them, counting its calls."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.calls = 0

    def __call__(self, fd: int, start: int) -> None:
        self.calls += 1
        os.pwrite(fd, self.data[start:], start)


def _get(cache: ShardCache, origin: _Origin, key: str = "s.h5", *, checksum: bool = True) -> Path:
    return cache.get(key, size=len(origin.data), checksum=origin.sha256 if checksum else None, fetch=origin)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(_VICTIM)
    return victim


@pytest.mark.parametrize("name", [".s.h5.lock", ".s.h5.part"])
def test_a_link_at_a_shard_lock_or_part_is_refused_and_its_target_left_alone(tmp_path: Path, name: str) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    victim = _victim(tmp_path)
    (root / name).symlink_to(victim)
    origin = _Origin(os.urandom(4096))
    with pytest.raises(CacheError, match=rf"{name}.* symbolic link.*never followed") as info:
        _get(ShardCache(root), origin)
    assert info.value.filename == str(root / name)
    assert victim.read_bytes() == _VICTIM
    assert not (root / "s.h5").exists()


def test_a_link_at_a_publication_lock_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    final = tmp_path / "parquet" / "copy.arrow"
    final.parent.mkdir(mode=0o700)
    victim = _victim(tmp_path)
    lock_path(final).symlink_to(victim)
    with pytest.raises(CacheError, match=r"copy\.arrow\.lock.* symbolic link"):
        publish(final, lambda t: t.write_bytes(b"copy"), timeout_s=5)
    assert victim.read_bytes() == _VICTIM and not final.exists()


def test_a_linked_shards_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / "shards").symlink_to(elsewhere)
    with pytest.raises(CacheError, match=r"cache/shards is a symbolic link"):
        _get(ShardCache(root, folder="shards"), _Origin(b"x" * 10))
    assert list(elsewhere.iterdir()) == []


def test_a_new_cache_folder_is_made_for_this_user_alone(tmp_path: Path) -> None:
    root = tmp_path / "new" / "cache"
    _get(ShardCache(root, folder="shards"), _Origin(b"x" * 10))
    assert (root.stat().st_mode & 0o777) == 0o700 and ((root / "shards").stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_cache_folder_others_may_write_is_refused_naming_it_and_the_fix(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(CacheError, match=rf"{root} may be written by others.*cache_dir=.*FASTLOAD_CACHE"):
        _get(ShardCache(root, folder="shards"), _Origin(b"x" * 10))
    assert list(root.iterdir()) == []


def test_a_cache_folder_of_another_user_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder another user owns")
    nobody = pwd.getpwnam("nobody").pw_uid
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    os.chown(root, nobody, -1)
    with pytest.raises(CacheError, match=rf"{root} belongs to user id {nobody}.*cache_dir=.*FASTLOAD_CACHE"):
        _get(ShardCache(root, folder="shards"), _Origin(b"x" * 10))
    assert list(root.iterdir()) == []
    sub = tmp_path / "mine"
    (sub / "shards").mkdir(parents=True, mode=0o700)
    os.chown(sub / "shards", nobody, -1)  # a folder below the root counts too
    with pytest.raises(CacheError, match=r"mine/shards belongs to user id"):
        _get(ShardCache(sub, folder="shards"), _Origin(b"x" * 10))


@pytest.mark.parametrize("checksum", [True, False])
def test_a_shard_replaced_by_a_same_size_file_is_fetched_again_not_served(tmp_path: Path, checksum: bool) -> None:
    cache = ShardCache(tmp_path / "cache")
    origin = _Origin(os.urandom(8192))
    path = _get(cache, origin, checksum=checksum)
    planted = tmp_path / "planted"
    planted.write_bytes(b"\x66" * len(origin.data))
    os.replace(planted, path)
    assert not cache.contains("s.h5")
    assert _get(cache, origin, checksum=checksum).read_bytes() == origin.data
    assert origin.calls == 2


def test_a_shard_rewritten_in_place_is_fetched_again(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    origin = _Origin(os.urandom(8192))
    path = _get(cache, origin, checksum=False)
    with open(path, "r+b") as handle:
        handle.write(b"\x66" * 16)
    assert _get(cache, origin, checksum=False).read_bytes() == origin.data


def test_a_planted_file_or_link_under_a_shard_name_is_never_served(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    origin = _Origin(os.urandom(4096))
    (root / "a.h5").write_bytes(b"\x66" * len(origin.data))
    other = tmp_path / "other"
    other.write_bytes(b"\x66" * len(origin.data))
    (root / "b.h5").symlink_to(other)
    cache = ShardCache(root)
    assert _get(cache, origin, "a.h5", checksum=False).read_bytes() == origin.data
    assert _get(cache, origin, "b.h5").read_bytes() == origin.data
    assert not (root / "b.h5").is_symlink() and other.read_bytes() == b"\x66" * len(origin.data)


def test_a_verified_shard_without_a_record_is_kept_without_fetching(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    origin = _Origin(os.urandom(4096))
    (root / "s.h5").write_bytes(origin.data)  # as an earlier fastload left it: right bytes, no record
    assert _get(ShardCache(root), origin).read_bytes() == origin.data
    assert origin.calls == 0


def test_a_decoded_parquet_copy_replaced_by_other_rows_is_decoded_again(tmp_path: Path) -> None:
    source = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": np.arange(3, dtype=np.int64)}), source)
    cache = tmp_path / "c"
    ArrowDataset(source, cache_dir=cache)
    (copy,) = [p for p in (cache / "parquet").iterdir() if not p.name.startswith(".")]
    planted = tmp_path / "planted.arrow"
    with pa.OSFile(str(planted), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("x", pa.int64())])) as writer:
        writer.write_table(pa.table({"x": np.full(3, 666, dtype=np.int64)}))
    os.replace(planted, copy)
    dataset = ArrowDataset(source, cache_dir=cache)
    assert np.asarray(dataset.read_batch([0, 1, 2])["x"]).tolist() == [0, 1, 2]
