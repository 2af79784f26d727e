"""Publishing a file into the cache: produced once however many ask at once, never seen half
written, leftovers of killed writers removed, and a clear error where the directory is
unusable."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastload._storage import publish, remove, remove_leftovers
from fastload._storage._lock import lock, try_lock
from fastload._storage._publish import lock_path
from fastload.errors import CacheError


def _writer(
    content: bytes, calls: list[str] | None = None, delay_s: float = 0.0
) -> Callable[[Path], None]:
    def produce(temporary: Path) -> None:
        if calls is not None:
            calls.append(temporary.name)
        with open(temporary, "wb") as handle:
            handle.write(content[: len(content) // 2])
            time.sleep(delay_s)  # a reader looking now must not see the half
            handle.write(content[len(content) // 2 :])

    return produce


def _visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith((".lock", ".ok")))


def test_publish_produces_once_and_then_finds_the_file(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "entry.arrow"
    calls: list[str] = []
    assert publish(final, _writer(b"payload", calls), timeout_s=5) is True
    assert publish(final, _writer(b"other", calls), timeout_s=5) is False
    assert final.read_bytes() == b"payload"
    assert len(calls) == 1 and calls[0].startswith(".entry.arrow.") and calls[0].endswith(".tmp")
    assert _visible(final.parent) == ["entry.arrow"]


def test_concurrent_publishers_produce_once_and_all_see_the_whole_file(tmp_path: Path) -> None:
    final = tmp_path / "entry.bin"
    content = os.urandom(1 << 16)
    calls: list[str] = []
    results: list[bool] = []
    seen: list[bytes] = []

    def run() -> None:
        results.append(publish(final, _writer(content, calls, delay_s=0.2), timeout_s=10))
        seen.append(final.read_bytes())

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    while not calls:  # while the first writer is inside produce(), the name shows nothing
        time.sleep(0.005)
    assert not final.exists()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and sorted(results) == [False, False, False, True]
    assert seen == [content] * 4


def test_a_failed_produce_leaves_nothing_and_raises_its_error(tmp_path: Path) -> None:
    final = tmp_path / "entry.bin"

    def produce(temporary: Path) -> None:
        temporary.write_bytes(b"half")
        raise ValueError("bad source")

    with pytest.raises(ValueError, match="bad source"):
        publish(final, produce, timeout_s=5)
    assert _visible(tmp_path) == []


def test_a_full_disk_is_a_cache_error_naming_the_directory_and_the_remedy(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "entry.bin"

    def produce(temporary: Path) -> None:
        temporary.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CacheError) as info:
        publish(final, produce, timeout_s=5)
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert error.filename == str(tmp_path / "cache")
    message = str(error)
    assert f"cache directory {tmp_path / 'cache'}" in message
    assert "No space left on device" in message
    assert "cache_dir=" in message and "FASTLOAD_CACHE" in message
    assert _visible(final.parent) == []


def test_a_cache_directory_that_cannot_be_created_is_a_cache_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    with pytest.raises(CacheError, match=r"a_file/cache: .*cache_dir=.*FASTLOAD_CACHE"):
        publish(blocker / "cache" / "entry.bin", _writer(b"x"), timeout_s=5)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_cache_directory_is_a_cache_error(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        with pytest.raises(CacheError, match=r"ro: Permission denied.*cache_dir=") as info:
            publish(directory / "entry.bin", _writer(b"x"), timeout_s=5)
        assert info.value.errno == errno.EACCES
    finally:
        directory.chmod(0o755)


def test_a_leftover_of_a_killed_writer_is_removed_by_the_next_publication(tmp_path: Path) -> None:
    final = tmp_path / "entry.bin"
    leftover = tmp_path / ".entry.bin.99999-deadbeef.tmp"
    leftover.write_bytes(b"half written by a process killed long ago")
    other = tmp_path / ".other.bin.99999-cafecafe.tmp"
    other.write_bytes(b"half")
    unrelated = tmp_path / ".hidden.tmp"  # no pid tag: not ours
    unrelated.write_bytes(b"")
    assert publish(final, _writer(b"whole"), timeout_s=5) is True
    assert final.read_bytes() == b"whole"
    assert not leftover.exists() and not other.exists() and unrelated.exists()


def test_a_temporary_being_written_is_not_removed(tmp_path: Path) -> None:
    writing = tmp_path / ".busy.bin.1234-00000000.tmp"
    writing.write_bytes(b"half")
    held = try_lock(lock_path(tmp_path / "busy.bin"))
    assert held is not None
    with held:
        assert remove_leftovers(tmp_path) == []
        assert writing.exists()
    assert remove_leftovers(tmp_path) == [writing]


def test_waiting_for_a_stuck_writer_ends_with_a_cache_error_naming_it(tmp_path: Path) -> None:
    final = tmp_path / "entry.bin"
    expected = rf"entry\.bin.*pid {os.getpid()} on .*stop it"
    with lock(lock_path(final), timeout_s=1), pytest.raises(CacheError, match=expected) as info:
        publish(final, _writer(b"x"), timeout_s=0.2)
    assert info.value.errno == errno.ETIMEDOUT
    assert not final.exists()


def test_remove_deletes_an_entry_unless_it_is_being_written(tmp_path: Path) -> None:
    final = tmp_path / "entry.bin"
    publish(final, _writer(b"x"), timeout_s=5)
    with lock(lock_path(final), timeout_s=1):
        assert remove(final) is False
        assert final.exists()
    assert remove(final) is True
    assert not final.exists() and not lock_path(final).exists()


def test_a_lock_file_deleted_while_waited_on_is_never_held_twice(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    first = lock(path, timeout_s=1)
    waiter_has_it = threading.Event()
    release_waiter = threading.Event()

    def wait_for_it() -> None:
        with lock(path, timeout_s=10):
            waiter_has_it.set()
            release_waiter.wait(10)

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    time.sleep(0.1)  # the waiter now polls the first file
    first.unlink()
    third = try_lock(path)  # a newcomer creates a new file at the path and locks it
    assert third is not None
    first.release()
    time.sleep(0.2)  # the waiter gets the deleted file's lock, sees it, and retries
    assert not waiter_has_it.is_set()
    third.release()
    assert waiter_has_it.wait(5)
    release_waiter.set()
    thread.join(5)
