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
  2. It waits, against one shared deadline (``join_s``), for each worker's goodbye: end-of-file
     on its result pipe, which the worker closes as the last thing it does, or its exit. What
     arrives meanwhile is read and dropped, so a worker blocked sending a large result finishes
     and leaves.
  3. The result pipes are closed. Workers that said goodbye are joined in the background
     (``_reaper.py``: their exit takes milliseconds, and touches nothing of ours); the
     others, stuck in user code, get SIGTERM, then SIGKILL, and are joined before returning.
  4. Only then does the engine release shared memory (the batch slots): no worker can still
     write into it, or open a descriptor number the main process may reuse.
``shutdown`` is idempotent, and workers also exit by themselves when the main process dies.

NOTE [raw descriptors] — the main process keeps its ends of the pipes as bare file descriptors
that only this pool closes, not as ``multiprocessing.Connection`` objects. When a loader's
iterator dies in a reference cycle, the collector may run a Connection's ``__del__`` before the
iterator's: ``__del__`` closes the descriptor but leaves the Connection holding its number, so the
shutdown that follows would close the number a second time, by then possibly another file's. A
``weakref.finalize`` closes the descriptors of a pool dropped without ``shutdown``; it runs before
any ``__del__`` in the same collection and marks them closed, so ``shutdown`` skips them.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import select
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from fastload._engine._main_guard import check_main_guard
from fastload._engine._messages import Reply
from fastload._engine._pool_protocol import WorkerDied
from fastload._engine._reaper import join_or_kill, reap, track
from fastload._engine._transport import dumps_task, loads, take_frames, write_frame
from fastload._engine._worker import WorkerSpec, worker_main
from fastload._engine._zygote import Refused, SharedCounters, WorkerServer

_F_SETPIPE_SZ = 1031  # Linux: a 1 MiB result pipe lets a worker run ahead with larger results
_PIPE_BYTES = 1 << 20
_CLOSED = -1  # a pipe end that is not open (no worker, or closed)
_REAPABLE_S = 0.1  # how long a worker whose sentinel fired may take to become reapable


@contextlib.contextmanager
def _frozen_for_fork(ctx: Any) -> Iterator[None]:
    """Around a fork: the parent's objects are moved to the collector's permanent generation
    (``gc.freeze``) while the child is forked, then handed back to the parent. The child keeps
    them frozen, so a full collection in a worker skips the parent's heap instead of writing to
    every object on it (which copy-on-write would copy page by page). A parent that froze
    objects itself is left alone."""
    if ctx.get_start_method() != "fork" or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _close_ends(*ends: list[int]) -> None:
    """Close every open descriptor in ``ends`` and mark it closed, in place."""
    for fds in ends:
        for i, fd in enumerate(fds):
            if fd != _CLOSED:
                fds[i] = _CLOSED
                with contextlib.suppress(OSError):
                    os.close(fd)


class WorkerPool:
    """The :class:`~fastload._engine._pool_protocol.Pool` of processes: starts ``num_workers`` of them
    from ``make_spec(worker_id)`` (all in parallel) and moves messages: :meth:`send` to one
    worker, :meth:`wait` for results and deaths of all.

    ``start``: how many to fork now (default all); :meth:`start_rest` forks the others, so a
    caller can send the first worker its task before the forks of the rest (5-7 ms
    each here, with torch loaded). Nothing may be sent to a worker not started yet.

    ``server``: the worker server (``_zygote.py``) forks the workers instead of this process;
    their progress and finished counts then live in a memory file it can pass them. A spec it
    refuses, or a server gone, and the pool forks that worker and the rest itself."""

    def __init__(
        self,
        ctx: Any,
        num_workers: int,
        make_spec: Callable[[int], WorkerSpec],
        *,
        max_workers: int | None = None,
        decode: Callable[[bytes], Any] = loads,
        start: int | None = None,
        server: WorkerServer | None = None,
    ) -> None:
        check_main_guard(ctx)  # before any worker exists (spawn/forkserver re-run the script)
        self._ctx = ctx
        # Where given, workers are forked by the worker server, not by this process; one whose
        # spec it refuses, or a server that died, and this pool forks them itself from then on.
        self._server = server
        self._make_spec = make_spec
        self._decode = decode  # one result message's bytes -> the message
        self._procs: list[Any] = [None] * num_workers
        # The main process's ends of each worker's pipes: NOTE [raw descriptors]. Both lists are
        # only ever changed in place, because the finalizer holds them.
        self._tasks: list[int] = [_CLOSED] * num_workers
        self._results: list[int] = [_CLOSED] * num_workers
        # Bytes read from each result pipe that do not yet make a whole message. The pipes are
        # read raw and non-blocking: one read per wake-up instead of a poll, two reads and
        # another poll per message through Connection.recv_bytes.
        self._inbox: list[bytearray] = [bytearray() for _ in range(num_workers)]
        # One poll object over every result pipe and process sentinel, rebuilt (None) whenever
        # a worker starts or leaves: cheaper than multiprocessing.connection.wait per call.
        self._poller: select.poll | None = None
        self.generation = 0  # bumped whenever the set of watched descriptors changes
        self._watched: dict[int, tuple[int, str]] = {}
        self._watched_fds: list[int] = []  # the keys of _watched, listed once per poll object
        self._closed = False
        # progress[w] is the task worker w is building (-1 between tasks): written by the worker
        # in shared memory, read when it dies, so only the batch it died on is blamed.
        # finished[w]: how many tasks worker w has finished (replied to), written by the worker
        # just before each reply, so that a reply received is counted; the main process places
        # tasks by it without reading the replies.
        slots = max(num_workers, max_workers or 0)
        self._counters: SharedCounters | None = None
        if server is not None:  # one memory file, which the server's workers are sent
            self._counters = SharedCounters(slots)
            self._progress, self._finished = self._counters.progress, self._counters.finished
            for wid in range(slots):
                self._progress[wid] = -1
        else:
            self._progress = ctx.RawArray("q", [-1] * slots)
            self._finished = ctx.RawArray("q", slots)
        self._finalizer = weakref.finalize(self, _close_ends, self._tasks, self._results)
        self._unstarted = list(range(num_workers))
        try:
            self.start_rest(start)
        except BaseException:  # a fork that failed: the workers forked before it stop now
            self.shutdown(join_s=0.1)
            raise

    def start_rest(self, count: int | None = None) -> None:
        """Fork the workers not started yet (``count`` of them; ``None``: all)."""
        now = self._unstarted[:count] if count is not None else self._unstarted
        self._unstarted = self._unstarted[len(now) :]
        for wid in now:
            self._start(wid)

    def _start(self, wid: int) -> None:
        task_reader_fd, task_writer = os.pipe()
        reader, writer_fd = os.pipe()
        for fd in (task_writer, writer_fd):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        # The worker's ends travel as Connections (it reads and writes them as such).
        task_reader = Connection(task_reader_fd, writable=False)
        writer = Connection(writer_fd, readable=False)
        spec = self._make_spec(wid)
        name = f"fastload-worker-{wid}"
        self._progress[wid] = -1
        self._finished[wid] = 0
        proc: Any = None
        if self._server is not None and self._counters is not None:
            try:
                proc = self._server.start(
                    name, (spec, len(self._progress)), [task_reader_fd, writer_fd, self._counters.fd]
                )
            except (Refused, OSError):
                self._server = None  # fork them here, this one and the rest
        if proc is None:
            inherited = (task_writer, reader) if self._ctx.get_start_method() == "fork" else ()
            proc = self._ctx.Process(
                target=worker_main,
                args=(spec, task_reader, writer, self._progress, self._finished, inherited),
                name=name,
                daemon=True,
            )
            with _frozen_for_fork(self._ctx):
                proc.start()
        track(proc)
        writer.close()  # the worker holds the only write end: its death closes the pipe
        task_reader.close()
        os.set_blocking(reader, False)
        self._inbox[wid] = bytearray()
        self._procs[wid], self._tasks[wid], self._results[wid] = proc, task_writer, reader
        self._poller = None
        self.generation += 1

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None]

    def all_alive(self) -> bool:
        """Whether every worker is started, its pipes open and its process running."""
        if self._closed or self._unstarted:
            return False
        return all(
            proc is not None and task != _CLOSED and result != _CLOSED and proc.is_alive()
            for proc, task, result in zip(self._procs, self._tasks, self._results, strict=True)
        )

    def finished(self, wid: int) -> int:
        count: int = self._finished[wid]
        return count

    def send(self, wid: int, msg: Any) -> None:
        """Send ``msg`` to worker ``wid``: a pickle, or bytes a codec encoded itself."""
        fd = self._tasks[wid]
        if fd == _CLOSED:
            return  # dead and not yet respawned: its tasks are re-dispatched on respawn
        try:
            write_frame(fd, msg if isinstance(msg, bytes) else dumps_task(msg))
        except (BrokenPipeError, ConnectionResetError):
            return  # a worker that just died: wait() reports it and its tasks are re-dispatched

    def _watch(self) -> select.poll:
        while (poller := self._poller) is None:
            # Built aside and published whole, and only if no worker started or left meanwhile:
            # a served worker's sentinel may wait for the server's word on it (the GIL
            # released) while the consumer's thread starts the next worker.
            generation = self.generation
            poller, watched = select.poll(), {}
            for wid, (result_fd, proc) in enumerate(zip(self._results, self._procs, strict=True)):
                if result_fd != _CLOSED and proc is not None:
                    for fd, kind in ((result_fd, "result"), (proc.sentinel, "death")):
                        poller.register(fd, select.POLLIN)
                        watched[fd] = (wid, kind)
            if generation == self.generation:
                self._watched, self._watched_fds, self._poller = watched, list(watched), poller
        return poller

    def fds(self) -> list[int]:
        """The file descriptors :meth:`wait` watches (result pipes and process sentinels), for a
        caller that blocks on them itself; the set changes when a worker starts or leaves (a
        new list then: callers may keep and compare it, and must not change it)."""
        self._watch()
        return self._watched_fds

    def wait(
        self,
        timeout_s: float,
        ready: list[tuple[int, int]] | None = None,
        generation: int | None = None,
    ) -> list[tuple[int, Reply | WorkerDied]]:
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
        events: list[tuple[int, Reply | WorkerDied]] = []
        dead: list[int] = []
        for fd, _ in ready:
            watched = self._watched.get(fd)
            if watched is None:
                continue  # polled before a worker left or was replaced
            wid, kind = watched
            if kind == "result":
                for message in self._drain(wid):
                    events.append((wid, message))
            elif wid not in dead:
                dead.append(wid)
        for wid in dead:
            events.extend((wid, m) for m in self._drain(wid))
            proc = self._procs[wid]
            # The sentinel fires as the dying process releases its descriptors, a moment before
            # the kernel lets it be reaped: wait that moment for its exit code, and hand one
            # that is still not reapable to the reaper rather than leave a zombie.
            proc.join(_REAPABLE_S)
            if proc.exitcode is None:
                reap([proc])
            culprit = self._progress[wid]
            events.append((wid, WorkerDied(proc.pid, proc.exitcode, None if culprit < 0 else culprit)))
            self._discard(wid)
        return events

    def _drain(self, wid: int) -> list[Any]:
        """Every complete message waiting on ``wid``'s pipe now. For a dead worker that is all it
        sent: what it wrote before dying is already in the pipe."""
        fd = self._results[wid]
        out: list[Any] = []
        if fd == _CLOSED:
            return out
        inbox = self._inbox[wid]
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
        out.extend(take_frames(inbox, self._decode))
        return out

    def _discard(self, wid: int) -> None:
        self._poller = None
        self.generation += 1
        ends = [self._results[wid], self._tasks[wid]]
        self._tasks[wid] = self._results[wid] = _CLOSED
        self._procs[wid] = None
        _close_ends(ends)

    def respawn(self, wid: int) -> None:
        """Replace dead worker ``wid`` by a fresh process with the same worker id (and so the same
        seed and ``worker_init_fn`` call)."""
        if self._procs[wid] is not None:
            raise RuntimeError(f"worker {wid} is still alive; it cannot be respawned")
        self._start(wid)

    def add(self) -> int:
        """Start one more worker; returns its id (the next one)."""
        wid = len(self._procs)
        if wid >= len(self._progress):
            raise RuntimeError(f"the pool was sized for {len(self._progress)} workers")
        self._procs.append(None)
        self._tasks.append(_CLOSED)
        self._results.append(_CLOSED)
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
        if tasks != _CLOSED:
            with contextlib.suppress(OSError):
                os.set_blocking(tasks, False)
                write_frame(tasks, dumps_task(None))  # a few bytes: written whole or not at all
        _close_ends([tasks, results])
        self._progress[wid] = -1
        if proc is not None:
            reap([proc])  # it holds no task: it reads None and leaves

    def shutdown(self, join_s: float = 2.0) -> None:
        """Stop every worker; see NOTE [shutdown order]. Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop = dumps_task(None)
        for fd in self._tasks:  # 1
            if fd != _CLOSED:
                with contextlib.suppress(OSError):
                    os.set_blocking(fd, False)
                    write_frame(fd, stop)  # a few bytes: written whole or not at all
        _close_ends(self._tasks)
        left = self._goodbyes(time.monotonic() + join_s)  # 2
        _close_ends(self._results)  # 3
        reap([p for wid, p in enumerate(self._procs) if p is not None and wid in left])
        join_or_kill([p for wid, p in enumerate(self._procs) if p is not None and wid not in left], 0.0)
        self._procs = [None] * len(self._procs)
        self._finalizer.detach()
        if self._counters is not None:
            self._counters.close_fd()  # the workers hold their own; the mapping stays for reads

    def _goodbyes(self, deadline: float) -> set[int]:
        """The workers that closed their result pipe or exited before ``deadline``; what they
        sent meanwhile is dropped."""
        poller = select.poll()
        watched: dict[int, int] = {}
        for wid, (fd, proc) in enumerate(zip(self._results, self._procs, strict=True)):
            if proc is not None:
                for watch in (fd, proc.sentinel) if fd != _CLOSED else (proc.sentinel,):
                    poller.register(watch, select.POLLIN)
                    watched[watch] = wid
        left: set[int] = set()
        pending = set(watched.values())
        while pending and (remaining := deadline - time.monotonic()) > 0:
            with contextlib.suppress(InterruptedError):
                for fd, _ in poller.poll(remaining * 1000):
                    wid = watched[fd]
                    if wid in left or (fd == self._results[wid] and not _drained_to_end(fd)):
                        continue
                    left.add(wid)
                    pending.discard(wid)
                    for watch in [w for w, owner in watched.items() if owner == wid]:
                        poller.unregister(watch)
        return left


def _drained_to_end(fd: int) -> bool:
    """Read and drop what waits on ``fd``; ``True`` once its writer has closed it."""
    while True:
        try:
            if not os.read(fd, _PIPE_BYTES):
                return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
