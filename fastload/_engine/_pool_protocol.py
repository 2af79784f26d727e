"""What the engine needs of its workers, written once: :class:`Pool`, which ``_pool.WorkerPool``
implements with processes and the unit tests with a fake that runs none
(``tests/unit/engine/_fake_pool.py``), and :class:`PoolFactory`, how the engine starts one."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fastload._engine._messages import Reply

if TYPE_CHECKING:
    from fastload._engine._worker import WorkerSpec


class WorkerDied:
    """What :meth:`Pool.wait` reports for a worker that exited without being told to."""

    def __init__(self, pid: int | None, exitcode: int | None, culprit: int | None) -> None:
        self.pid = pid
        self.exitcode = exitcode
        self.culprit = culprit  # sequence number of the task it was building, if any

    def describe(self) -> str:
        code = self.exitcode
        if code is not None and code < 0:
            try:
                name = f" ({signal.Signals(-code).name})"
            except ValueError:
                name = ""
            hint = _SIGNAL_HINTS.get(-code, "")
            return f"pid {self.pid} killed by signal {-code}{name}{hint}"
        return f"pid {self.pid} exited with code {code}"


#: What a worker's death by a signal most often means, for its message.
_SIGNAL_HINTS: dict[int, str] = {
    int(signal.SIGBUS): ": a memory-mapped file it read was truncated or rewritten while being read",
}


class Pool(Protocol):
    """The engine's workers and their channels.

    Workers are numbered ``0 .. n-1``. A worker is *started* (by the factory, the first
    ``start`` of them, or by :meth:`start_rest`), then *live* until :meth:`wait` reports its
    death or :meth:`retire_last` or :meth:`shutdown` stops it. One thread at a time calls these
    methods (the engine's caller serialises them)."""

    #: Bumped whenever the set of descriptors :meth:`fds` returns changes (a worker started,
    #: reported dead, respawned, added or retired): a poll is only valid for the generation it
    #: was made at.
    generation: int

    def all_alive(self) -> bool:
        """Whether every worker is started, its pipes open and its process running."""
        ...

    @property
    def pids(self) -> list[int]:
        """The process ids of the live workers, in worker order."""

    def send(self, wid: int, msg: Any) -> None:
        """Queue ``msg`` for worker ``wid`` without blocking: the codec's task message (a
        :class:`~fastload._engine._messages.TaskMessage`, or bytes the codec encoded), a
        :class:`~fastload._engine._messages.Resume`, or ``None`` (stop). A worker builds its
        tasks in the order they were sent. To a worker whose death :meth:`wait` has reported
        and that is not respawned yet, the message is dropped (the engine sends its tasks again
        after :meth:`respawn`). Never sent to a worker not started yet."""

    def finished(self, wid: int) -> int:
        """How many of the tasks sent to the live worker ``wid`` it has finished (replied to,
        or dropped), read without waiting for its replies: what it still has to build is the
        tasks sent to it less this. Counts from 0 for each worker started."""

    def fds(self) -> list[int]:
        """Descriptors that become readable when :meth:`wait` has something to report, for a
        caller that polls them itself; a new list whenever :attr:`generation` changes (callers
        keep and compare it, and must not change it)."""

    def wait(
        self,
        timeout_s: float,
        ready: list[tuple[int, int]] | None = None,
        generation: int | None = None,
    ) -> list[tuple[int, Reply | WorkerDied]]:
        """What the workers sent since the last call, as ``(worker id, message)``, waiting up
        to ``timeout_s`` while nothing has arrived. ``ready`` and ``generation``: what the
        caller's own poll of :meth:`fds` found, and at which generation (no second poll; one
        of an older generation is ignored). Per worker, in the order sent: one
        :class:`~fastload._engine._messages.Reply` per task it finished, and for a worker that
        died, once, a :class:`WorkerDied` after every reply it managed to send; it is no longer
        live from then on."""

    def start_rest(self, count: int | None = None) -> None:
        """Start ``count`` of the workers not started yet (``None``: all of them)."""

    def respawn(self, wid: int) -> None:
        """Start a fresh worker ``wid`` (the same id, seed and ``worker_init_fn`` call), once
        :meth:`wait` has reported the death of the last one."""

    def add(self) -> int:
        """Start one more worker; returns its id (the next one)."""

    def retire_last(self) -> None:
        """Stop the highest worker, which holds no task: it is sent ``None`` and leaves without
        being waited for; nothing of it is reported any more."""

    def shutdown(self, join_s: float = 2.0) -> None:
        """Stop every worker, waiting up to ``join_s`` for them to finish their current task;
        when it returns, no worker can write into anything the engine owns (NOTE [shutdown
        order] in ``_pool.py``). Idempotent."""


class PoolFactory(Protocol):
    """How the engine starts its pool: ``num_workers`` workers from ``make_spec(worker_id)``
    (called again for each worker respawned or added), the first ``start`` of them now
    (``None``: all), with room for ``max_workers`` in all (``None``: ``num_workers``), each
    reply's bytes decoded by ``decode``."""

    def __call__(
        self,
        num_workers: int,
        make_spec: Callable[[int], WorkerSpec],
        *,
        max_workers: int | None,
        decode: Callable[[bytes], Reply],
        start: int | None,
    ) -> Pool: ...


__all__ = ["Pool", "PoolFactory", "WorkerDied"]
