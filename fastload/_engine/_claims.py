"""Who builds a fast-path batch: its worker, or the main process while it would otherwise wait.

Every regular batch slot ends in a *claim word* (``CLAIM_BYTES``, its own cache line, never part
of a batch). Each time the main process sends a task into a slot it gives the task a new
*ticket* (a number never used before in this arena) and posts ``ticket * 4 + SENT`` in the
slot's word before writing the task to the worker's pipe. Then exactly one of two things
happens, decided by one compare-and-swap on that word:

* the worker, taking the task from its pipe, swaps ``SENT`` for ``WORKER`` and builds it; or
* the main process, about to block in ``next()`` with the task not yet started, swaps ``SENT``
  for ``MAIN`` and builds it itself. The worker, reading the task later, fails its swap and
  drops the message without a reply.

Why it is safe:

* A worker builds only after its swap succeeded, so never a task the main process took.
* The main process takes only a task whose word still holds ``SENT`` under that task's own
  ticket, so never one a worker has started.
* A slot is sent again (a new task, or the same task after its worker died) only once nothing
  can still write for its old task. A message left in a pipe from before then carries an old
  ticket and finds its swap failing. A slot's word therefore never holds a ticket that is not
  the live one.

Ticket 0 means the task takes no part (a temporary slot for an oversize batch, or no atomic
operations on this installation): its worker builds it unconditionally, and the main process
never takes it.
"""

from __future__ import annotations

from typing import Any

try:
    from fastload._engine import _atomic
except ImportError:  # the optional extension was not built: the main process never builds
    _atomic = None  # type: ignore[assignment]

#: Bytes at the end of every regular slot that hold its claim word (one cache line, so that
#: the word shares no line with a batch being written).
CLAIM_BYTES = 64

SENT, WORKER, MAIN = 0, 1, 2  # the states, the word's low two bits


def available() -> bool:
    """Whether tasks can be claimed here (the ``_atomic`` extension was built)."""
    return _atomic is not None


def post(buffer: Any, offset: int, ticket: int) -> None:
    """Mark the word at ``offset`` of ``buffer``: task ``ticket`` is sent, nobody has it yet."""
    assert _atomic is not None
    _atomic.store(buffer, offset, ticket * 4 + SENT)


def claim(buffer: Any, offset: int, ticket: int, by: int) -> bool:
    """Take task ``ticket`` for ``by`` (``WORKER`` or ``MAIN``): ``True`` when nobody had it,
    ``False`` when the other side has it or the slot has moved on to another ticket."""
    assert _atomic is not None
    return _atomic.compare_exchange(buffer, offset, ticket * 4 + SENT, ticket * 4 + by)


def state(buffer: Any, offset: int) -> tuple[int, int]:
    """``(ticket, state)`` held by the word (for tests and error messages)."""
    assert _atomic is not None
    word = _atomic.load(buffer, offset)
    return word >> 2, word & 3
