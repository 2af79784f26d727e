"""The shard cache's pure parts: sizes as users write them, keys that are safe file names and
never collide, the eviction order, and arguments refused at once with the option named."""

from __future__ import annotations

import math
import os
import random
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastload._remote import ShardCache, eviction_order, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("200GB", 200 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("500MB", 500 * 10**6),
        ("500 mb", 500 * 10**6),
        ("10kB", 10_000),
        ("2KiB", 2048),
        (" 3 TiB ", 3 * 2**40),
        ("1PB", 10**15),
        ("4096", 4096),
        ("4096 B", 4096),
        ("0", 0),
        (".5KiB", 512),
        ("1.0001 B", 1),
        ("123456789012345678901 B", 123456789012345678901),
        (0, 0),
        (7 * 2**40, 7 * 2**40),
    ],
)
def test_parse_size_reads_decimal_and_binary_units(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "GB", "abc", "-1GB", "1e9", "12 XB", "5G", "1.5.2 MB", "1 GB extra", -5, True, 1.5, None]
)
def test_parse_size_refuses_anything_else_naming_the_option(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^my_limit must be a number of bytes .*got ") as info:
        parse_size(bad, option="my_limit")  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_a_bad_cache_limit_fails_at_construction_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cache_limit must be .*'lots'"):
        ShardCache(tmp_path, limit="lots")
    assert ShardCache(tmp_path, limit="1 KiB").limit == 1024
    assert ShardCache(tmp_path).limit is None


_SAFE_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


@pytest.mark.parametrize(
    "name",
    [
        "shard-00001.arrow",
        "corpus/train/shard-00001.h5",
        "../../etc/passwd",
        ".hidden",
        "спутник данных.parquet",
        "a" * 1000 + ".arrow",
        "weird name; rm -rf $HOME.tar.gz",
        "",
    ],
)
def test_keys_are_safe_file_names_that_keep_the_suffix(name: str) -> None:
    key = ShardCache.key("s3://bucket/corpus/", name, "etag-1")
    assert _SAFE_KEY.fullmatch(key), key
    assert len(key) <= 120
    suffix = Path(name).suffix
    if suffix in (".arrow", ".h5", ".parquet", ".gz"):
        assert key.endswith(suffix)


@given(st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8), st.text(max_size=8)), max_size=40))
def test_distinct_url_name_version_triples_get_distinct_keys(triples: list[tuple[str, str, str]]) -> None:
    keys = {ShardCache.key(*t) for t in set(triples)}
    assert len(keys) == len(set(triples))


def test_keys_do_not_collide_where_plain_concatenation_would() -> None:
    assert ShardCache.key("s3://b/a", "bc", "1") != ShardCache.key("s3://b/ab", "c", "1")
    assert ShardCache.key("u", "x", "12") != ShardCache.key("u", "x1", "2")
    assert ShardCache.key("u", "x", "v") == ShardCache.key("u", "x", "v")


def test_eviction_order_is_never_needed_first_then_furthest_then_by_key() -> None:
    next_use = {"a": 5.0, "b": 1.0, "c": 9.0, "d": 9.0, "e": math.inf}
    assert eviction_order(["a", "b", "c", "d", "e", "z", "y"], next_use) == [
        "e", "y", "z", "c", "d", "a", "b",
    ]  # fmt: skip


def test_any_prefix_of_the_eviction_order_never_drops_a_shard_needed_sooner_than_one_kept() -> None:
    rng = random.Random(20)
    for _ in range(200):
        keys = [f"k{i}" for i in range(rng.randint(0, 12))]
        next_use = {k: float(rng.randint(0, 5)) for k in keys if rng.random() < 0.7}
        order = eviction_order(keys, next_use)
        assert sorted(order) == sorted(keys)
        assert order == eviction_order(list(reversed(keys)), next_use)  # input order is irrelevant
        when = [next_use.get(k, math.inf) for k in order]
        assert when == sorted(when, reverse=True)


@pytest.mark.parametrize("key", ["", ".hidden", "../up", "a/b", "x" * 201, "sp ace", "\x00"])
def test_a_key_that_is_not_a_safe_file_name_is_refused(tmp_path: Path, key: str) -> None:
    cache = ShardCache(tmp_path)
    with pytest.raises(ValueError, match="key must be"):
        cache.contains(key)
    with pytest.raises(ValueError, match="key must be"):
        cache.get(key, size=1, checksum=None, fetch=lambda fd, start: None)
    assert list(tmp_path.iterdir()) == []


def test_bad_sizes_checksums_and_timeouts_are_refused_before_any_file_is_made(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "c")
    with pytest.raises(ValueError, match="size must be"):
        cache.get("k", size=-1, checksum=None, fetch=lambda fd, start: None)
    with pytest.raises(ValueError, match="checksum must be a sha256"):
        cache.get("k", size=1, checksum="ABC", fetch=lambda fd, start: None)
    with pytest.raises(ValueError, match="need must be"):
        ShardCache(tmp_path / "c", limit=10).make_room(-1, {})
    with pytest.raises(ValueError, match="timeout_s must be"):
        ShardCache(tmp_path / "c", timeout_s=0)
    with pytest.raises(ValueError, match="keep_parts_s must be"):
        ShardCache(tmp_path / "c", keep_parts_s=-1)
    assert not (tmp_path / "c").exists()


def test_the_default_root_is_shards_under_the_cache_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "elsewhere"))
    assert ShardCache().root == tmp_path / "elsewhere" / "shards"


def test_a_waiter_takes_the_shard_another_downloaded_and_pinned(tmp_path: Path) -> None:
    """A reader that downloads a shard pins it at once and keeps it pinned while it reads; a
    second reader that was waiting for that download must take the finished shard, not wait
    for the pin (two readers each waiting on a shard the other had pinned hung a loader)."""
    import threading
    import time

    cache = ShardCache(tmp_path / "cache", timeout_s=30)
    key = ShardCache.key("s3://b/c/", "x.h5", "v1")
    data = b"x" * 1000
    downloading, release = threading.Event(), threading.Event()

    def slow_fetch(fd: int, start: int) -> None:
        downloading.set()
        time.sleep(0.3)
        os.pwrite(fd, data[start:], start)

    def first_reader() -> None:
        cache.get(key, size=len(data), checksum=None, fetch=slow_fetch)
        with cache.pin(key):
            release.wait(10)  # reads for a long time

    reader = threading.Thread(target=first_reader)
    reader.start()
    try:
        assert downloading.wait(10)
        started = time.monotonic()
        path = cache.get(key, size=len(data), checksum=None, fetch=slow_fetch)
        assert path.read_bytes() == data
        assert time.monotonic() - started < 5  # not the 10 s the first reader keeps its pin
    finally:
        release.set()
        reader.join()
