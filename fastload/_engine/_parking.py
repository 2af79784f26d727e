"""Workers kept for the next iterator over the same data (NOTE [parked workers]).

NOTE [parked workers] — A loader without ``persistent_workers`` starts its workers at every
``iter()`` and stops them at the end of the epoch, as torch's does. A fresh worker costs the
consumer more than its start: through the worker server its first batch comes 12-20 ms after
``iter()`` (unpickling the spec, opening the file, the first build faulting in the file's
pages), and each of its first hundred builds faults in more of the memory map (about 1,600
faults of ~5 µs over a 105 MB column). On 2 cores a fresh 1,000-batch round ran at 0.65-0.70×
the in-RAM limit where the same workers kept from the round before ran at 1.03×
(benchmarks/README.md, "Parked workers").

So where nothing in a worker can tell one iterator from the next, the slot runner of a finished
iterator is *parked* for :func:`park_seconds` instead of closed: its workers, their open files
and memory maps, the slots. An ``iter()`` of any loader whose runner would be the same takes it
(as ``persistent_workers`` takes its own at the next epoch), reseeded with its own base seed;
else the parked runner is closed when its time is up, at interpreter exit, or when another is
parked under the same key. "The same" is decided from the options, never from a guess:

* the fast path with every worker running, no ``worker_init_fn``, no process context other
  than one of :mod:`multiprocessing`'s own (a remote dataset's workers come from its
  forkserver), reads and a collate that declare themselves the same in any process, no pinned
  or device slots, no growing pool, no resumed state (:func:`parking_key`,
  ``SlotRunner.parkable``). Workers the caller forked
  (before the worker server was ready, or without it) are kept as well as the server's: as
  with ``persistent_workers``, a forked one keeps its copy-on-write view of the caller for
  those seconds too;
* the same dataset and collate, byte for byte as they pickle, with every other option the
  workers or the slots depend on, the same working directory and ``FASTLOAD_*`` variables
  (a worker took the caller's as they were when it started);
* the dataset's local files unchanged since the parked runner was made: path, device, inode,
  size and modification and change times, as ``stat`` gives them then and at the ``iter()``
  that would take it. A file rewritten or replaced in between, and the runner is not taken.
  A remote dataset's reads go to the node's shard cache, whose content changes with every
  download; there the folder must be the same one (path, device, inode), and the shards are
  the versions its pickled index names, each checked when it entered the cache. Its workers
  keep their open shards pinned while parked, as persistent workers do between epochs.

``FASTLOAD_PARK_S`` sets the time (seconds; ``0`` turns parking off); a process keeps at most
:data:`MAX_PARKED` runners, the oldest closed first. A forked child never takes its parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastload._threads import start_own_thread

ENV = "FASTLOAD_PARK_S"
DEFAULT_S = 15.0
MAX_PARKED = 4
_JOIN_S = 2.0


def park_seconds() -> float:
    """How long a finished iterator's runner waits to be taken (``FASTLOAD_PARK_S``; 0: off)."""
    text = os.environ.get(ENV)
    if text is None or not text.strip():
        return DEFAULT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of seconds (0 turns parking off); got {text!r}") from None
    if not value >= 0:
        raise ValueError(f"{ENV} must be a number of seconds >= 0 (0 turns parking off); got {text!r}")
    return value


@dataclass(frozen=True)
class ParkingKey:
    """What decides that a runner may serve another iterator: the pickled options, and the
    dataset's files as they were when the runner was made."""

    options: bytes
    files: tuple[tuple[str, int, int, int, int, int], ...]


def parking_key(options: Any, files: Sequence[str], folders: Sequence[str] = ()) -> ParkingKey | None:
    """The key of the runner ``options`` make, whose workers read ``files`` (local files, as
    they are now) and the shards in ``folders`` (a remote dataset's shard cache, by identity),
    or ``None`` where its runner may not be parked (see the NOTE; the runner says the rest:
    ``SlotRunner.parkable``). Neither named: nothing to tell a changed dataset by, never
    parked."""
    capabilities = options.capabilities
    if options.num_workers < 1 or options.fast_collate is None or not (files or folders):
        return None
    if options.worker_init_fn is not None or options.auto_workers or not _standard(options.mp_context):
        return None
    if options.pin is not None or options.resume_rng is not None or options.first_worker:
        return None
    if options.snapshot_rng or options.snapshot_dataset:
        return None
    if not (capabilities.dataset.process_independent_reads and capabilities.collate.process_independent):
        return None
    context = options.mp_context
    try:
        blob = pickle.dumps(
            (
                type(options.dataset), options.dataset, type(options.collate_fn), options.collate_fn,
                options.auto_collation, options.drop_last, options.num_workers, options.prefetch_factor,
                options.in_order, options.timeout_s, options.max_shared_bytes, options.readahead,
                options.host, None if context is None else context.get_start_method(), os.getcwd(),
                sorted((k, v) for k, v in os.environ.items() if k.startswith("FASTLOAD_") and k != ENV),
            ),
            pickle.HIGHEST_PROTOCOL,
        )  # fmt: skip
    except Exception:
        return None  # nothing to compare by
    fingerprint = _fingerprint(files, folders)
    return None if fingerprint is None else ParkingKey(blob, fingerprint)


def _standard(context: Any) -> bool:
    """Whether ``context`` is the default (``None``) or :mod:`multiprocessing`'s own context
    for its start method (one the caller made is nothing to compare by)."""
    if context is None:
        return True
    try:
        return context is multiprocessing.get_context(context.get_start_method())
    except (AttributeError, ValueError):
        return False


def _fingerprint(files: Sequence[str], folders: Sequence[str]) -> tuple[tuple[str, int, int, int, int, int], ...] | None:
    """Each file as ``stat`` gives it (identity, size, times); each folder by identity only (its
    content changes, the folder must not). ``None`` if one is gone."""
    try:
        stats = [(path, os.stat(path)) for path in [*files, *folders]]
    except OSError:
        return None
    out = [(p, s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for p, s in stats[: len(files)]]
    out += [(p, s.st_dev, s.st_ino, -1, -1, -1) for p, s in stats[len(files) :]]
    return tuple(out)


@dataclass
class _Parked:
    key: ParkingKey
    runner: Any
    until: float


class _Lot:
    """The parked runners of this process, and the thread that closes them when their time
    is up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: list[_Parked] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False  # at exit: nothing is parked from then on
        self._closes_at_exit = False  # kept by a forked child: it inherits the exit handlers

    def park(self, key: ParkingKey, runner: Any, seconds: float) -> bool:
        """Keep ``runner`` for ``seconds``; ``False`` (the caller closes it) where it cannot be."""
        if seconds <= 0 or os.getpid() != self._pid or sys.is_finalizing():
            return False
        closing: list[Any] = []
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                try:
                    self._thread = start_own_thread(self._run, "fastload-parked")
                except RuntimeError:  # the interpreter is shutting down: no thread starts
                    return False
                if not self._closes_at_exit:
                    # Registered now, after every exit handler of the engine's (the worker
                    # server's shutdown, the reaper's flush, multiprocessing's joins of its
                    # children), it runs before them all: the workers it stops are joined by
                    # the reaper's flush. Registered at import, it ran after that flush, and
                    # the reaper's thread closed processes that multiprocessing's handler was
                    # joining ("process object is closed").
                    atexit.register(self.close_all, at_exit=True)
                    self._closes_at_exit = True
            same = [p for p in self._parked if p.key == key]
            keep = [p for p in self._parked if p.key != key]
            keep.append(_Parked(key, runner, time.monotonic() + seconds))
            while len(keep) > MAX_PARKED:
                closing.append(keep.pop(0).runner)
            closing += [p.runner for p in same]
            self._parked = keep
            self._wake.notify()
        _close(closing)
        return True

    def take(self, key: ParkingKey) -> Any:
        """A parked runner under ``key`` whose workers are all alive, or ``None``."""
        if os.getpid() != self._pid:
            return None
        with self._lock:
            found = next((p for p in self._parked if p.key == key), None)
            if found is None:
                return None
            self._parked.remove(found)
        if found.runner.parkable:  # not under the lot's lock: it asks the workers
            return found.runner
        _close([found.runner])
        return None

    def close_all(self, at_exit: bool = False) -> None:
        with self._lock:
            self._closed = self._closed or at_exit
            closing, self._parked = [p.runner for p in self._parked], []
            self._wake.notify()
        _close(closing)

    def forget_in_child(self) -> None:
        """After a fork, in the child: the parked runners are the parent's."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._parked = []
        self._thread = None
        self._pid = os.getpid()
        self._closed = False

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._parked)

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                expired = [p for p in self._parked if p.until <= now]
                self._parked = [p for p in self._parked if p.until > now]
                if not expired:
                    wait = min((p.until for p in self._parked), default=now + 60.0) - now
                    self._wake.wait(max(0.01, wait))
                    continue
            _close([p.runner for p in expired])


def _close(runners: list[Any]) -> None:
    for runner in runners:
        with contextlib.suppress(Exception):  # closing is best effort here: nothing waits on it
            runner.close(_JOIN_S)


_lot = _Lot()
os.register_at_fork(after_in_child=_lot.forget_in_child)


def park(key: ParkingKey, runner: Any, seconds: float) -> bool:
    """Park ``runner`` under ``key`` for ``seconds`` (see the NOTE); ``False``: close it."""
    return _lot.park(key, runner, seconds)


def take(key: ParkingKey) -> Any:
    """The runner parked under ``key``, or ``None``."""
    return _lot.take(key)


def parked() -> int:
    """How many runners are parked now."""
    return _lot.count


def close_parked() -> None:
    """Close every parked runner now."""
    _lot.close_all()


__all__ = ["DEFAULT_S", "ENV", "MAX_PARKED", "ParkingKey", "close_parked", "park", "park_seconds", "parked", "parking_key", "take"]
