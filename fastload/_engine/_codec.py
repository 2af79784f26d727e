"""What the engine does with a task and a worker's payload: the protocol, and the generic
path's codec (the fast path's is ``_slots.SlotCodec``)."""

from __future__ import annotations

from typing import Any, Protocol

from fastload._engine._counts import planned_counts
from fastload._engine._messages import Reply, TaskMessage
from fastload._engine._transport import loads
from fastload._types import Counts


class Codec(Protocol):
    """What the engine does with a task and a worker's payload; the fast path supplies one that
    reserves slots and turns slot descriptors into tensors (``_slots.py``)."""

    def deliver(self, index: Any, payload: Any) -> tuple[Any, Counts | None]:
        """The batch handed to the consumer for a task's payload, and its counts when the
        payload says them (else ``None``): one call, once per batch."""

    def retry(self, index: Any, payload: Any) -> Any:
        """A new index to build the task again with (an oversize batch gets a bigger slot), or
        ``None`` to deliver ``payload``."""

    def drop(self, index: Any) -> None:
        """The task will never be delivered (failed, stale or closed): free what it holds. Only
        called once no worker can still write for it."""

    def task_message(self, epoch: int, seq: int, index: Any) -> Any:
        """What is sent to the worker for a task: a picklable message, or bytes."""

    def result_message(self, data: bytes) -> Reply:
        """A worker's reply from its bytes (the inverse of what the worker's builder wrote)."""


class GenericCodec:
    """The generic path: the payload is the batch itself."""

    def deliver(self, index: Any, payload: Any) -> tuple[Any, Counts | None]:
        return payload, planned_counts(index)

    def retry(self, index: Any, payload: Any) -> Any:
        return None

    def drop(self, index: Any) -> None:
        return None

    def task_message(self, epoch: int, seq: int, index: Any) -> Any:
        return TaskMessage(epoch, seq, index)

    def result_message(self, data: bytes) -> Reply:
        reply: Reply = loads(data)
        return reply
