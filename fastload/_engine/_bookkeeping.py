"""Pure bookkeeping of the engine: which worker gets the next task, what is in flight, what a
dead worker leaves behind, and in which order results are handed out.

Nothing here touches a process, a queue or a clock, so every rule is tested without processes.
The dispatch rule reproduces torch's DataLoader exactly (a round-robin cycle over the active
workers; with ``in_order=False``, a worker is skipped while it holds its fair share of tasks),
because which worker builds which batch decides the per-worker random state, and so the content
of randomly augmented batches. Where no batch depends on the worker that builds it (the reader
and the collate say so, and there is no ``worker_init_fn``), :meth:`Dispatcher.pick_in_time`
places a task instead by when it is due: see NOTE [tasks placed in time] in ``_engine.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class Task:
    """One batch to build: its sequence number, the sampler's index (a list of indices, one index,
    or ``None`` for an iterable dataset) and how often a worker died while holding it."""

    seq: int
    index: Any
    deaths: int = 0


@dataclass
class _WorkerBook:
    active: bool = True
    retiring: bool = False  # gets no tasks; leaves once it holds none
    tasks: deque[Task] = field(default_factory=deque)  # FIFO: a worker builds in arrival order
    sent: int = 0  # tasks sent to this worker (this process of it) since it started


class RetryBudgetExceeded(Exception):
    """A task was held by ``max_deaths`` workers that all died; the caller raises a typed error."""

    def __init__(self, task: Task) -> None:
        super().__init__(task)
        self.task = task


class Dispatcher:
    """Tracks tasks between dispatch and the arrival of their result.

    Invariant: ``in_flight`` equals the number of tasks sent to a worker whose result has not
    arrived and that were not dropped, and each task is held by exactly one worker.
    """

    def __init__(self, num_workers: int, *, max_tasks: int, in_order: bool, max_deaths: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for a Dispatcher, got {num_workers}")
        self.num_workers = num_workers
        self.max_tasks = max_tasks
        self.in_order = in_order
        self.max_deaths = max_deaths
        self._books = [_WorkerBook() for _ in range(num_workers)]
        self._cursor = 0  # the round-robin cycle's position, as torch's itertools.cycle
        self.retirements = 0  # workers retiring now (each arrival checks only while one is)
        self._holder: dict[int, int] = {}  # seq -> worker id

    # -- dispatch -------------------------------------------------------------------------------
    def pick_worker(self) -> int | None:
        """The worker that gets the next task, advancing the cycle as torch does; ``None`` when no
        worker is active (or, out of order, every active worker holds its share)."""
        for _ in range(self.num_workers):
            wid = self._cursor
            self._cursor = (self._cursor + 1) % self.num_workers
            book = self._books[wid]
            if not book.active:
                continue
            if self.in_order or len(book.tasks) < self.max_tasks // self._active():
                return wid
        return None

    def pick_in_time(self, finished: Callable[[int], int], build_s: float, due_s: float) -> int | None:
        """The worker for a task due in ``due_s`` seconds (when the consumer will ask for it),
        where a batch takes a worker ``build_s`` to build and ``finished(w)`` says how many of
        the tasks sent to worker ``w`` it has finished: the lowest-numbered active worker that
        will have built it by then, holding no more than one task beyond its even share of
        ``max_tasks``, else the one with the fewest tasks left to build (the lowest-numbered of
        those). See NOTE [tasks placed in time]; ``None`` when no worker is active."""
        best: int | None = None
        fewest = 0
        most = self.max_tasks // self.num_workers + 1  # what one worker may have left
        for wid, book in enumerate(self._books):
            if not book.active:
                continue
            left = book.sent - finished(wid)
            if left < most and (left + 1) * build_s <= due_s:
                return wid
            if best is None or left < fewest:
                best, fewest = wid, left
        return best

    def start_at(self, worker_id: int) -> None:
        """Continue the round-robin cycle at ``worker_id``."""
        self._cursor = worker_id % self.num_workers

    def _active(self) -> int:
        return sum(book.active for book in self._books)

    def assign(self, worker_id: int, task: Task) -> None:
        book = self._books[worker_id]
        book.tasks.append(task)
        book.sent += 1
        self._holder[task.seq] = worker_id

    def replaced(self, worker_id: int) -> None:
        """A fresh process took over worker ``worker_id`` (a respawn): nothing sent to it yet."""
        self._books[worker_id].sent = 0

    # -- arrivals -------------------------------------------------------------------------------
    def complete(self, seq: int) -> Task:
        """A result for ``seq`` arrived; returns its task, no longer held by any worker."""
        wid = self._holder.pop(seq)
        tasks = self._books[wid].tasks
        if tasks and tasks[0].seq == seq:
            return tasks.popleft()
        task = next(t for t in tasks if t.seq == seq)  # results arrive FIFO per worker; tolerate
        tasks.remove(task)
        return task

    def deactivate(self, worker_id: int) -> list[Task]:
        """The worker's iterable dataset is exhausted: it gets no more tasks, and the tasks it
        still holds produce nothing. Returns them, to be skipped."""
        book = self._books[worker_id]
        book.active = False
        dropped = list(book.tasks)
        for task in dropped:
            del self._holder[task.seq]
        book.tasks.clear()
        return dropped

    def reactivate_all(self) -> list[tuple[int, Task]]:
        """A new epoch: every worker (but a retiring one) is active again and the cycle restarts
        at worker 0. Returns the tasks still held, as ``(worker_id, task)``: their results will
        arrive stale."""
        held = [(wid, t) for wid, book in enumerate(self._books) for t in book.tasks]
        for book in self._books:
            book.active = not book.retiring
            book.tasks.clear()
        self._holder.clear()
        self._cursor = 0
        return held

    def lose_worker(self, worker_id: int, culprit: int | None) -> list[Task]:
        """The worker died while building task ``culprit`` (a sequence number, or ``None`` when it
        died between tasks). Its tasks come back, oldest first, for re-dispatch; only the culprit
        is blamed, and when it has now been held by ``max_deaths`` dead workers,
        :class:`RetryBudgetExceeded` is raised for it."""
        book = self._books[worker_id]
        lost = list(book.tasks)
        book.tasks.clear()
        for task in lost:
            del self._holder[task.seq]
        for task in lost:
            if task.seq == culprit:
                task.deaths += 1
                if task.deaths >= self.max_deaths:
                    raise RetryBudgetExceeded(task)
        return lost

    # -- a pool that grows and shrinks (num_workers="auto") --------------------------------------
    def add_worker(self) -> int:
        """A new worker joins the cycle; returns its id (always the next one)."""
        self._books.append(_WorkerBook())
        self.num_workers += 1
        return self.num_workers - 1

    def retire_last(self) -> int:
        """The highest worker gets no more tasks; it leaves (:meth:`remove_last`) once it holds
        none. Returns its id."""
        book = self._books[-1]
        if not book.retiring:
            self.retirements += 1
        book.active, book.retiring = False, True
        return self.num_workers - 1

    def retiring(self, worker_id: int) -> bool:
        return self._books[worker_id].retiring

    def remove_last(self) -> None:
        book = self._books[-1]
        if not book.retiring or book.tasks:
            raise RuntimeError("only a retiring worker that holds no task can be removed")
        self._books.pop()
        self.retirements -= 1
        self.num_workers -= 1
        self._cursor %= self.num_workers

    def tasks_of(self, worker_id: int) -> list[Task]:
        return list(self._books[worker_id].tasks)

    @property
    def in_flight(self) -> int:
        return len(self._holder)

    def is_active(self, worker_id: int) -> bool:
        return self._books[worker_id].active


class ReorderBuffer(Generic[T]):
    """Hands out results by sequence number.

    In order, the item for ``next_seq`` is released only once it arrived; sequence numbers that
    will never produce an item are marked with :meth:`skip`. Out of order, items leave in arrival
    order. ``pending`` counts items held back.
    """

    def __init__(self, *, in_order: bool) -> None:
        self.in_order = in_order
        self.next_seq = 0
        self._held: dict[int, T] = {}
        self._skipped: set[int] = set()
        self._arrivals: deque[int] = deque()

    def push(self, seq: int, item: T) -> None:
        if seq < self.next_seq or seq in self._held:
            raise ValueError(f"sequence number {seq} was already delivered or is held")
        self._held[seq] = item
        if not self.in_order:  # in order, arrivals need no record (it would grow all epoch)
            self._arrivals.append(seq)

    def skip(self, seq: int) -> None:
        self._skipped.add(seq)

    def pop(self) -> tuple[bool, T | None]:
        """``(True, item)`` when an item may be handed out now, else ``(False, None)``."""
        if not self.in_order:
            while self._arrivals:
                seq = self._arrivals.popleft()
                if seq in self._held:
                    return True, self._held.pop(seq)
            return False, None
        while self.next_seq in self._skipped:
            self._skipped.discard(self.next_seq)
            self.next_seq += 1
        if self.next_seq in self._held:
            item = self._held.pop(self.next_seq)
            self.next_seq += 1
            return True, item
        return False, None

    def pop_ready(self) -> list[T]:
        """Every item that may be handed out now, in the order repeated :meth:`pop` calls
        would give them (one call per poll of the workers rather than one per item)."""
        held = self._held
        out: list[T] = []
        if not self.in_order:
            arrivals = self._arrivals
            while arrivals:
                seq = arrivals.popleft()
                if seq in held:
                    out.append(held.pop(seq))
            return out
        skipped, seq = self._skipped, self.next_seq
        while True:
            if seq in skipped:
                skipped.discard(seq)
            elif seq in held:
                out.append(held.pop(seq))
            else:
                break
            seq += 1
        self.next_seq = seq
        return out

    def drain(self) -> list[T]:
        """Remove and return every held item (to release their resources at shutdown)."""
        items = list(self._held.values())
        self._held.clear()
        self._arrivals.clear()
        self._skipped.clear()
        return items

    @property
    def pending(self) -> int:
        return len(self._held)
