"""A worker pool without processes, for tests of the engine's and the pump's logic.

:class:`FakePool` keeps the engine's :class:`~fastload._engine._pool_protocol.Pool` contract with no
process and no worker pipe: it records every message the engine sends to each worker, and the
test decides what each worker replies, and when (:meth:`FakePool.reply`, :meth:`FakePool.fail`,
:meth:`FakePool.die`), in any order. Each scripted event also writes a byte to one real pipe,
whose read end is the pool's only descriptor (:meth:`FakePool.fds`), so the pump's drivers poll
it, and block on it, exactly as on real workers; :meth:`FakePool.wait` drains the pipe and hands
over every event scripted so far, in the order scripted. The pool may be scripted from one
thread while the engine thread drives it.

:class:`FakeCodec` is the generic codec plus a record of what the engine asks of it (what it
drops, delivers), and scripted answers to ``retry``.
:class:`Fakes` makes engines and pumps over fake pools and closes them after the test.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastload._engine._codec import GenericCodec
from fastload._engine._engine import Engine
from fastload._engine._messages import FAILED, OK, Kind, Reply, TaskMessage, WorkerFailure
from fastload._engine._pool_protocol import WorkerDied
from fastload._engine._pump import IndexSource, Pump
from fastload._types import Counts

_INDEX = object()  # reply(): the payload is the task's index (the batch "is" its indices)


def batch_indices(k: int, epoch: int = 0) -> tuple[int, int]:
    """The sample indices of the tests' batch ``k`` (a tuple: the fake codec counts them)."""
    return (1000 * epoch + 10 * k, 1000 * epoch + 10 * k + 1)


@dataclass
class FakeWorker:
    """One incarnation of worker ``wid``: a respawn or a re-added id is a new one."""

    wid: int
    pid: int
    spec: Any  # what the engine's make_spec returned for it: (worker id, epoch) in these tests
    inbox: list[Any] = field(default_factory=list)  # every message sent to it, in order
    answered: set[int] = field(default_factory=set)  # positions in inbox of tasks replied to
    dying: bool = False  # die() was scripted
    live: bool = True  # False once wait() reported its death, or it was retired or shut down
    retired: bool = False  # retire_last() stopped it: what it sends is never reported

    def tasks(self) -> list[TaskMessage]:
        return [m for m in self.inbox if isinstance(m, TaskMessage)]

    def unanswered(self) -> list[TaskMessage]:
        """The tasks it was sent and has not replied to, oldest first (FIFO, as a worker)."""
        return [m for _, m in self._unanswered()]

    def _unanswered(self) -> list[tuple[int, TaskMessage]]:
        return [
            (at, m) for at, m in enumerate(self.inbox)
            if isinstance(m, TaskMessage) and at not in self.answered
        ]


class FakeClock:
    """``time.monotonic`` for :class:`~fastload._engine._deadline.Deadline` (patched into
    ``_deadline``), advanced only by a :class:`FakePool` that would block; actions scheduled
    with :meth:`at` run when the clock reaches their time (a reply arriving mid-wait)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, Callable[[], object]]] = []

    def monotonic(self) -> float:
        return self.now

    def at(self, when_s: float, action: Callable[[], object]) -> None:
        self._due.append((when_s, action))
        self._due.sort(key=lambda pair: pair[0])

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or until the next scheduled action, which then runs."""
        until = self.now + seconds
        if self._due and self._due[0][0] <= until:
            when_s, action = self._due.pop(0)
            self.now = max(self.now, when_s)
            action()
        else:
            self.now = until


class FakePool:
    """The engine's pool, scripted by the test (see the module text). Built by the engine
    through the :class:`~fastload._engine._pool_protocol.PoolFactory` signature; with a ``clock``, a
    :meth:`wait` with nothing to report advances it instead of blocking."""

    def __init__(
        self,
        num_workers: int,
        make_spec: Callable[[int], Any],
        *,
        max_workers: int | None,
        decode: Callable[[bytes], Reply],  # unused: the test scripts decoded replies
        start: int | None,
        clock: FakeClock | None = None,
    ) -> None:
        self._clock = clock
        self._make_spec = make_spec
        self._capacity = max(num_workers, max_workers or 0)
        # The test scripts while the engine thread may send and wait; whoever changes what was
        # sent or heard notifies, for the test's await_* calls.
        self._lock = threading.Condition(threading.Lock())
        self._pids = itertools.count(1000)
        self.workers: list[FakeWorker | None] = [None] * num_workers  # None: not started
        self.incarnations: list[FakeWorker] = []  # every worker ever started, in order
        self.lost: list[tuple[int, Any]] = []  # sent to a worker reported dead
        self.unheard: list[tuple[int, Reply | WorkerDied]] = []  # from a retired worker: lost
        self.heard_by: list[str] = []  # per wait() that reported something: the thread's name
        self.sent_by: dict[tuple[int, int], str] = {}  # (epoch, seq) -> the thread that sent it
        self._events: list[tuple[FakeWorker, Reply | WorkerDied]] = []
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
        self._fds = [self._read_fd]
        self.generation = 0
        self.closed = False
        self.start_rest(start)

    # -- the Pool protocol (called by the engine) ---------------------------------------------
    def all_alive(self) -> bool:
        with self._lock:
            return all(w is not None and w.live for w in self.workers)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self.workers if w is not None and w.live]

    def send(self, wid: int, msg: Any) -> None:
        with self._lock:
            assert not self.closed, f"{msg!r} sent to worker {wid} after shutdown"
            worker = self.workers[wid]
            assert worker is not None, f"{msg!r} sent to worker {wid}, not started yet"
            if worker.live:
                worker.inbox.append(msg)
                if isinstance(msg, TaskMessage):
                    self.sent_by.setdefault((msg.epoch, msg.seq), threading.current_thread().name)
                self._lock.notify_all()
            else:
                self.lost.append((wid, msg))

    def finished(self, wid: int) -> int:
        with self._lock:
            worker = self.workers[wid]
            return 0 if worker is None else len(worker.answered)

    def fds(self) -> list[int]:
        return self._fds

    def wait(
        self,
        timeout_s: float,
        ready: list[tuple[int, int]] | None = None,
        generation: int | None = None,
    ) -> list[tuple[int, Reply | WorkerDied]]:
        events = self._take_events()
        if not events and timeout_s > 0 and self._clock is not None:
            self._clock.sleep(timeout_s)
            events = self._take_events()
        elif not events and timeout_s > 0 and not self.closed:
            poller = select.poll()
            poller.register(self._read_fd, select.POLLIN)
            poller.poll(timeout_s * 1000)
            events = self._take_events()
        return events

    def start_rest(self, count: int | None = None) -> None:
        with self._lock:
            unstarted = [wid for wid, w in enumerate(self.workers) if w is None]
            for wid in unstarted[:count] if count is not None else unstarted:
                self._start(wid)

    def respawn(self, wid: int) -> None:
        with self._lock:
            worker = self.workers[wid]
            if worker is None or worker.live:
                raise RuntimeError(f"worker {wid} is not dead; it cannot be respawned")
            self._start(wid)

    def add(self) -> int:
        with self._lock:
            wid = len(self.workers)
            if wid >= self._capacity:
                raise RuntimeError(f"the pool was sized for {self._capacity} workers")
            self.workers.append(None)
            self._start(wid)
            return wid

    def retire_last(self) -> None:
        with self._lock:
            worker = self.workers.pop()
            if worker is not None:
                if worker.live:
                    worker.inbox.append(None)
                worker.live, worker.retired = False, True
            self._changed()

    def shutdown(self, join_s: float = 2.0) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for worker in self.workers:
                if worker is not None and worker.live:
                    worker.inbox.append(None)
                    worker.live = False
            os.close(self._read_fd)
            os.close(self._write_fd)

    # -- the test's side ------------------------------------------------------------------------
    def worker(self, wid: int) -> FakeWorker:
        """Worker ``wid``'s current incarnation."""
        worker = self.workers[wid]
        assert worker is not None, f"worker {wid} was never started"
        return worker

    def seqs(self, wid: int) -> list[int]:
        """The sequence numbers of the tasks sent to worker ``wid`` (current incarnation)."""
        return [m.seq for m in self.worker(wid).tasks()]

    def unanswered(self) -> list[tuple[int, TaskMessage]]:
        """Every live worker's unanswered tasks as ``(worker id, task)``, oldest first."""
        with self._lock:
            return self._held()

    def _held(self) -> list[tuple[int, TaskMessage]]:
        held = [
            (w.wid, m) for w in self.workers if w is not None and w.live and not w.dying
            for m in w.unanswered()
        ]
        return sorted(held, key=lambda pair: (pair[1].epoch, pair[1].seq))

    def await_task(self, seq: int, epoch: int = 0, timeout_s: float = 5.0) -> int:
        """Wait until a live worker holds task ``seq`` of ``epoch`` unanswered (the engine
        thread may still be sending it); returns that worker's id."""

        def holder() -> int | None:
            return next((w for w, m in self._held() if (m.epoch, m.seq) == (epoch, seq)), None)

        with self._lock:
            self._lock.wait_for(lambda: holder() is not None, timeout_s)
            wid = holder()
        assert wid is not None, f"task {seq} of epoch {epoch} was not sent within {timeout_s} s"
        return wid

    def await_heard(self, timeout_s: float = 5.0) -> None:
        """Wait until the engine has taken every event scripted so far."""
        with self._lock:
            assert self._lock.wait_for(lambda: not self._events, timeout_s), "events unheard"

    def reply(
        self,
        wid: int,
        seq: int | None = None,
        *,
        kind: Kind = OK,
        payload: Any = _INDEX,
        busy_s: float = 0.0,
        read_s: float | None = None,
    ) -> TaskMessage:
        """Worker ``wid`` replies to its task ``seq`` (default: its oldest unanswered one), of
        the epoch it was sent in; ``payload`` defaults to the task's index. Returns the task."""
        with self._lock:
            worker = self.worker(wid)
            assert worker.live and not worker.dying, f"worker {wid} cannot reply: it is gone"
            pending = worker._unanswered()
            at, task = pending[0] if seq is None else next(p for p in pending if p[1].seq == seq)
            worker.answered.add(at)
            value = task.index if payload is _INDEX else payload
            self._queue(worker, Reply(task.epoch, task.seq, kind, value, busy_s, read_s))
        return task

    def fail(self, wid: int, seq: int | None, exc: BaseException) -> TaskMessage:
        """Worker ``wid``'s build of task ``seq`` raised ``exc``."""
        with self._lock:
            worker = self.worker(wid)
            task = next(m for m in worker.unanswered() if seq is None or m.seq == seq)
        failure = WorkerFailure(type(exc), str(exc), f"Traceback: {exc!r}", wid, worker.pid, task.index)
        return self.reply(wid, task.seq, kind=FAILED, payload=failure)

    def die(self, wid: int, *, culprit: int | None = None, exitcode: int = -9) -> None:
        """Worker ``wid`` dies, while building task ``culprit`` (``None``: between tasks); the
        death is reported after the replies scripted before it."""
        with self._lock:
            worker = self.worker(wid)
            assert worker.live and not worker.dying, f"worker {wid} is already gone"
            worker.dying = True
            self._queue(worker, WorkerDied(worker.pid, exitcode, culprit))

    # -- inside ---------------------------------------------------------------------------------
    def _start(self, wid: int) -> None:
        worker = FakeWorker(wid, next(self._pids), self._make_spec(wid))
        self.workers[wid] = worker
        self.incarnations.append(worker)
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        self._fds = [self._read_fd]  # a new list for a new generation, as the contract says

    def _queue(self, worker: FakeWorker, event: Reply | WorkerDied) -> None:
        assert not self.closed, "the pool was shut down"
        self._events.append((worker, event))
        with contextlib.suppress(BlockingIOError):
            os.write(self._write_fd, b"\0")

    def _take_events(self) -> list[tuple[int, Reply | WorkerDied]]:
        with self._lock:
            if self.closed:
                return []
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read_fd, 4096):
                    pass
            events: list[tuple[int, Reply | WorkerDied]] = []
            for worker, event in self._events:
                if worker.retired:
                    self.unheard.append((worker.wid, event))
                    continue
                events.append((worker.wid, event))
                if isinstance(event, WorkerDied):
                    worker.live = False
                    self._changed()
            self._events = []
            if events:
                self.heard_by.append(threading.current_thread().name)
            self._lock.notify_all()
            return events


class FakeCodec(GenericCodec):
    """The generic codec (the payload is the batch), recording what the engine asks of it.
    ``retry_with``: an index whose payload is to be built again, with which new index (once)."""

    def __init__(self) -> None:
        self.dropped: Counter[Any] = Counter()  # index -> times drop()ped
        self.delivered: list[Any] = []
        self.retry_with: dict[Any, Any] = {}

    def deliver(self, index: Any, payload: Any) -> tuple[Any, None]:
        self.delivered.append(index)
        return payload, None

    def retry(self, index: Any, payload: Any) -> Any:
        return self.retry_with.pop(index, None)

    def drop(self, index: Any) -> None:
        self.dropped[index] += 1


def _spec(worker_id: int, epoch: int) -> Any:
    """A fake worker's spec: what the engine asked for."""
    return (worker_id, epoch)


class Fakes:
    """Makes engines over fake pools, and pumps over those; :meth:`close` closes them all in
    the shutdown order (pumps first)."""

    def __init__(self) -> None:
        self._engines: list[Engine] = []
        self._pumps: list[Pump] = []

    def engine(
        self,
        *,
        num_workers: int = 2,
        prefetch: int = 2,
        in_order: bool = True,
        timeout_s: float = 0.0,
        restartable: bool = True,
        codec: FakeCodec | None = None,
        max_workers: int | None = None,
        start_workers: int | None = None,
        clock: FakeClock | None = None,
        place_in_time: bool = False,
    ) -> tuple[Engine, FakePool]:
        """An engine whose workers are a :class:`FakePool` (returned with it); each worker's
        spec is ``(worker id, epoch)``."""
        made: list[FakePool] = []

        def start_pool(*args: Any, **kwargs: Any) -> FakePool:
            made.append(FakePool(*args, **kwargs, clock=clock))
            return made[-1]

        engine = Engine(
            ctx=None,
            num_workers=num_workers,
            max_tasks=prefetch * num_workers,
            in_order=in_order,
            timeout_s=timeout_s,
            restartable=restartable,
            make_spec=_spec,
            codec=codec,
            max_workers=max_workers,
            start_workers=start_workers,
            pool=start_pool,
            place_in_time=place_in_time,
        )
        self._engines.append(engine)
        return engine, made[0]

    def pump(self, engine: Engine, source: IndexSource, *, timeout_s: float = 0.0) -> Pump:
        """A pump over ``engine``."""
        pump = Pump(engine, source, lambda batch: Counts(len(batch)), timeout_s)
        self._pumps.append(pump)
        return pump

    def close(self) -> None:
        for pump in self._pumps:
            pump.close()
        for engine in self._engines:
            engine.close()
