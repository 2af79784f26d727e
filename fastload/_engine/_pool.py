"""The worker processes and their channels: one task pipe and one result pipe per worker.

Tasks are written straight into the worker's pipe by the main thread (no feeder thread, no
lock): the main process keeps at most ``prefetch_factor`` tasks per worker outstanding and each
pipe buffers 1 MiB, so a send does not block in practice.

NOTE [shutdown order] — written once here; ``WorkerPool.shutdown``, ``Engine.close`` and the
loader's iterator point to it.
  1. Every live worker is sent ``None`` (stop after the current task) without blocking — a
     worker whose pipe is full is stuck or dead and is dealt with in 3 — and the task pipes are
     closed (a forked sibling may hold a copy of a write end, so end-of-file alone would not
     reach every worker).
  2. It closes its read ends of the result pipes, so a worker blocked sending a large result
     gets ``BrokenPipeError`` and exits instead of waiting for a reader.
  3. All workers are joined against one shared deadline (``join_s``), never one per worker;
     stragglers (a worker stuck in user code) get SIGTERM, then SIGKILL.
  4. Only then does the engine release shared memory (the batch slots): no worker can still
     write into it.
``shutdown`` is idempotent, and workers also exit by themselves when the main process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import select
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from fastload._engine._transport import dumps_task, loads
from fastload._engine._worker import WorkerSpec, worker_main

_F_SETPIPE_SZ = 1031  # Linux: a 1 MiB result pipe lets a worker run ahead with larger results
_PIPE_BYTES = 1 << 20
# multiprocessing.Connection's framing, which the workers write with send_bytes: a signed
# big-endian 4-byte length, or -1 followed by an unsigned 8-byte length for large messages.
_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


class WorkerDied:
    """What :meth:`WorkerPool.wait` reports for a worker that exited without being told to."""

    def __init__(self, pid: int | None, exitcode: int | None, culprit: int | None) -> None:
        self.pid = pid
        self.exitcode = exitcode
        self.culprit = culprit  # sequence number of the task it was building, if any

    def describe(self) -> str:
        code = self.exitcode
        if code is not None and code < 0:
            return f"pid {self.pid} killed by signal {-code}"
        return f"pid {self.pid} exited with code {code}"


@contextlib.contextmanager
def _frozen_for_fork(ctx: Any) -> Iterator[None]:
    """Around a fork: the parent's objects are moved to the collector's permanent generation
    (``gc.freeze``) while the child is forked, then handed back to the parent. The child keeps
    them frozen, so a full collection in a worker skips the parent's heap instead of writing to
    every object on it: one measured here took 0.9 ms instead of 230 ms, and copy-on-write
    copied 40 pages instead of 10,000. A parent that froze objects itself is left alone."""
    if ctx.get_start_method() != "fork" or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class WorkerPool:
    """Starts ``num_workers`` processes from ``make_spec(worker_id)`` (all in parallel) and moves
    messages: :meth:`send` to one worker, :meth:`wait` for results and deaths of all."""

    def __init__(
        self,
        ctx: Any,
        num_workers: int,
        make_spec: Callable[[int], WorkerSpec],
        *,
        max_workers: int | None = None,
    ) -> None:
        self._ctx = ctx
        self._make_spec = make_spec
        self._procs: list[Any] = [None] * num_workers
        self._tasks: list[Connection | None] = [None] * num_workers
        self._results: list[Connection | None] = [None] * num_workers
        self._retired: list[Any] = []  # stopped on purpose, not yet reaped
        # Bytes read from each result pipe that do not yet make a whole message. The pipes are
        # read raw and non-blocking: one read per wake-up instead of a poll, two reads and
        # another poll per message through Connection.recv_bytes.
        self._inbox: list[bytearray] = [bytearray() for _ in range(num_workers)]
        # One poll object over every result pipe and process sentinel, rebuilt (None) whenever
        # a worker starts or leaves: cheaper than multiprocessing.connection.wait per call.
        self._poller: select.poll | None = None
        self.generation = 0  # bumped whenever the set of watched descriptors changes
        self._watched: dict[int, tuple[int, str]] = {}
        self._closed = False
        # progress[w] is the task worker w is building (-1 between tasks): written by the worker
        # in shared memory, read when it dies, so only the batch it died on is blamed.
        self._progress = ctx.RawArray("q", [-1] * max(num_workers, max_workers or 0))
        for wid in range(num_workers):
            self._start(wid)

    def _start(self, wid: int) -> None:
        task_reader, task_writer = self._ctx.Pipe(duplex=False)
        reader, writer = self._ctx.Pipe(duplex=False)
        for conn in (task_writer, writer):
            with contextlib.suppress(OSError):
                fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        proc = self._ctx.Process(
            target=worker_main,
            args=(self._make_spec(wid), task_reader, writer, self._progress),
            name=f"fastload-worker-{wid}",
            daemon=True,
        )
        self._progress[wid] = -1
        with _frozen_for_fork(self._ctx):
            proc.start()
        writer.close()  # the worker holds the only write end: its death closes the pipe
        task_reader.close()
        os.set_blocking(reader.fileno(), False)
        self._inbox[wid] = bytearray()
        self._procs[wid], self._tasks[wid], self._results[wid] = proc, task_writer, reader
        self._poller = None
        self.generation += 1

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None]

    def send(self, wid: int, msg: Any) -> None:
        conn = self._tasks[wid]
        if conn is None:
            return  # dead and not yet respawned: its tasks are re-dispatched on respawn
        # A worker that just died: wait() reports it and its tasks are re-dispatched.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.send_bytes(dumps_task(msg))

    def _watch(self) -> select.poll:
        if self._poller is None:
            self._poller = select.poll()
            self._watched = {}
            for wid, (conn, proc) in enumerate(zip(self._results, self._procs, strict=True)):
                if conn is not None and proc is not None:
                    for fd, kind in ((conn.fileno(), "result"), (proc.sentinel, "death")):
                        self._poller.register(fd, select.POLLIN)
                        self._watched[fd] = (wid, kind)
        return self._poller

    def fds(self) -> list[int]:
        """The file descriptors :meth:`wait` watches (result pipes and process sentinels), for a
        caller that blocks on them itself; the set changes when a worker starts or leaves."""
        self._watch()
        return list(self._watched)

    def wait(
        self,
        timeout_s: float,
        ready: list[tuple[int, int]] | None = None,
        generation: int | None = None,
    ) -> list[tuple[int, Any]]:
        """Block up to ``timeout_s`` for anything from the workers. Returns ``(worker_id, message)``
        pairs in arrival order per worker; a worker that died is reported once, as a
        :class:`WorkerDied`, after every result it managed to send. A caller that has already
        polled :meth:`fds` passes what it found as ``ready`` with the :attr:`generation` it
        polled at (no second poll); from an older generation it is ignored (a descriptor
        number may since belong to another worker)."""
        poller = self._watch()
        if ready is None or generation != self.generation:
            try:
                ready = poller.poll(max(0, int(timeout_s * 1000)))
            except InterruptedError:
                ready = []
        events: list[tuple[int, Any]] = []
        dead: list[int] = []
        for fd, _ in ready:
            watched = self._watched.get(fd)
            if watched is None:
                continue  # polled before a worker left or was replaced
            wid, kind = watched
            if kind == "result":
                events.extend((wid, m) for m in self._drain(wid))
            elif wid not in dead:
                dead.append(wid)
        for wid in dead:
            events.extend((wid, m) for m in self._drain(wid))
            proc = self._procs[wid]
            proc.join(0)
            culprit = self._progress[wid]
            events.append((wid, WorkerDied(proc.pid, proc.exitcode, None if culprit < 0 else culprit)))
            self._discard(wid)
        return events

    def _drain(self, wid: int) -> list[Any]:
        """Every complete message waiting on ``wid``'s pipe now. For a dead worker that is all it
        sent: what it wrote before dying is already in the pipe."""
        conn = self._results[wid]
        out: list[Any] = []
        if conn is None:
            return out
        inbox = self._inbox[wid]
        fd = conn.fileno()
        while True:
            try:
                chunk = os.read(fd, _PIPE_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # the end of a dead worker's pipe
            if not chunk:
                break  # end of file: the worker is gone; a message it cut off stays unread
            inbox += chunk
            if len(chunk) < _PIPE_BYTES:
                break  # the pipe is empty now; more wakes the poll again
        start, end = 0, len(inbox)
        while end - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(inbox, start)
            head = _HEADER.size
            if size == -1:
                if end - start < head + _LONG_HEADER.size:
                    break
                (size,) = _LONG_HEADER.unpack_from(inbox, start + head)
                head += _LONG_HEADER.size
            if end - start - head < size:
                break
            out.append(loads(inbox[start + head : start + head + size]))
            start += head + size
        del inbox[:start]
        return out

    def _discard(self, wid: int) -> None:
        self._poller = None
        self.generation += 1
        for conn in (self._results[wid], self._tasks[wid]):
            if conn is not None:
                conn.close()
        self._procs[wid] = self._tasks[wid] = self._results[wid] = None

    def respawn(self, wid: int) -> None:
        """Replace dead worker ``wid`` by a fresh process with the same worker id (and so the same
        seed and ``worker_init_fn`` call)."""
        if self._procs[wid] is not None:
            raise RuntimeError(f"worker {wid} is still alive; it cannot be respawned")
        self._start(wid)

    def alive(self, wid: int) -> bool:
        return self._procs[wid] is not None

    def add(self) -> int:
        """Start one more worker; returns its id (the next one)."""
        wid = len(self._procs)
        if wid >= len(self._progress):
            raise RuntimeError(f"the pool was sized for {len(self._progress)} workers")
        self._procs.append(None)
        self._tasks.append(None)
        self._results.append(None)
        self._inbox.append(bytearray())
        self._start(wid)
        return wid

    def retire_last(self) -> None:
        """Stop the highest worker, which holds no task: it exits after reading ``None``. It is
        reaped later, without waiting now."""
        self._poller = None
        self.generation += 1
        wid = len(self._procs) - 1
        proc, tasks, results = self._procs.pop(), self._tasks.pop(), self._results.pop()
        self._inbox.pop()
        for conn in (tasks, results):
            if conn is not None:
                if conn is tasks:
                    with contextlib.suppress(OSError):
                        os.set_blocking(conn.fileno(), False)
                        conn.send_bytes(dumps_task(None))
                conn.close()
        if proc is not None:
            self._retired.append(proc)
        self._progress[wid] = -1
        self._retired = [p for p in self._retired if not _reaped(p)]

    def shutdown(self, join_s: float = 2.0) -> None:
        """Stop every worker; see NOTE [shutdown order]. Idempotent."""
        if self._closed:
            return
        self._closed = True
        live = [p for p in [*self._procs, *self._retired] if p is not None]
        stop = dumps_task(None)
        for conn in self._tasks:  # 1
            if conn is not None:
                with contextlib.suppress(OSError):
                    os.set_blocking(conn.fileno(), False)
                    conn.send_bytes(stop)  # a few bytes: written whole or not at all
                conn.close()
        for conn in self._results:  # 2
            if conn is not None:
                conn.close()
        deadline = time.monotonic() + join_s  # 3
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
        for signal_name in ("terminate", "kill"):
            stragglers = [p for p in live if p.is_alive()]
            if not stragglers:
                break
            for proc in stragglers:
                with contextlib.suppress(OSError):
                    getattr(proc, signal_name)()
            for proc in stragglers:
                proc.join(1.0)
        for proc in live:
            with contextlib.suppress(ValueError):
                proc.close()
        self._procs = [None] * len(self._procs)
        self._tasks = [None] * len(self._tasks)
        self._results = [None] * len(self._results)
        self._retired = []


def _reaped(proc: Any) -> bool:
    proc.join(0)
    if proc.exitcode is None:
        return False
    proc.close()
    return True

