"""The engine: wires the pure bookkeeping (``_bookkeeping``) to the worker processes (``_pool``).

Batches are tasks with sequence numbers; results come back in any order and leave in order
through the reorder buffer. A worker that dies has its unfinished tasks re-dispatched to a fresh
worker, so each batch is delivered exactly once, in order; a batch that keeps killing workers
ends the epoch with :class:`~fastload.errors.WorkerCrashedError` instead of respawning forever.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

from fastload._engine._bookkeeping import Dispatcher, ReorderBuffer, RetryBudgetExceeded, Task
from fastload._engine._codec import Codec, GenericCodec
from fastload._engine._deadline import Deadline
from fastload._engine._messages import (
    DONE,
    EXHAUSTED,
    FAILED,
    OK,
    Delivery,
    Kind,
    Reply,
    Resume,
    describe_indices,
    rebuild_exception,
)
from fastload._engine._pool import WorkerPool
from fastload._engine._pool_protocol import Pool, PoolFactory, WorkerDied
from fastload._engine._worker import WorkerSpec
from fastload._engine._zygote import WorkerServer
from fastload._types import StorageCounts
from fastload.errors import WorkerCrashedError

MAX_DEATHS = 3  # workers a single batch may kill before the epoch fails
_BUILD_WEIGHT = 0.125  # weight of the newest build time in the average

# NOTE [tasks placed in time] — Where a batch is the same whichever worker builds it (a reader
# and a collate that say their output depends on nothing of the process, and no
# ``worker_init_fn``: ``_runner.same_in_any_worker``), tasks need not go round-robin as torch's
# do, which keeps each worker's random stream tied to its batches. Round-robin keeps
# every worker in turn: each builds every n-th batch in tens of microseconds, sleeps, and is
# woken by the write of its next task, so on a host with few cores the workers and the consumer
# switch in and out at every batch. Here 2 workers on 2 cores took the consumer 110 µs a batch
# against 50 µs with 1 worker (benchmarks/README.md, "Tasks placed in time"). Instead a task
# goes to the lowest-numbered worker that will have built it by the time the consumer asks for
# it: the tasks it has left plus this one, at the average build time, within the tasks queued
# ahead of it at the consumer's average period per batch (``Pump`` measures it, its waits left
# out), and no more than one task beyond its round-robin share (``prefetch_factor``) left, so
# that a worker slowed by one batch holds up a few at most. As few workers build as keep up,
# each with its next task queued (a write to a busy worker wakes nobody); once the lowest ones
# would be late or full (slow builds, a fast consumer, a worker stuck on a read), tasks go to
# the worker with the fewest left, as evenly as round-robin. Until the first build time is
# known, that is where every task goes.
_DONE = Delivery(DONE, None, None)


class Engine:
    """Runs batch tasks on a pool of worker processes.

    ``put(index)`` dispatches one task (torch's worker choice); ``get(refill)`` blocks until the
    next batch may be delivered; ``codec`` decides what a payload becomes.
    """

    def __init__(
        self,
        *,
        ctx: Any,  # the workers' multiprocessing context; None: the default start method
        num_workers: int,
        max_tasks: int,
        in_order: bool,
        timeout_s: float,  # as the user gave it: the error message quotes it unchanged
        restartable: bool,
        make_spec: Callable[[int, int], WorkerSpec],
        codec: Codec | None = None,
        max_workers: int | None = None,
        start_workers: int | None = None,  # fork this many now, the rest at start_workers()
        pool: PoolFactory | None = None,  # starts the workers; None: processes in ctx
        place_in_time: bool = False,  # NOTE [tasks placed in time]; else torch's round-robin
        server: WorkerServer | None = None,  # forks the workers instead of this process (_zygote.py)
    ) -> None:
        self.epoch = 0
        self.respawns = 0
        self._timeout_s = timeout_s
        self._restartable = restartable
        self._codec: Codec = codec or GenericCodec()
        self._stale: dict[tuple[int, int], tuple[int, Task]] = {}  # (epoch, seq) -> (worker, task)
        self._rng_after: dict[int, tuple[int, Any]] = {}  # seq -> (worker, its random states)
        self._dispatch = Dispatcher(
            num_workers, max_tasks=max_tasks, in_order=in_order, max_deaths=MAX_DEATHS
        )
        self._reorder: ReorderBuffer[tuple[Kind, Task, Any]] = ReorderBuffer(in_order=in_order)
        self._next_seq = 0
        self._idle_deaths = [0] * num_workers  # deaths since the worker last delivered
        self.started = time.monotonic()
        self.busy_s = [0.0] * num_workers  # per worker: seconds spent building batches
        self.read_s = [0.0] * num_workers  # of those, seconds in read_batch (fast path only)
        self.busy_total_s = 0.0  # all workers' busy seconds, retired ones included
        self.storage: StorageCounts | None = None  # the workers' reads of remote storage
        self.retries = 0  # tasks re-dispatched after their worker died
        self._closed = False
        self._max_tasks_per_worker = max_tasks // num_workers
        self._place_in_time = place_in_time
        self._build_s = math.inf  # average seconds a worker takes for a batch (unknown: inf)
        start_pool: PoolFactory = pool or functools.partial(
            WorkerPool, ctx or multiprocessing.get_context(), server=server
        )
        self._pool: Pool = start_pool(
            num_workers,
            lambda wid: make_spec(wid, self.epoch),
            max_workers=max_workers,
            decode=self._codec.result_message,
            start=start_workers,
        )

    @property
    def worker_pids(self) -> list[int]:
        return self._pool.pids

    @property
    def in_flight(self) -> int:
        return self._dispatch.in_flight

    @property
    def pending(self) -> int:
        return self._reorder.pending

    def new_epoch(self, shared_seed: int | None = None, base_seed: int | None = None) -> None:
        """Start over with the same workers (``persistent_workers``). Tasks of the old epoch still
        in flight are remembered: their results arrive tagged with the old epoch and are dropped
        then, once their worker is done writing. ``shared_seed``, ``base_seed``: see ``Resume``."""
        for kind, task, _ in self._reorder.drain():
            if kind is OK:
                self._codec.drop(task.index)
        for wid, task in self._dispatch.reactivate_all():
            self._stale[(self.epoch, task.seq)] = (wid, task)
        self.epoch += 1
        self._rng_after.clear()
        self._reorder = ReorderBuffer(in_order=self._reorder.in_order)
        self._next_seq = 0
        for wid in range(self._dispatch.num_workers):
            self._pool.send(wid, Resume(self.epoch, shared_seed, base_seed))

    def restart_figures(self) -> None:
        """Count busy time, reads, respawns and retries from now on (a parked engine taken by
        another iterator: its figures are that iterator's)."""
        self.started = time.monotonic()
        self.busy_s = [0.0] * len(self.busy_s)
        self.read_s = [0.0] * len(self.read_s)
        self.busy_total_s = 0.0
        self.storage = None
        self.respawns = self.retries = 0

    def all_alive(self) -> bool:
        """Whether every worker is running (none died, none left)."""
        return self._pool.all_alive()

    def dispatch_from(self, worker_id: int) -> None:
        """The next task goes to ``worker_id``, the round-robin continuing from it (a resumed
        epoch gives each batch to the worker that built it in the interrupted run)."""
        self._dispatch.start_at(worker_id)

    def put(self, index: Any, due_s: float | None = None) -> bool:
        """Dispatch one task; ``False`` when no worker is active to take it. ``due_s``: in how
        many seconds the consumer will ask for it, where the engine places tasks in time."""
        if self._place_in_time and due_s is not None:
            wid = self._dispatch.pick_in_time(self._pool.finished, self._build_s, due_s)
        else:
            wid = self._dispatch.pick_worker()
        if wid is None:
            return False
        task = Task(self._next_seq, index)
        self._next_seq += 1
        self._send(wid, task)
        return True

    def _send(self, wid: int, task: Task) -> None:
        self._dispatch.assign(wid, task)
        self._pool.send(wid, self._codec.task_message(self.epoch, task.seq, task.index))

    def get(self, refill: Callable[[], None]) -> Delivery:
        """The next item in order, blocking for it: ``(OK, batch, counts)``, ``(FAILED,
        exception, None)`` for a batch whose building raised (the caller raises it, after
        refilling as torch does), or ``(DONE, None, None)`` once nothing is in flight.
        ``refill`` is called when a worker's iterable dataset ends (torch then dispatches
        another task). The loader's ``timeout`` counts from the last arrival."""
        deadline = Deadline(self._timeout_s)
        while True:
            item = self._next_ready()
            if item is not None:
                return item
            if self._dispatch.in_flight == 0:
                return _DONE
            if self._receive(deadline.block_s(), None, None, refill):
                deadline.restart()

    def collect(
        self,
        refill: Callable[[], None],
        ready: list[tuple[int, int]] | None = None,
        generation: int | None = None,
    ) -> list[Delivery]:
        """Without blocking: handle what the workers have sent, then return every item that may
        now be delivered, in order (see :meth:`get`). For a caller that polls :meth:`watch`
        itself (``_pump.Pump``) and passes what it found."""
        self._receive(0, ready, generation, refill)
        return [self._delivery(item) for item in self._reorder.pop_ready()]

    def _receive(
        self,
        timeout_s: float,
        ready: list[tuple[int, int]] | None,
        generation: int | None,
        refill: Callable[[], None],
    ) -> bool:
        """Handle what the workers sent (waiting up to ``timeout_s`` for something); ``True``
        when a result arrived."""
        arrived = False
        for wid, msg in self._pool.wait(timeout_s, ready, generation):
            if isinstance(msg, WorkerDied):
                self._on_death(wid, msg)
            else:
                self._on_result(wid, msg, refill)
                arrived = True
        return arrived

    def _next_ready(self) -> Delivery | None:
        """The next item the reorder buffer lets out, or ``None``."""
        found, item = self._reorder.pop()
        if not found:
            return None
        assert item is not None
        return self._delivery(item)

    def _delivery(self, item: tuple[Kind, Task, Any]) -> Delivery:
        """What the consumer gets for an item the reorder buffer let out."""
        kind, task, payload = item
        if kind is FAILED:
            return Delivery(FAILED, rebuild_exception(payload, task.seq), None, task.seq)
        batch, counts = self._codec.deliver(task.index, payload)
        return Delivery(OK, batch, counts, task.seq, self._rng_after.pop(task.seq, None))

    def watch(self) -> tuple[int, list[int]]:
        """What to block on until :meth:`collect` has something to do, and the generation of
        that set (it changes when a worker starts or leaves)."""
        fds = self._pool.fds()
        return self._pool.generation, fds

    def _on_result(self, wid: int, msg: Reply, refill: Callable[[], None]) -> None:
        epoch, seq, kind, payload, busy_s, read_s, storage = msg[:7]
        self.busy_total_s += busy_s
        self.busy_s[wid] += busy_s
        if read_s is not None:
            self.read_s[wid] += read_s
        if storage is not None:
            self.storage = storage if self.storage is None else self.storage + storage
        if epoch != self.epoch:
            stale = self._stale.pop((epoch, seq), None)
            if stale is not None:
                self._codec.drop(stale[1].index)
            if self._dispatch.retirements:
                self._leave_if_drained(wid)
            return
        task = self._dispatch.complete(seq)
        self._idle_deaths[wid] = 0
        if kind == OK:
            build = self._build_s
            self._build_s = busy_s if build == math.inf else build + _BUILD_WEIGHT * (busy_s - build)
        if kind == EXHAUSTED:
            self._reorder.skip(seq)
            for dropped in self._dispatch.deactivate(wid):
                self._reorder.skip(dropped.seq)
            refill()
        elif kind == FAILED:
            self._codec.drop(task.index)
            self._reorder.push(seq, (FAILED, task, payload))
        else:
            if msg.rng is not None:
                self._rng_after[seq] = (wid, msg.rng)
            again = self._codec.retry(task.index, payload)
            if again is None:
                self._reorder.push(seq, (OK, task, payload))
            else:  # the codec asks for another try (a bigger slot): to the same worker
                task.index = again
                self._send(wid, task)
        if self._dispatch.retirements:  # only now: the task may have gone to wid again
            self._leave_if_drained(wid)

    def _on_death(self, wid: int, died: WorkerDied) -> None:
        for key in [k for k, (owner, _) in self._stale.items() if owner == wid]:
            self._codec.drop(self._stale.pop(key)[1].index)
        if self._dispatch.retiring(wid):  # it was leaving anyway: its tasks go to the others
            lost = self._lose(wid, died)
            self._leave_if_drained(wid)
            self.retries += len(lost)
            for task in lost:
                self._send(self._dispatch.pick_worker() or 0, task)
            return
        if not self._dispatch.is_active(wid):
            return  # its dataset was exhausted; nothing is lost
        if not self._restartable:
            raise WorkerCrashedError(
                f"DataLoader worker (pid(s) {died.pid}) exited unexpectedly ({died.describe()}); "
                "an iterable dataset's position cannot be recovered, so the epoch stops here"
            )
        lost = self._lose(wid, died)
        # A worker that dies before building anything (worker_init_fn, the dataset's set-up)
        # blames no batch, whether or not tasks were queued for it: count its deaths instead.
        self._idle_deaths[wid] += 1
        if self._idle_deaths[wid] >= MAX_DEATHS:
            raise WorkerCrashedError(
                f"DataLoader worker {wid} died {MAX_DEATHS} times without building a batch "
                f"(last: {died.describe()}); check worker_init_fn and the dataset's set-up"
            )
        self.respawns += 1
        self.retries += len(lost)
        self._pool.respawn(wid)
        self._dispatch.replaced(wid)
        for task in lost:
            self._send(wid, task)

    def _lose(self, wid: int, died: WorkerDied) -> list[Task]:
        """The dead worker's tasks, to send again; raises once its culprit has used up its
        retries."""
        try:
            return self._dispatch.lose_worker(wid, died.culprit)
        except RetryBudgetExceeded as exc:
            task = exc.task
            raise WorkerCrashedError(
                f"DataLoader worker (pid(s) {died.pid}) exited unexpectedly ({died.describe()}) "
                f"while building batch {task.seq} from sample indices "
                f"{describe_indices(task.index)}; {task.deaths} workers died on this batch, "
                "so it is not retried again. Check those samples (a segfault in a decoder, "
                "running out of memory)."
            ) from None

    # -- a pool that grows and shrinks (num_workers="auto") --------------------------------------
    @property
    def num_workers(self) -> int:
        return self._dispatch.num_workers

    def start_workers(self) -> None:
        """Fork the workers that ``start_workers`` held back (see :class:`WorkerPool`)."""
        self._pool.start_rest()

    def add_worker(self) -> None:
        """One more worker; it takes tasks from the next dispatch on."""
        self._dispatch.add_worker()
        self._pool.add()
        self._dispatch.max_tasks = self._max_tasks_per_worker * self._dispatch.num_workers
        for stats in (self.busy_s, self.read_s):
            stats.append(0.0)
        self._idle_deaths.append(0)

    @property
    def staying_workers(self) -> int:
        """Workers that take tasks from the next dispatch on (those not retiring)."""
        return self._dispatch.num_workers - sum(
            self._dispatch.retiring(w) for w in range(self._dispatch.num_workers)
        )

    def retire_worker(self) -> bool:
        """The highest worker gets no more tasks and stops once it has delivered those it holds
        (never below one worker, one retirement at a time). ``True`` when a worker will leave,
        ``False`` when the request was declined."""
        if self.staying_workers <= 1:
            return False
        if self._dispatch.retiring(self._dispatch.num_workers - 1):
            return False  # one retirement at a time
        self._leave_if_drained(self._dispatch.retire_last())
        return True

    def _leave_if_drained(self, wid: int) -> None:
        """A retiring worker leaves once it holds no task, of this epoch or (stale) an earlier
        one: until then it may still write into what those tasks hold."""
        if (
            self._dispatch.retiring(wid)
            and not self._dispatch.tasks_of(wid)
            and all(owner != wid for owner, _ in self._stale.values())
        ):
            self._dispatch.remove_last()
            self._pool.retire_last()
            for stats in (self.busy_s, self.read_s, self._idle_deaths):
                stats.pop()
            self._dispatch.max_tasks = self._max_tasks_per_worker * self._dispatch.num_workers

    def close(self, join_s: float = 2.0) -> None:
        """Stop the workers (waiting up to ``join_s`` for them to finish their current task),
        then free what undelivered tasks hold; see NOTE [shutdown order] in ``_pool.py``.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(join_s)
        leftovers = [task for kind, task, _ in self._reorder.drain() if kind is OK]
        leftovers += [task for _, task in self._dispatch.reactivate_all()]
        leftovers += [task for _, task in self._stale.values()]
        self._stale.clear()
        for task in leftovers:
            self._codec.drop(task.index)
