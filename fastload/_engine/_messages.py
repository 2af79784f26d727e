"""The messages between the main process and its workers, and what the engine hands out.

Per batch, the main process sends a task and the worker replies once. On the generic path both
are pickles of the types below; on the fast path the two per-batch messages have a binary form
of their own (``_slots.py``) that decodes into the same :class:`Reply`. Everything rarer
(:class:`Resume`, a stop, a failure) is a pickle on either path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastload._types import Counts, StorageCounts


class Kind(enum.IntEnum):
    """What a reply, or an item the engine hands out, is."""

    OK = 0  # a batch (the fast path: its slot descriptor)
    FAILED = 1  # building the batch raised: a WorkerFailure, raised in the consumer in turn
    EXHAUSTED = 2  # the worker's iterable dataset has no more items (no payload)
    DONE = 3  # handed out only: nothing is left this epoch
    ERROR = 4  # handed out only: the epoch cannot go on (raise and stop)


# Module-level names for the hot paths (a module global is cheaper than an enum attribute).
OK, FAILED, EXHAUSTED, DONE, ERROR = Kind.OK, Kind.FAILED, Kind.EXHAUSTED, Kind.DONE, Kind.ERROR


class TaskMessage(NamedTuple):
    """Build batch ``seq`` of ``epoch`` from the sampler's ``index``."""

    epoch: int
    seq: int
    index: Any


class Reply(NamedTuple):
    """A worker's answer to one task: ``payload`` is the batch for ``OK``, a
    :class:`WorkerFailure` for ``FAILED``, ``None`` for ``EXHAUSTED``; ``busy_s`` the seconds it
    spent building, ``read_s`` those of them in reads (``None`` where the builder cannot
    tell); ``storage`` what the build's reads of remote storage cost (``None``: a local
    dataset)."""

    epoch: int
    seq: int
    kind: Kind
    payload: Any
    busy_s: float
    read_s: float | None
    storage: StorageCounts | None = None
    #: The worker's state right after building the batch (the generic path, when the loader
    #: keeps it for resume: ``_worker.snapshot``), ``()`` where it is the one it sent last;
    #: ``None`` otherwise.
    rng: Any = None


class Delivery(NamedTuple):
    """What the engine hands the consumer next: ``(OK, batch, counts)``, ``(FAILED,
    exception, None)`` (the epoch goes on after it), ``(ERROR, exception, None)`` or ``(DONE,
    None, None)``. ``counts`` is ``None`` where the payload does not say them; ``seq`` is the
    batch's position in the epoch's sampler order (-1 for ``ERROR`` and ``DONE``), which out of
    order tells a resume which batches were received."""

    kind: Kind
    value: Any
    counts: Counts | None
    seq: int = -1
    #: ``(worker id, its state right after building this batch)`` where the loader keeps it
    #: for resume (``()``: unchanged since the last batch it built), else ``None``.
    worker: tuple[int, Any] | None = None


@dataclass(frozen=True)
class Resume:
    """Start epoch ``epoch``: re-create the fetcher (an iterable dataset starts over), a
    DataPipe graph seeded first with ``shared_seed`` where one is given (as torch's workers
    seed theirs: every worker the same, so that its shard of a shuffled pipe is its own).
    ``base_seed``: seed every random generator again from it, as a worker started with it
    would be (a parked worker taken by another iterator: NOTE [parked workers])."""

    epoch: int
    shared_seed: int | None = None
    base_seed: int | None = None


@dataclass
class WorkerFailure:
    """An exception raised while building one batch, carried to the main process."""

    exc_type: type[BaseException]
    message: str
    traceback: str
    worker_id: int
    pid: int
    index: Any


def describe_indices(index: Any, limit: int = 16) -> str:
    """A short rendering of a batch's sample indices for error messages."""
    try:
        items = list(index)
    except TypeError:
        return repr(index)
    shown = ", ".join(str(int(i)) if hasattr(i, "__index__") else repr(i) for i in items[:limit])
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return f"[{shown}{more}]"


class _KeyErrorMessage(str):
    """KeyError's ``str()`` is the ``repr()`` of its argument; this keeps a multi-line message
    readable, as torch does."""

    def __repr__(self) -> str:
        return self


def rebuild_exception(failure: WorkerFailure, seq: int) -> BaseException:
    """The worker's exception, of its original type when that type takes a message, with a
    message naming the worker, the batch and the sample indices, and the worker's traceback."""
    name = failure.exc_type.__name__
    msg = (
        f"Caught {name} in DataLoader worker process {failure.worker_id} (pid {failure.pid}) "
        f"while building batch {seq} from sample indices {describe_indices(failure.index)}.\n"
        f"Original {failure.traceback}"
    )
    if failure.exc_type is KeyError:
        return KeyError(_KeyErrorMessage(msg))
    try:
        return failure.exc_type(msg)
    except Exception:
        return RuntimeError(msg)


__all__ = [
    "DONE",
    "ERROR",
    "EXHAUSTED",
    "FAILED",
    "OK",
    "Delivery",
    "Kind",
    "Reply",
    "Resume",
    "TaskMessage",
    "WorkerFailure",
    "describe_indices",
    "rebuild_exception",
]
