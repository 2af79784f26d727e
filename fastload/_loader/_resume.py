"""What the consumer has received of an epoch, kept by the loader beyond its iterator's life.

A training loop that stops at ``max_steps`` leaves its ``for`` loop by ``break`` and only then
calls ``loader.state_dict()``: by then the iterator is gone (and its workers with it), so what
the consumer received cannot be read back from the iterator. Each iterator counts into an
:class:`EpochProgress` that the loader holds instead.

With ``in_order=False`` the batches received are not the first ``N`` of the sampler's order:
the progress records their positions (a contiguous prefix and the positions received beyond
it), and a resumed iteration skips those beyond the prefix (:class:`SkipPositions`).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np


class EpochProgress:
    """One iteration of an epoch as the consumer saw it.

    ``epoch`` is the resumable sampler's epoch when the iteration began (``-1`` where it has
    none); ``delivered`` the batches handed to the consumer; ``finished`` whether the iteration
    ended by ``StopIteration`` (the ``for`` loop ran to its end), after which a saved state
    starts the next epoch. Out of order (``ahead`` not ``None``), the positions received in the
    sampler's order of this iteration: all below ``prefix``, and those in ``ahead``.
    """

    __slots__ = ("ahead", "base_seed", "delivered", "epoch", "finished", "last_worker", "prefix", "workers")

    def __init__(self, epoch: int = -1) -> None:
        self.epoch = epoch
        self.delivered = 0
        self.finished = False
        self.prefix = 0
        self.ahead: set[int] | None = None
        #: The workers' base seed, and each worker's random states right after the last batch
        #: it built that the consumer received (the generic path, in order), with the worker
        #: of the last batch received.
        self.base_seed: int | None = None
        self.workers: dict[int, Any] = {}
        self.last_worker: int | None = None

    def track_positions(self, received: Iterable[int] = ()) -> None:
        """Record positions from now on (out of order), ``received`` counting as received."""
        self.ahead = set()
        for position in received:
            self.mark(position)

    def mark(self, position: int) -> None:
        """Position ``position`` of the sampler's order was received."""
        ahead = self.ahead
        assert ahead is not None
        if position != self.prefix:
            ahead.add(position)
            return
        self.prefix += 1
        while self.prefix in ahead:
            ahead.remove(self.prefix)
            self.prefix += 1

    @property
    def consumed(self) -> int:
        """The batches received from the start of the sampler's order with none missing."""
        return self.delivered if self.ahead is None else self.prefix

    def received_ahead(self) -> list[int]:
        """Positions received past :attr:`consumed`, counted from it."""
        return sorted(p - self.prefix for p in self.ahead) if self.ahead else []


class SkipPositions:
    """Stands in for an index sampler for one resumed iteration: yields its items except those
    at ``skip`` (positions in its order), already received before the checkpoint; later
    iterations pass everything through. ``positions[k]`` is the position in the sampler's order
    of the ``k``-th item yielded. Other attributes are the sampler's."""

    def __init__(self, sampler: Any, skip: Iterable[int]) -> None:
        self._sampler = sampler
        self.skip = frozenset(skip)
        self.positions: list[int] = []
        self._used = False

    def __getattr__(self, name: str) -> Any:
        sampler = self.__dict__.get("_sampler")
        if sampler is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(sampler, name)

    def __len__(self) -> int:
        return len(self._sampler) - (0 if self._used else len(self.skip))

    def __iter__(self) -> Iterator[Any]:
        if self._used:
            self.skip, self.positions = frozenset(), []
            return iter(self._sampler)
        self._used = True
        return self._skipping(iter(self._sampler))

    def _skipping(self, items: Iterator[Any]) -> Iterator[Any]:
        for position, item in enumerate(items):
            if position not in self.skip:
                self.positions.append(position)
                yield item

    def position_of(self, seq: int) -> int:
        """The position in the sampler's order of the ``seq``-th item yielded."""
        return self.positions[seq] if self._used and self.skip else seq


def encode_rng(states: tuple[bytes, Any, Any]) -> list[Any]:
    """A worker's random states (``_engine._worker.rng_states``) as JSON-able values."""
    torch_state, (version, words, gauss), numpy_state = states
    name, keys, position, has_gauss, cached = numpy_state
    return [
        base64.b64encode(torch_state).decode("ascii"),
        [version, list(words), gauss],
        [name, np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached)],
    ]


def decode_rng(saved: list[Any]) -> tuple[bytes, Any, Any]:
    """What :func:`encode_rng` encoded."""
    torch_state, (version, words, gauss), (name, keys, position, has_gauss, cached) = saved
    numpy_state = (name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached)
    return base64.b64decode(torch_state), (version, tuple(words), gauss), numpy_state


def encode_worker(state: tuple[tuple[bytes, Any, Any], Any]) -> dict[str, Any]:
    """A worker's state (``_engine._worker.snapshot``) as a plain dict: its random states, and
    its dataset replica's own state (as that gives it)."""
    return {"rng": encode_rng(state[0]), "dataset": state[1]}


def decode_worker(saved: Mapping[str, Any]) -> tuple[tuple[bytes, Any, Any], Any]:
    return decode_rng(saved["rng"]), saved["dataset"]


def worker_state(progress: EpochProgress, num_workers: int) -> dict[str, Any]:
    """The workers' part of a loader state: their base seed, the worker the next batch goes to
    and each worker's random states after its last batch received."""
    last = progress.last_worker
    return {
        "num_workers": num_workers,
        "base_seed": progress.base_seed,
        # A new epoch's round-robin starts at worker 0.
        "next_worker": 0 if last is None or progress.finished else (last + 1) % num_workers,
        "rng": {str(wid): encode_worker(states) for wid, states in sorted(progress.workers.items())},
    }


def worker_resume(saved: Mapping[str, Any]) -> tuple[int, int, dict[int, Any]]:
    """``(base seed, first worker, random states per worker id)`` of :func:`worker_state`."""
    rng = {int(wid): decode_worker(states) for wid, states in saved["rng"].items()}
    return int(saved["base_seed"]), int(saved["next_worker"]), rng


__all__ = [
    "EpochProgress",
    "SkipPositions",
    "decode_rng",
    "decode_worker",
    "encode_rng",
    "encode_worker",
    "worker_resume",
    "worker_state",
]
