"""Exact resume for torch's own samplers: the ones a plain drop-in loader builds.

An epoch of ``SequentialSampler``, ``RandomSampler``, ``DistributedSampler`` or a
``BatchSampler`` over one of them is pinned by a few values: nothing, the seed a
``RandomSampler`` draws from the global RNG at its first item, the state of its generator just
before its draws, or the ``DistributedSampler``'s ``(seed, epoch)``. ``ResumableTorchSampler``
stands in for such an index sampler: it records those values as each epoch begins, making the
draws torch makes at the same moments (so a loader that uses it yields exactly torch's batches
and leaves the RNGs as torch would), and resumes an epoch by iterating a copy pinned to the
saved values and skipping the items already consumed.
"""

from __future__ import annotations

import base64
import copy
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fastload._sampling._batch_options import check_int
from fastload._sampling._state import STATE_FORMAT, check_identity

#: Exact types only: a subclass may draw its randomness otherwise than these values pin.
_KNOWN = (SequentialSampler, RandomSampler, DistributedSampler)
_POSITION_KEYS = ("epoch", "epoch_seed", "generator_state", "batches_consumed")


def resumable_torch_sampler(index_sampler: object) -> ResumableTorchSampler | None:
    """A resumable stand-in for ``index_sampler`` if it is one of torch's own samplers or a
    ``BatchSampler`` over one (``None`` otherwise)."""
    base = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return ResumableTorchSampler(index_sampler) if type(base) in _KNOWN else None


@dataclass(frozen=True)
class _Position:
    """Where an epoch stands: its number, what pins its order (``None`` until drawn) and how
    many items of the index sampler (batches, or samples without a ``BatchSampler``) the
    consumer has received."""

    epoch: int
    epoch_seed: int | None = None
    generator_state: str | None = None
    consumed: int = 0


class _Stream:
    """One iteration of an epoch: the position it started from, what pins its order once its
    first item was asked for, and how many items it has yielded."""

    def __init__(self, start: _Position) -> None:
        self.start = start
        self.epoch_seed = start.epoch_seed
        self.generator_state = start.generator_state
        self.yielded = 0

    def at(self, consumed: int) -> _Position:
        return _Position(
            self.start.epoch, self.epoch_seed, self.generator_state, self.start.consumed + consumed
        )


class ResumableTorchSampler(Sampler[Any]):
    """Yields what torch's index sampler would, and can say where an epoch stands and resume it.

    * ``RandomSampler`` without a generator: at an epoch's first item it makes the draw torch's
      makes (one int64 from the global RNG) and iterates a copy given a generator seeded with
      it. A resumed epoch still makes that draw, so the global RNG advances as in an
      uninterrupted epoch, but uses the saved seed.
    * ``RandomSampler`` with a generator: the generator's state just before the epoch's draws;
      a resumed epoch restores it, so after the epoch the generator is where an uninterrupted
      run leaves it.
    * ``DistributedSampler``: its ``epoch`` (restored by ``load_state_dict``) and ``seed``
      decide the order; its own ``set_epoch`` and this class's both move the epoch, and a
      loaded position is kept only while the epoch stays the saved one. Every rank consumes
      the same number of batches, so one rank's state resumes any rank, but only on the same
      number of replicas: its order depends on it.
    * ``SequentialSampler``: only the count.

    The other samplers' epochs are numbered by ``set_epoch`` (a label: their order comes from the
    RNG), so that ``set_epoch`` with a loaded state's epoch keeps its position and another epoch
    drops it.
    """

    def __init__(self, index_sampler: Any) -> None:
        super().__init__()
        batched = type(index_sampler) is BatchSampler
        self._index = index_sampler
        self._base: Any = index_sampler.sampler if batched else index_sampler
        if type(self._base) not in _KNOWN:
            raise TypeError(
                f"ResumableTorchSampler resumes {', '.join(k.__name__ for k in _KNOWN)} and a "
                f"BatchSampler over one; got {self._name()}"
            )
        self._epoch = 0
        self._pending: _Position | None = None  # set by load_state_dict, used by the next iter
        self._stream: _Stream | None = None  # the latest iteration

    @property
    def batch_size(self) -> int | None:
        """The wrapped ``BatchSampler``'s ``batch_size`` (``None`` without one): what its
        batches can hold, for whoever sizes memory for them."""
        size = getattr(self._index, "batch_size", None) if type(self._index) is BatchSampler else None
        return size if isinstance(size, int) else None

    @property
    def follows_loader_epoch(self) -> bool:
        """Whether a loader moves this sampler to its next epoch at each ``iter()``: not for a
        ``DistributedSampler``, whose own ``epoch`` decides its order (as in torch's loader)."""
        return not self._distributed

    @property
    def epoch(self) -> int:
        return int(self._base.epoch) if self._distributed else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Begin ``epoch`` at the next ``iter()`` (a ``DistributedSampler``'s ``set_epoch`` is
        called); a position loaded in this same epoch is kept."""
        epoch = check_int("epoch", epoch, minimum=0)
        if self._distributed:
            self._base.set_epoch(epoch)
        else:
            self._epoch = epoch
        self._stream = None
        self._live_pending()

    def __len__(self) -> int:
        """Items the next ``iter()`` yields: the epoch's, less those consumed before a loaded
        position."""
        pending = self._live_pending()
        return len(self._index) - (pending.consumed if pending is not None else 0)

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._live_pending(), None
        stream = _Stream(pending if pending is not None else _Position(self.epoch))
        self._stream = stream
        return self._items(stream)

    def _items(self, stream: _Stream) -> Iterator[Any]:
        # A generator, like torch's samplers: nothing is drawn before the first next().
        index = self._pinned(stream)
        for item in itertools.islice(iter(index), stream.start.consumed, None):
            stream.yielded += 1
            yield item

    def _pinned(self, stream: _Stream) -> Any:
        """The index sampler that yields ``stream``'s epoch, its order pinned and recorded."""
        base = self._base
        if type(base) is not RandomSampler:
            return self._index
        if base.generator is None:
            # torch's RandomSampler draws here; a resumed epoch draws too, and discards it.
            drawn = int(torch.empty((), dtype=torch.int64).random_().item())
            if stream.epoch_seed is None:
                stream.epoch_seed = drawn
            twin = copy.copy(base)
            twin.generator = torch.Generator()
            twin.generator.manual_seed(stream.epoch_seed)
            if type(self._index) is not BatchSampler:
                return twin
            batches = copy.copy(self._index)
            batches.sampler = twin
            return batches
        if stream.generator_state is None:
            stream.generator_state = _encode(base.generator.get_state())
        else:
            base.generator.set_state(_decode(stream.generator_state))
        return self._index

    def _live_pending(self) -> _Position | None:
        """The loaded position, unless the sampler has moved to another epoch since."""
        if self._pending is not None and self._pending.epoch != self.epoch:
            self._pending = None
        return self._pending

    # -- exact resume --------------------------------------------------------------------------

    def state_dict(self, *, batches_consumed: int | None = None) -> dict[str, Any]:
        """A JSON-able snapshot from which ``load_state_dict`` resumes exactly.

        ``batches_consumed`` is how many items of the latest ``iter()`` the consumer has
        received (default: how many it yielded); a loader that prefetches passes the number it
        delivered. Before any ``iter()`` of the epoch (also after a ``DistributedSampler``'s own
        ``set_epoch`` moved it), it is the loaded position, or the epoch's start (its order is
        then drawn when it runs, as an uninterrupted run would).
        """
        pending, stream = self._live_pending(), self._stream
        if pending is not None or stream is None or stream.start.epoch != self.epoch:
            start = pending if pending is not None else _Position(self.epoch)
            stream = _Stream(start)
        consumed = (
            stream.yielded
            if batches_consumed is None
            else check_int("batches_consumed", batches_consumed, minimum=0)
        )
        position = stream.at(consumed)
        if position.consumed > len(self._index):
            raise ValueError(
                f"batches_consumed={consumed} exceeds what the iteration of epoch "
                f"{position.epoch} yields: {len(self._index) - stream.start.consumed}"
            )
        return {
            "format": STATE_FORMAT,
            **self._identity(),
            "epoch": position.epoch,
            "epoch_seed": position.epoch_seed,
            "generator_state": position.generator_state,
            "batches_consumed": position.consumed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` continue the saved epoch where it stopped (after
        ``set_epoch`` too, with the saved epoch); later epochs proceed as in an uninterrupted
        run. Raises ``ValueError`` for a state saved with other settings."""
        identity = self._identity()
        saved_replicas = state.get("num_replicas", identity.get("num_replicas"))
        same_kind = state.get("sampler") == identity["sampler"]
        if self._distributed and same_kind and saved_replicas != identity["num_replicas"]:
            raise ValueError(
                f"sampler state was saved on num_replicas={saved_replicas!r} ranks but this "
                f"DistributedSampler has num_replicas={identity['num_replicas']}: its order "
                "depends on the world size, so it resumes exactly only on the same one. Resume "
                "on that many ranks, or use fastload.LengthGroupedBatchSampler, which re-deals "
                "the rest of an epoch over a new world size"
            )
        check_identity(state, identity, required=_POSITION_KEYS)
        position = _Position(
            epoch=check_int("state['epoch']", state["epoch"], minimum=0),
            epoch_seed=self._check_seed(state["epoch_seed"]),
            generator_state=self._check_generator_state(state["generator_state"]),
            consumed=check_int("state['batches_consumed']", state["batches_consumed"], minimum=0),
        )
        if position.consumed > len(self._index):
            raise ValueError(
                f"sampler state says {position.consumed} items of epoch {position.epoch} were "
                f"consumed, but this sampler's epoch has {len(self._index)}"
            )
        unpinned = position.epoch_seed is None and position.generator_state is None
        if position.consumed and self._random and unpinned:
            raise ValueError(
                f"sampler state says {position.consumed} items were consumed but holds neither "
                "epoch_seed nor generator_state: the epoch's order cannot be recovered"
            )
        if self._distributed:
            self._base.set_epoch(position.epoch)
        else:
            self._epoch = position.epoch
        self._pending = position
        self._stream = None

    def _check_seed(self, seed: object) -> int | None:
        if seed is None:
            return None
        if not (self._random and self._base.generator is None):
            raise ValueError(f"sampler state holds epoch_seed={seed!r}, which {self._name()} never draws")
        return check_int("state['epoch_seed']", seed, minimum=0)

    def _check_generator_state(self, encoded: object) -> str | None:
        if encoded is None:
            return None
        generator = self._base.generator if self._random else None
        if generator is None:
            raise ValueError(f"sampler state holds a generator_state, but {self._name()} has no generator")
        if not isinstance(encoded, str):
            raise ValueError(f"state['generator_state'] must be a base64 string; got {type(encoded).__name__}")
        try:
            raw = _decode(encoded)
        except ValueError as exc:
            raise ValueError(f"state['generator_state'] is not valid base64: {exc}") from None
        expected = generator.get_state().numel()
        if raw.numel() != expected:
            raise ValueError(
                f"state['generator_state'] holds {raw.numel()} bytes, but this sampler's generator "
                f"({generator.device}) has a {expected}-byte state; use the same kind of generator"
            )
        return encoded

    def _identity(self) -> dict[str, Any]:
        """What shapes the epochs: a state is only loaded into a sampler with the same."""
        base, index = self._base, self._index
        batched = type(index) is BatchSampler
        identity: dict[str, Any] = {
            "sampler": self._name(),
            "dataset_length": len(base.dataset if self._distributed else base.data_source),
            "batch_size": index.batch_size if batched else None,
            "drop_last": index.drop_last if batched else None,
        }
        if self._random:
            identity.update(
                replacement=base.replacement,
                num_samples=base.num_samples,
                generator=base.generator is not None,
            )
        if self._distributed:
            identity.update(
                num_replicas=base.num_replicas,
                shuffle=base.shuffle,
                seed=base.seed,
                sampler_drop_last=base.drop_last,
            )
        return identity

    def _name(self) -> str:
        base = type(self._base).__name__
        return f"BatchSampler({base})" if type(self._index) is BatchSampler else base

    @property
    def _random(self) -> bool:
        return type(self._base) is RandomSampler

    @property
    def _distributed(self) -> bool:
        return type(self._base) is DistributedSampler


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(encoded: str) -> torch.Tensor:
    raw = base64.b64decode(encoded.encode("ascii"), validate=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
