"""The shard cache with real processes, files and kills: one download per shard however many
processes and threads ask, resume after ``kill -9``, no partial file ever served, corrupt and
short downloads retried then refused, a full disk, and eviction by the plan that skips the
shards other processes are reading.

Every download comes from an "origin" file through a fetch callback that logs each call (pid and
start offset, one line appended per call, so calls from all processes are counted) and can be
slowed per chunk to leave time for a kill."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import multiprocessing.synchronize
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _procs import wait_until

from fastload._remote import ShardCache
from fastload._storage._lock import try_lock
from fastload.errors import CacheError, StorageError

# fork: the children run this module's functions at once, without importing torch again
_FORK = multiprocessing.get_context("fork")
_CHUNK = 32 * 1024


@dataclass(frozen=True)
class Origin:
    """A remote object standing in a local file, and the fetch that copies it from ``start`` on,
    chunk by chunk, sleeping ``delay_s`` after each; ``corrupt_calls`` calls (the first ones)
    flip a byte, ``short_by`` leaves the last bytes out, and after the first chunk it waits for
    ``hold`` to be set, if given."""

    path: Path
    log: Path
    delay_s: float = 0.0
    corrupt_calls: int = 0
    short_by: int = 0
    hold: multiprocessing.synchronize.Event | None = None

    def __call__(self, fd: int, start: int) -> None:
        with open(self.log, "a") as log:  # O_APPEND: one whole line per call, from any process
            log.write(f"{os.getpid()} {start}\n")
        data = bytearray(self.path.read_bytes())
        if len(self.calls()) <= self.corrupt_calls:
            data[len(data) // 2] ^= 0xFF
        end = len(data) - self.short_by
        for offset in range(start, end, _CHUNK):
            if self.hold is not None and offset > start:
                assert self.hold.wait(30)
            os.pwrite(fd, bytes(data[offset : min(offset + _CHUNK, end)]), offset)
            time.sleep(self.delay_s)

    def calls(self) -> list[tuple[int, int]]:
        if not self.log.exists():
            return []
        return [(int(p), int(s)) for p, s in (line.split() for line in self.log.read_text().splitlines())]

    @property
    def data(self) -> bytes:
        return self.path.read_bytes()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _origin(tmp_path: Path, name: str, size: int, **options: object) -> Origin:
    path = tmp_path / "origin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(name).randbytes(size))
    return Origin(path, tmp_path / "origin" / f"{name}.log", **options)  # type: ignore[arg-type]


def _get(cache: ShardCache, key: str, origin: Origin) -> Path:
    return cache.get(key, size=len(origin.data), checksum=origin.sha256, fetch=origin)


def _files(root: Path) -> list[str]:
    """What is in the cache directory besides lock files."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith((".lock", ".ok")))


# -- processes that take part --------------------------------------------------------------


def _get_in_threads(root: str, keys: list[str], origins: list[Origin], threads: int, go: multiprocessing.synchronize.Barrier) -> None:
    """Ask for every key from ``threads`` threads at once; exit 1 if any copy differs."""
    cache = ShardCache(Path(root))
    wrong: list[str] = []
    go.wait(30)

    def run(key: str, origin: Origin) -> None:
        if _get(cache, key, origin).read_bytes() != origin.data:
            wrong.append(key)

    workers = [
        threading.Thread(target=run, args=(key, origin))
        for key, origin in zip(keys, origins, strict=True)
        for _ in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    os._exit(1 if wrong or any(w.is_alive() for w in workers) else 0)


def _get_once(root: str, key: str, origin: Origin) -> None:
    _get(ShardCache(Path(root)), key, origin)


def _pin_until(root: str, key: str, pinned: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event) -> None:
    with ShardCache(Path(root)).pin(key) as path, open(path, "rb"):
        pinned.set()
        assert done.wait(30)


def _start(target: object, *args: object) -> multiprocessing.process.BaseProcess:
    process = _FORK.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    assert process.exitcode == -signal.SIGKILL


# -- one download per machine --------------------------------------------------------------


def test_four_processes_of_three_threads_download_each_shard_once(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    origins = [_origin(tmp_path, f"s{i}.arrow", 256 * 1024, delay_s=0.01) for i in range(2)]
    keys = [ShardCache.key("s3://b/c/", o.path.name, o.sha256) for o in origins]
    go = _FORK.Barrier(4)
    processes = [_start(_get_in_threads, str(root), keys, origins, 3, go) for _ in range(4)]
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0]
    for origin in origins:
        assert [start for _, start in origin.calls()] == [0]  # 24 asked, one fetched
    assert _files(root) == sorted(keys)
    assert ShardCache(root).usage() == 2 * 256 * 1024


def test_a_shard_in_the_cache_is_served_without_fetching(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    origin = _origin(tmp_path, "s.h5", 10_000)
    first = _get(cache, "s.h5", origin)
    assert _get(ShardCache(tmp_path / "cache"), "s.h5", origin) == first
    assert len(origin.calls()) == 1 and cache.contains("s.h5")


# -- kill -9 --------------------------------------------------------------------------------


def test_a_download_killed_midway_is_resumed_and_its_part_never_served(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    origin = _origin(tmp_path, "big.arrow", 1024 * 1024, delay_s=0.02)
    part = root / ".big.arrow.part"
    writer = _start(_get_once, str(root), "big.arrow", origin)
    assert wait_until(lambda: part.exists() and part.stat().st_size >= 8 * _CHUNK, 20)
    _kill(writer)
    written = part.stat().st_size
    assert 0 < written < len(origin.data)
    cache = ShardCache(root)  # a restart: its clean-up on open keeps a young part
    assert not cache.contains("big.arrow") and cache.usage() == 0
    fast = Origin(origin.path, tmp_path / "resume.log")
    path = _get(cache, "big.arrow", fast)
    assert fast.calls() == [(os.getpid(), written)]  # fetched size - written bytes, not all
    assert path.read_bytes() == origin.data
    assert _files(root) == ["big.arrow"]


def test_kills_at_any_moment_never_leave_a_wrong_shard(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    origin = _origin(tmp_path, "s.arrow", 256 * 1024, delay_s=0.004)  # ~35 ms of writing
    rng = random.Random(9)
    for _ in range(8):
        writer = _start(_get_once, str(root), "s.arrow", origin)
        time.sleep(rng.uniform(0.0, 0.06))
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)  # a zombie, if it finished already, takes it too
        writer.join(10)
        assert writer.exitcode in (0, -signal.SIGKILL)
        final = root / "s.arrow"
        if final.exists():
            assert final.read_bytes() == origin.data
            final.unlink()  # and go again, from a fresh start
    assert _get(ShardCache(root), "s.arrow", origin).read_bytes() == origin.data
    assert _files(root) == ["s.arrow"]


# -- wrong downloads --------------------------------------------------------------------------


def test_a_corrupt_download_is_retried_from_scratch_once(tmp_path: Path) -> None:
    origin = _origin(tmp_path, "s.arrow", 100_000, corrupt_calls=1)
    path = _get(ShardCache(tmp_path / "cache"), "s.arrow", origin)
    assert [start for _, start in origin.calls()] == [0, 0]
    assert path.read_bytes() == origin.data


def test_a_download_corrupt_twice_is_a_storage_error_naming_url_and_both_checksums(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    origin = _origin(tmp_path, "s.arrow", 100_000, corrupt_calls=2)
    damaged = bytearray(origin.data)
    damaged[len(damaged) // 2] ^= 0xFF
    url = "s3://bucket/corpus/s.arrow"
    with pytest.raises(StorageError) as info:
        ShardCache(root).get("s.arrow", size=100_000, checksum=origin.sha256, fetch=origin, source=url)
    message = str(info.value)
    assert message.startswith(url) and info.value.filename == url
    assert origin.sha256 in message and hashlib.sha256(damaged).hexdigest() in message
    assert "shard s.arrow" in message and "100000 bytes" in message
    assert [start for _, start in origin.calls()] == [0, 0]
    assert _files(root) == []


def test_a_short_download_is_a_storage_error_naming_both_sizes(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    origin = _origin(tmp_path, "s.arrow", 100_000, short_by=10)
    with pytest.raises(StorageError, match=r"s\.arrow: .* 99990 bytes .* index says 100000 bytes"):
        ShardCache(root).get("s.arrow", size=100_000, checksum=None, fetch=origin)
    assert len(origin.calls()) == 2 and _files(root) == []


def test_a_part_longer_than_the_shard_is_downloaded_again(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    origin = _origin(tmp_path, "s.arrow", 50_000)
    (root / ".s.arrow.part").write_bytes(b"x" * 60_000)
    assert _get(ShardCache(root), "s.arrow", origin).read_bytes() == origin.data
    assert [start for _, start in origin.calls()] == [0]


def test_a_damaged_shard_of_the_wrong_size_is_downloaded_again(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    origin = _origin(tmp_path, "s.arrow", 50_000)
    path = _get(cache, "s.arrow", origin)
    with open(path, "r+b") as handle:
        handle.truncate(1000)
    assert _get(cache, "s.arrow", origin).read_bytes() == origin.data
    assert [start for _, start in origin.calls()] == [0, 0]


def test_a_store_error_keeps_the_part_for_a_resume(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    origin = _origin(tmp_path, "s.arrow", 100_000)

    def drops(fd: int, start: int) -> None:
        os.pwrite(fd, origin.data[:40_000], 0)
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    with pytest.raises(ConnectionResetError):
        ShardCache(root).get("s.arrow", size=100_000, checksum=origin.sha256, fetch=drops)
    assert _files(root) == [".s.arrow.part"]
    assert _get(ShardCache(root), "s.arrow", origin).read_bytes() == origin.data
    assert [start for _, start in origin.calls()] == [40_000]


# -- a full disk ------------------------------------------------------------------------------


def _assert_full_disk_error(info: pytest.ExceptionInfo[CacheError], root: Path) -> None:
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(root)
    message = str(info.value)
    assert f"cache directory {root}" in message and "No space left on device" in message
    assert "cache_dir=" in message and "cache_limit" in message
    assert _files(root) == []


def test_a_fetch_failing_for_a_full_disk_is_a_cache_error_and_leaves_no_part(tmp_path: Path) -> None:
    """The fetch raises ENOSPC itself (what pwrite raises on a full disk), on any machine."""
    root = tmp_path / "cache"
    origin = _origin(tmp_path, "s.arrow", 100_000)

    def full(fd: int, start: int) -> None:
        os.pwrite(fd, origin.data[:10_000], 0)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(CacheError) as info:
        ShardCache(root).get("s.arrow", size=100_000, checksum=origin.sha256, fetch=full)
    _assert_full_disk_error(info, root)


@pytest.fixture
def small_disk(tmp_path: Path) -> object:
    """A real 1 MiB tmpfs (root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_really_full_disk_is_a_cache_error_and_leaves_no_part(tmp_path: Path, small_disk: Path) -> None:
    root = small_disk / "cache"
    origin = _origin(tmp_path, "s.arrow", 2 * 1024 * 1024)
    with pytest.raises(CacheError) as info:
        _get(ShardCache(root), "s.arrow", origin)
    _assert_full_disk_error(info, root)
    assert shutil.disk_usage(small_disk).used < 64 * 1024  # the part's blocks were given back


# -- eviction by plan ------------------------------------------------------------------------


def _filled(tmp_path: Path, sizes: dict[str, int], limit: int | str | None) -> ShardCache:
    cache = ShardCache(tmp_path / "cache", limit=limit)
    for key, size in sizes.items():
        _get(cache, key, _origin(tmp_path, key, size))
    return cache


def test_eviction_drops_the_never_needed_then_the_furthest_until_the_need_fits(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {k: 1000 for k in "abcde"}, limit=5000)
    next_use = {"a": 5.0, "b": 1.0, "c": 9.0, "e": 2.0}  # d: never again
    assert cache.make_room(0, next_use) == []
    assert cache.make_room(1500, next_use) == ["d", "c"]
    assert cache.usage() == 3000 and _files(cache.root) == ["a", "b", "e"]
    assert cache.make_room(2001, next_use) == ["a"]  # 1 byte over: one shard is enough
    assert cache.make_room(3001, next_use) == ["e"]
    assert _files(cache.root) == ["b"]


def test_eviction_for_a_shard_keeps_the_shards_needed_no_later_than_it(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {k: 1000 for k in "abcde"}, limit=5000)
    next_use = {"a": 5.0, "b": 1.0, "c": 9.0, "e": 4.0}  # d: never again
    # 3,500 bytes would need e too, but e is read at 4.0, no later than the shard made room for
    assert cache.make_room(3500, next_use, later_than=4.0) == ["d", "c", "a"]
    assert _files(cache.root) == ["b", "e"] and cache.usage() + 3500 > (cache.limit or 0)
    assert cache.make_room(4000, next_use, later_than=0.5) == ["e"]  # read after 0.5: may go


def test_eviction_breaks_ties_by_key(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {k: 1000 for k in ["q", "p", "s", "r"]}, limit=4000)
    assert cache.make_room(2000, {"q": 3.0, "p": 3.0}) == ["r", "s"]
    assert cache.make_room(3000, {"q": 3.0, "p": 3.0}) == ["p"]


def test_eviction_never_drops_a_shard_needed_sooner_than_one_kept(tmp_path: Path) -> None:
    rng = random.Random(3)
    for round_ in range(6):
        sizes = {f"r{round_}k{i}": rng.randint(100, 3000) for i in range(8)}
        cache = _filled(tmp_path / str(round_), sizes, limit=rng.randint(0, 20_000))
        next_use = {k: float(rng.randint(0, 4)) for k in sizes if rng.random() < 0.8}
        need = rng.randint(0, 5000)
        evicted = cache.make_room(need, next_use)
        kept = [k for k in sizes if cache.contains(k)]
        assert sorted(evicted + kept) == sorted(sizes)
        latest_kept = max((next_use.get(k, float("inf")) for k in kept), default=-1.0)
        assert all(next_use.get(e, float("inf")) >= latest_kept for e in evicted)
        assert cache.usage() + need <= (cache.limit or 0) or kept == []
        if evicted:  # no more than needed: keeping the last one evicted would not have fitted
            assert cache.usage() + sizes[evicted[-1]] + need > (cache.limit or 0)


def test_without_a_limit_nothing_is_evicted(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {"a": 1000}, limit=None)
    assert cache.make_room(10**15, {}) == [] and cache.contains("a")


def test_a_shard_pinned_by_another_process_is_skipped_and_stays_counted(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {k: 1000 for k in "abc"}, limit=3000)
    pinned, done = _FORK.Event(), _FORK.Event()
    reader = _start(_pin_until, str(cache.root), "a", pinned, done)
    try:
        assert pinned.wait(10)
        assert cache.make_room(1000, {"b": 1.0, "c": 2.0}) == ["c"]  # a is furthest, but read
        assert cache.contains("a") and cache.usage() == 2000
    finally:
        done.set()
        reader.join(10)
    assert cache.make_room(2000, {"b": 1.0}) == ["a"]


def test_a_limit_of_zero_keeps_only_the_shard_being_read(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {k: 1000 for k in "abc"}, limit=0)
    pinned, done = _FORK.Event(), _FORK.Event()
    reader = _start(_pin_until, str(cache.root), "b", pinned, done)
    try:
        assert pinned.wait(10)
        assert cache.make_room(0, {"b": 0.0}) == ["a", "c"]
        assert cache.usage() == 1000 and (cache.root / "b").read_bytes()
    finally:
        done.set()
        reader.join(10)
    assert cache.make_room(0, {}) == ["b"] and cache.usage() == 0


def test_a_limit_smaller_than_one_shard_still_serves_it(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", limit="100B")
    origin = _origin(tmp_path, "s.arrow", 4096)
    assert cache.make_room(4096, {"s.arrow": 0.0}) == []
    with cache.pin(_get(cache, "s.arrow", origin).name) as path:
        assert cache.make_room(0, {"s.arrow": 0.0}) == []
        assert path.read_bytes() == origin.data
    assert cache.make_room(0, {"s.arrow": 0.0}) == ["s.arrow"]
    assert _get(cache, "s.arrow", origin).read_bytes() == origin.data  # evicted: fetched again
    assert len(origin.calls()) == 2


def test_pinning_a_shard_not_in_the_cache_is_file_not_found(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {"a": 10}, limit=0)
    assert cache.make_room(0, {}) == ["a"]
    with pytest.raises(FileNotFoundError, match="shard a is not in the cache"), cache.pin("a"):
        pass
    assert _files(cache.root) == [] and not (cache.root / ".a.lock").exists()


def _evict_slowly(root: str, key: str, locked: multiprocessing.synchronize.Event) -> None:
    """What make_room does to one shard, with a pause under the lock."""
    held = try_lock(Path(root) / f".{key}.lock")
    assert held is not None
    locked.set()
    time.sleep(0.3)
    (Path(root) / key).unlink()
    held.unlink()
    held.release()


def test_a_pin_waiting_while_the_shard_is_evicted_is_file_not_found(tmp_path: Path) -> None:
    cache = _filled(tmp_path, {"a": 10}, limit=0)
    locked = _FORK.Event()
    evictor = _start(_evict_slowly, str(cache.root), "a", locked)
    assert locked.wait(10)
    with pytest.raises(FileNotFoundError, match="shard a is not in the cache"), cache.pin("a"):
        pass
    evictor.join(10)
    assert evictor.exitcode == 0


# -- leftovers and waits ---------------------------------------------------------------------


def test_clean_leftovers_removes_a_dead_writers_part_but_not_a_live_ones(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    hold = _FORK.Event()
    origin = _origin(tmp_path, "s.arrow", 4 * _CHUNK, hold=hold)
    part = root / ".s.arrow.part"
    writer = _start(_get_once, str(root), "s.arrow", origin)
    assert wait_until(lambda: part.exists() and part.stat().st_size > 0, 10)
    cache = ShardCache(root, limit=0)
    try:
        assert cache.clean_leftovers() == [] and part.exists()
        assert cache.make_room(0, {}) == []  # nothing complete to evict, and no part counted
    finally:
        _kill(writer)
    assert cache.clean_leftovers() == [part]
    assert list(root.iterdir()) == [root / ".evict.lock"]  # the part's lock file went with it


def test_a_wait_for_a_stuck_writer_ends_with_a_cache_error_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    hold = _FORK.Event()
    origin = _origin(tmp_path, "s.arrow", 4 * _CHUNK, hold=hold)
    writer = _start(_get_once, str(root), "s.arrow", origin)
    try:
        assert wait_until(lambda: len(origin.calls()) == 1, 10)
        with pytest.raises(CacheError, match=rf"waited 0.3 s .*pid {writer.pid} on ") as info:
            _get(ShardCache(root, timeout_s=0.3), "s.arrow", origin)
        assert info.value.errno == errno.ETIMEDOUT
    finally:
        _kill(writer)


def test_opening_the_cache_removes_old_dead_parts_and_keeps_young_ones(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    old, young = root / ".old.arrow.part", root / ".young.arrow.part"
    old.write_bytes(b"o" * 100)
    young.write_bytes(b"y" * 100)
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    _get(ShardCache(root), "other.arrow", _origin(tmp_path, "other.arrow", 10))
    assert not old.exists() and young.exists()
