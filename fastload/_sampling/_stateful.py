"""Exact resume for a sampler that keeps its own position (torchdata's convention: ``state_dict()``
and ``load_state_dict(state)``, the next ``iter()`` continuing from a loaded state).

Such a sampler's ``state_dict()`` tells where its latest iterator stands, and a loader draws
batches ahead of the consumer (prefetch), so the sampler's state when a checkpoint is taken is
past what the consumer received. :class:`StatefulSamplerStandIn` records the sampler's state
right after each batch is drawn; the state for ``N`` batches received is the one recorded after
the ``N``-th was drawn.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import BatchSampler, Sampler

from fastload._sampling._batch_options import check_int

#: States kept of an iteration's latest drawn batches: more than a loader ever draws ahead.
_KEPT = 4096


def keeps_own_position(obj: Any) -> bool:
    """Whether ``obj`` has torchdata's ``state_dict()``/``load_state_dict(state)`` (a
    ``state_dict`` that takes ``batches_consumed`` is fastload's own convention instead)."""
    state_dict, load = getattr(type(obj), "state_dict", None), getattr(type(obj), "load_state_dict", None)
    if not (callable(state_dict) and callable(load)):
        return False
    try:
        parameters = inspect.signature(state_dict).parameters
    except (TypeError, ValueError):
        return True
    return "batches_consumed" not in parameters


def stateful_sampler(index_sampler: Any) -> StatefulSamplerStandIn | None:
    """A stand-in for ``index_sampler`` if it keeps its own position, or is torch's
    ``BatchSampler`` over a sampler that does (``None`` otherwise)."""
    if keeps_own_position(index_sampler):
        return StatefulSamplerStandIn(index_sampler, index_sampler)
    inner = index_sampler.sampler if type(index_sampler) is BatchSampler else None
    if inner is not None and keeps_own_position(inner):
        return StatefulSamplerStandIn(index_sampler, inner)
    return None


class StatefulSamplerStandIn(Sampler[Any]):
    """Yields what ``index_sampler`` yields and saves, for a count of batches received, the
    state ``stateful`` (the index sampler itself, or the sampler a ``BatchSampler`` batches)
    had right after that many were drawn (see the module text).

    Its epochs are the sampler's own: a loader does not move them (``follows_loader_epoch``),
    and ``set_epoch`` is passed on to a sampler that has one.
    """

    follows_loader_epoch = False

    def __init__(self, index_sampler: Any, stateful: Any) -> None:
        super().__init__()
        self._index = index_sampler
        self._stateful = stateful
        self._drawn: deque[tuple[int, Any]] | None = None  # (batches drawn, state), latest iter()
        self._start: Any = None  # the state as the latest iter() began

    @property
    def batch_size(self) -> int | None:
        """The ``BatchSampler``'s ``batch_size`` (``None`` without one), for slot sizing."""
        size = getattr(self._index, "batch_size", None) if type(self._index) is BatchSampler else None
        return size if isinstance(size, int) else None

    @property
    def epoch(self) -> int:
        """-1: the sampler's epochs are its own (a loader's count does not apply)."""
        return -1

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self._stateful, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._drawn = None

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[Any]:
        items = iter(self._index)
        self._start = self._stateful.state_dict()
        drawn: deque[tuple[int, Any]] = deque(maxlen=_KEPT)
        self._drawn = drawn
        return self._recorded(items, drawn)

    def _recorded(self, items: Iterator[Any], drawn: deque[tuple[int, Any]]) -> Iterator[Any]:
        for count, item in enumerate(items, start=1):
            drawn.append((count, self._stateful.state_dict()))
            yield item

    def state_dict(self, *, batches_consumed: int | None = None) -> dict[str, Any]:
        """The sampler's own state after ``batches_consumed`` batches of the latest ``iter()``
        (default: all it yielded), under ``"state"``."""
        drawn = self._drawn
        if drawn is None:
            return self._dump(self._stateful.state_dict())
        if batches_consumed is None:
            consumed = drawn[-1][0] if drawn else 0
        else:
            consumed = check_int("batches_consumed", batches_consumed, minimum=0)
        if consumed == 0:
            return self._dump(self._start)
        for count, state in drawn:
            if count == consumed:
                return self._dump(state)
        raise ValueError(
            f"batches_consumed={consumed}: {type(self._stateful).__name__}'s state is kept for "
            f"the {len(drawn)} batches drawn last (up to {drawn[-1][0] if drawn else 0}) only"
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the sampler's own saved state into it: its next ``iter()`` continues there."""
        name = type(self._stateful).__name__
        if state.get("sampler") != name or "state" not in state:
            raise ValueError(
                f"sampler state was saved by {state.get('sampler')!r}, not by this loader's {name} "
                f"(its own state_dict/load_state_dict); got keys {sorted(state)}"
            )
        self._stateful.load_state_dict(state["state"])
        self._drawn = None

    def _dump(self, state: Any) -> dict[str, Any]:
        return {"sampler": type(self._stateful).__name__, "state": state}


__all__ = ["StatefulSamplerStandIn", "keeps_own_position", "stateful_sampler"]
