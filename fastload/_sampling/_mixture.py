"""The mixture plan: which source each slot of each batch comes from, step by step, and which
samples fill them.

1. **Weights by step.** ``MixtureWeights`` gives the normalized weights in force at a step (a
   per-rank training step, counted from the start of the run): fixed proportions, pieces
   ``(step, weights)``, or a callable, overridden from their step on by the changes
   ``set_proportions`` recorded.
2. **Composition.** Batch after batch, each source gets ``floor`` of its deficit (its weight
   times the batch's rows, minus what it is ahead), the rows left over going to the largest
   remainders. A source is never more than one sample ahead of or behind its weights over the
   batches so far, so over any window of batches it is within one sample at each end. A source
   that runs out follows the policy: ``"repeat"`` starts a new seeded pass over it, ``"stop"``
   ends the epoch before the batch it cannot fill, ``"renormalize"`` gives its weight to the
   others.
3. **Samples.** Each source is a stream: seeded permutations of its samples, pass after pass.
   With ``batch_size``, each window of ``window`` batches takes its sources' next samples, sorts
   each source's by length and deals them out in a seeded random order of the window's
   batches, so a batch holds about the same length quantile of every source. With
   ``max_tokens``, each window's samples are sorted per source and cut front to back into the
   largest batches whose padded size fits (shortest batches first within a window).

A plan may be continued from a global batch on (``continue_plan``): the batches before stay as
they were, the rest is planned anew from the samples not yet in a batch. A resize continues with
the samples the plan still held (the epoch keeps its samples); a change of weights continues
with the sources' streams.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._sampling._epoch_plan import epoch_rng

MIXTURE_POLICIES = ("repeat", "stop", "renormalize")

#: Random streams of one (seed, epoch) beyond ``_plan``'s and ``_shards``' (0 to 3).
STREAM_DEAL = 4
STREAM_SOURCE = 5  # + the source's number * 4096 + its pass

_EMPTY = np.zeros(0, dtype=np.int64)


def as_weight_vector(name: str, values: object, size: int) -> tuple[float, ...]:
    """``values`` as ``size`` finite weights >= 0, not all 0."""
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be {size} numbers (one weight per source); got {values!r}") from error
    if array.shape != (size,):
        raise ValueError(f"{name} must hold {size} weights, one per source; got shape {array.shape}")
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{first}] is {array[first]}; weights must be finite and >= 0")
    if array.sum() <= 0:
        raise ValueError(f"{name} must not all be 0; got {array.tolist()}")
    return tuple(float(x) for x in array)


class MixtureWeights:
    """The weights in force at every step: ``proportions`` (fixed weights, pieces ``(step,
    weights)`` holding from that step on, or a callable ``step -> weights``), overridden by the
    recorded ``changes`` ``(step, weights)`` from their step on."""

    def __init__(self, proportions: object, size: int) -> None:
        self.size = size
        self.function: Callable[[int], Any] | None = None
        self.pieces: list[tuple[int, tuple[float, ...]]] = []
        if callable(proportions):
            self.function = proportions
        elif _looks_like_pieces(proportions):
            previous = -1
            pieces: Sequence[Any] = proportions  # type: ignore[assignment]
            for number, piece in enumerate(pieces):
                if not isinstance(piece, (tuple, list)) or len(piece) != 2:
                    raise TypeError(
                        f"proportions[{number}] must be a (step, weights) pair; got {piece!r}"
                    )
                step, weights = piece
                if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
                    raise TypeError(f"proportions[{number}]'s step must be an int >= 0; got {step!r}")
                if step <= previous:
                    raise ValueError(
                        f"proportions[{number}] starts at step {step}, not after the previous "
                        f"piece's step {previous}; give the pieces in increasing step order"
                    )
                if number == 0 and step != 0:
                    raise ValueError(
                        f"proportions[0] starts at step {step}; the first piece must start at "
                        "step 0, so that every step has weights"
                    )
                previous = int(step)
                self.pieces.append(
                    (int(step), as_weight_vector(f"proportions[{number}] weights", weights, size))
                )
        else:
            self.pieces.append((0, as_weight_vector("proportions", proportions, size)))
        self._piece_steps = [step for step, _ in self.pieces]
        self.changes: list[tuple[int, tuple[float, ...]]] = []
        self._cache: dict[int, tuple[float, ...]] = {}

    def identity(self) -> Any:
        """What identifies the schedule in a state (a callable only by its name)."""
        if self.function is not None:
            return {"callable": getattr(self.function, "__qualname__", type(self.function).__name__)}
        return [[step, list(weights)] for step, weights in self.pieces]

    def with_changes(self, changes: Sequence[tuple[int, tuple[float, ...]]]) -> MixtureWeights:
        copy = object.__new__(MixtureWeights)
        copy.__dict__.update(self.__dict__)
        copy.changes = sorted(changes, key=lambda change: change[0])
        copy._cache = {}
        return copy

    def run_end(self, step: int, *, limit: int) -> int:
        """The first step after ``step`` (at most ``limit``) whose weights may differ."""
        ends = [limit]
        ends += [change for change, _ in self.changes if change > step]
        if self.function is None:
            later = bisect.bisect_right(self._piece_steps, step)
            if later < len(self._piece_steps):
                ends.append(self._piece_steps[later])
            return min(ends)
        if any(change <= step for change, _ in self.changes):
            return min(ends)
        self.at(step)  # checks the weights once
        first = tuple(self.function(step))
        end = min(ends)
        probe = step + 1
        # The callable's own output compared, unchecked: equal to weights already checked.
        while probe < end and tuple(self.function(probe)) == first:
            probe += 1
        return probe

    def at(self, step: int) -> tuple[float, ...]:
        """The normalized weights in force at ``step``."""
        cached = self._cache.get(step)
        if cached is not None:
            return cached
        raw: Any = None
        for change_step, weights in reversed(self.changes):
            if change_step <= step:
                raw = weights
                break
        if raw is None:
            if self.function is not None:
                raw = _quick_weights(self.function(step), self.size)
                if raw is None:  # the full check names what is wrong
                    raw = as_weight_vector(f"proportions({step})", self.function(step), self.size)
            else:
                raw = self.pieces[bisect.bisect_right(self._piece_steps, step) - 1][1]
        total = math.fsum(raw)
        normalized = tuple(value / total for value in raw)
        if len(self._cache) > 1 << 16:
            self._cache.clear()
        self._cache[step] = normalized
        return normalized


def _quick_weights(values: Any, size: int) -> tuple[float, ...] | None:
    """``values`` as weights if they plainly are (``size`` finite numbers >= 0, not all 0),
    without numpy: a callable schedule is asked once per step."""
    try:
        weights = tuple(float(value) for value in values)
    except (TypeError, ValueError):
        return None
    if len(weights) != size or not all(0.0 <= value < math.inf for value in weights):
        return None
    return weights if math.fsum(weights) > 0 else None


def _looks_like_pieces(value: object) -> bool:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        return False
    first = value[0]
    return isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(
        first[1], (Sequence, np.ndarray)
    )


@dataclass
class Streams:
    """The sources' sample streams of one epoch: ``heads[d]`` first, then seeded passes over
    ``members[d]`` from pass position ``drawn[d]`` on (with ``passes``: more passes after the
    first; else the first pass ends the stream)."""

    members: list[npt.NDArray[np.int64]]
    heads: list[npt.NDArray[np.int64]]
    drawn: list[int]
    seed: int
    epoch: int
    shuffle: bool
    passes: bool
    offsets: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    passes_made: dict[int, tuple[int, npt.NDArray[np.int64]]] = field(default_factory=dict)

    def available(self, source: int) -> float:
        members = self.members[source].size
        tail = math.inf if self.passes and members else max(0, members - self.drawn[source])
        return self.heads[source].size + tail

    def take(self, source: int, count: int) -> npt.NDArray[np.int64]:
        head = self.heads[source]
        if count <= head.size:
            self.heads[source] = head[count:]
            return head[:count]
        self.heads[source] = _EMPTY
        rest = self._from_passes(source, self.drawn[source], count - head.size)
        self.drawn[source] += rest.size
        return np.concatenate((head, rest)) if head.size else rest

    def give_back(self, source: int, samples: npt.NDArray[np.int64]) -> None:
        if samples.size:
            self.heads[source] = np.concatenate((samples, self.heads[source]))

    def _from_passes(self, source: int, start: int, count: int) -> npt.NDArray[np.int64]:
        members = self.members[source]
        size = members.size
        if count <= 0 or size == 0:
            return _EMPTY
        parts = []
        position = start
        while count > 0:
            number, offset = divmod(position, size)
            if number and not self.passes:
                break
            order = self._pass(source, number)
            piece = order[offset : offset + count]
            parts.append(piece)
            count -= piece.size
            position += piece.size
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _pass(self, source: int, number: int) -> npt.NDArray[np.int64]:
        members = self.members[source]
        if not self.shuffle:
            return members
        kept = self.passes_made.get(source)
        if kept is not None and kept[0] == number:
            return kept[1]
        rng = epoch_rng(self.seed, self.epoch, STREAM_SOURCE + source * 4096 + number)
        order = members[rng.permutation(members.size)]
        self.passes_made[source] = (number, order)  # the latest pass: read in pieces
        return order


@dataclass
class Segment:
    """Where a part of an epoch's plan begins: global batch ``position``, at per-rank ``step``,
    dealt over ``replicas`` ranks."""

    position: int
    step: int
    replicas: int


@dataclass
class MixturePlan:
    """One epoch's global mixture batches (a ``_stream.GlobalPlan``): batch ``b`` is
    ``indices[starts[b]:stops[b]]``; ``counts[b, d]`` and ``tokens[b, d]`` are source ``d``'s
    samples and tokens in it; ``errors[b]`` is every source's count minus its target after batch
    ``b``; the streams hold what no batch has taken."""

    indices: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    stops: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    errors: npt.NDArray[np.float64]
    padded: npt.NDArray[np.int64]
    segments: list[Segment]
    streams: Streams
    rows: int = 0
    cumulative: dict[str, npt.NDArray[np.int64]] = field(default_factory=dict)

    @property
    def num_batches(self) -> int:
        return int(self.starts.size)

    def batch(self, position: int) -> npt.NDArray[np.int64]:
        """The samples of batch ``position``, in ascending padded length (read-only)."""
        view = self.indices[self.starts[position] : self.stops[position]]
        ordered = view[np.argsort(self.padded[view], kind="stable")]
        ordered.flags.writeable = False
        return ordered

    def step_of(self, position: int) -> int:
        """The per-rank step at which global batch ``position`` is consumed."""
        segment = self.segments[0]
        for candidate in self.segments:
            if candidate.position <= position:
                segment = candidate
        return segment.step + (position - segment.position) // segment.replicas

    def totals(self, stop: int, start: int = 0) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Samples and tokens per source of batches ``start .. stop - 1``."""
        if not self.cumulative:
            zero = np.zeros((1, self.counts.shape[1]), dtype=np.int64)
            self.cumulative["samples"] = np.concatenate((zero, np.cumsum(self.counts, axis=0)))
            self.cumulative["tokens"] = np.concatenate((zero, np.cumsum(self.tokens, axis=0)))
        stop = min(max(stop, 0), self.num_batches)
        start = min(max(start, 0), stop)
        samples, tokens = self.cumulative["samples"], self.cumulative["tokens"]
        return samples[stop] - samples[start], tokens[stop] - tokens[start]


@dataclass(frozen=True)
class MixtureSettings:
    """What shapes every mixture plan besides the streams and the steps."""

    source_of: npt.NDArray[np.int64]  # the source of every global index
    padded: npt.NDArray[np.int64]
    token_lengths: npt.NDArray[np.int64]  # tokens a sample brings (after truncation)
    batch_size: int | None
    max_tokens: int | None
    window: int | None
    shuffle: bool
    drop_last: bool
    policy: str
    warmup: Any  # BatchSizeWarmup | None
    mean_padded: float


def compose(
    settings: MixtureSettings,
    weights: MixtureWeights,
    streams: Streams,
    segments: list[Segment],
    first_position: int,
    errors: list[float],
    slot_limit: float,
    policy: str,
) -> MixturePlan:
    """Plan batches from global position ``first_position`` on (see the module text)."""
    if settings.max_tokens is None:
        return _compose_rows(settings, weights, streams, segments, first_position, errors, slot_limit, policy)
    return _compose_budget(settings, weights, streams, segments, first_position, errors, slot_limit, policy)


class _Counter:
    """The composition of one batch after another (step 2 of the module text)."""

    def __init__(self, weights: MixtureWeights, streams: Streams, errors: list[float], policy: str) -> None:
        self.weights = weights
        self.size = weights.size
        self.errors = list(errors)
        self.policy = policy
        self.available = [streams.available(d) for d in range(self.size)]
        self.exhausted = [False] * self.size

    def active_weights(self, step: int) -> list[float] | None:
        raw = self.weights.at(step)
        if self.policy in ("renormalize", "drain"):
            kept = [0.0 if self.available[d] <= 0 else raw[d] for d in range(self.size)]
            total = math.fsum(kept)
            if total <= 0 and self.policy == "drain":  # the samples left go, whatever the weights
                kept = [float(max(self.available[d], 0)) for d in range(self.size)]
                total = math.fsum(kept)
            if total <= 0:
                return None
            return [value / total for value in kept]
        return list(raw)

    def split(self, rows: int, weights: list[float]) -> list[int] | None:
        """Each source's count in a batch of ``rows`` (``None``: ``"stop"`` ends the epoch)."""
        size = self.size
        deficits = [weights[d] * rows - self.errors[d] for d in range(size)]
        counts = [max(0, math.floor(value)) if weights[d] > 0 else 0 for d, value in enumerate(deficits)]
        self._settle(counts, deficits, weights, rows)
        if self.policy == "repeat":
            return counts
        over = [d for d in range(size) if counts[d] > self.available[d]]
        if not over:
            return counts
        if self.policy == "stop":
            return None
        # renormalize: the source gives what it has, the others share the rest by weight
        weights = list(weights)
        while over:
            for d in over:
                counts[d] = int(self.available[d])
                weights[d] = 0.0
            total = math.fsum(weights)
            rest = rows - sum(counts)
            if total <= 0 or rest <= 0:
                return counts
            share = [value / total for value in weights]
            fixed = {d for d in range(size) if weights[d] == 0.0}
            deficits = [share[d] * rest - self.errors[d] if d not in fixed else 0.0 for d in range(size)]
            extra = [max(0, math.floor(value)) if d not in fixed else 0 for d, value in enumerate(deficits)]
            self._settle(extra, deficits, share, rest)
            for d in range(size):
                if d not in fixed:
                    counts[d] = extra[d]
            over = [d for d in range(size) if counts[d] > self.available[d]]
        return counts

    @staticmethod
    def _settle(counts: list[int], deficits: list[float], weights: list[float], rows: int) -> None:
        short = rows - sum(counts)
        if short > 0:
            order = sorted(
                (d for d in range(len(counts)) if weights[d] > 0),
                key=lambda d: (counts[d] - deficits[d], d),
            )
            for position in range(short):
                counts[order[position % len(order)]] += 1
        elif short < 0:
            order = sorted(
                (d for d in range(len(counts)) if counts[d] > 0),
                key=lambda d: (deficits[d] - counts[d], d),
            )
            at = 0
            while short < 0:
                d = order[at % len(order)]
                if counts[d] > 0:
                    counts[d] -= 1
                    short += 1
                at += 1

    def commit(self, counts: list[int], rows: int, weights: list[float]) -> None:
        for d in range(self.size):
            self.errors[d] += counts[d] - weights[d] * rows
            self.available[d] -= counts[d]


def _step_of(segments: list[Segment], position: int) -> int:
    segment = segments[-1]
    return segment.step + (position - segment.position) // segment.replicas


def _rows_at(settings: MixtureSettings, step: int) -> int:
    target = settings.batch_size if settings.max_tokens is None else settings.max_tokens
    assert target is not None
    return target if settings.warmup is None else min(target, settings.warmup.size_at(step))


def _compose_rows(
    settings: MixtureSettings,
    weights: MixtureWeights,
    streams: Streams,
    segments: list[Segment],
    first_position: int,
    errors: list[float],
    slot_limit: float,
    policy: str,
) -> MixturePlan:
    counter = _Counter(weights, streams, errors, policy)
    size = weights.size
    count_runs: list[npt.NDArray[np.int64]] = []
    error_runs: list[npt.NDArray[np.float64]] = []
    used = 0
    position = first_position
    while used < slot_limit:
        step = _step_of(segments, position)
        active = counter.active_weights(step)
        if active is None:
            break
        rows = int(min(_rows_at(settings, step), slot_limit - used))
        if policy in ("renormalize", "drain"):
            rows = int(min(rows, sum(counter.available[d] for d in range(size) if active[d] > 0)))
        if rows <= 0:
            break
        run = _run(settings, weights, segments, counter, position, step, active, rows, slot_limit - used)
        if run is not None:
            counts_run, errors_run = run
            count_runs.append(counts_run)
            error_runs.append(errors_run)
            used += int(counts_run.sum())
            position += counts_run.shape[0]
            continue
        counts = counter.split(rows, active)
        if counts is None or not sum(counts):
            break
        rows = sum(counts)
        counter.commit(counts, rows, active)
        count_runs.append(np.array([counts], dtype=np.int64))
        error_runs.append(np.array([counter.errors], dtype=np.float64))
        used += rows
        position += 1
    counts_array = np.concatenate(count_runs) if count_runs else np.zeros((0, size), dtype=np.int64)
    all_errors = np.concatenate(error_runs) if error_runs else np.zeros((0, size))
    rows_array = counts_array.sum(axis=1)
    if (
        settings.drop_last
        and rows_array.size
        and settings.batch_size is not None
        and rows_array[-1] < _rows_at(settings, _step_of(segments, position - 1))
    ):
        counts_array, rows_array = counts_array[:-1], rows_array[:-1]
        all_errors = all_errors[:-1]
    # Step 3: each source's samples, window by window, sorted by length and dealt out.
    num = rows_array.size
    window = num if settings.window is None else settings.window
    window = max(1, window)
    window_of_batch = np.arange(num, dtype=np.int64) // window
    if settings.shuffle and num > 1:
        rng = epoch_rng(streams.seed, streams.epoch, STREAM_DEAL + 16 * first_position)
        keys = window_of_batch * (num + 1) + rng.permutation(num)
        quantile_order = np.argsort(keys, kind="stable")
    else:
        quantile_order = np.arange(num, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(rows_array)[:-1])).astype(np.int64) if num else _EMPTY
    total = int(rows_array.sum())
    indices = np.empty(total, dtype=np.int64)
    offset_in_batch = np.cumsum(counts_array, axis=1) - counts_array
    padded = settings.padded
    for d in range(size):
        per_batch = counts_array[:, d]
        needed = int(per_batch.sum())
        if not needed:
            continue
        samples = streams.take(d, needed)
        labels = np.repeat(window_of_batch, per_batch)
        ordered = _sort_by_label_and_length(labels, padded[samples], samples)
        in_order = per_batch[quantile_order]
        batch_of = np.repeat(quantile_order, in_order)
        rank = np.arange(needed, dtype=np.int64) - np.repeat(np.cumsum(in_order) - in_order, in_order)
        indices[starts[batch_of] + offset_in_batch[batch_of, d] + rank] = ordered
    stops = starts + rows_array
    return _finish(settings, indices, starts, stops, counts_array, all_errors, segments, streams)


def _run(
    settings: MixtureSettings,
    weights: MixtureWeights,
    segments: list[Segment],
    counter: _Counter,
    position: int,
    step: int,
    active: list[float],
    rows: int,
    slots_left: float,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]] | None:
    """The compositions of the batches from ``position`` on that share ``active`` weights and
    ``rows``, at once: each source's count over the run's first ``k`` batches is the largest
    remainder apportionment of its targets (``k * rows * weight`` minus what it was ahead),
    which keeps every source within one sample of them. ``None`` where the loop must decide:
    a run of one batch, a source's count that would have to shrink, or a source that runs out
    (the policy then acts batch by batch)."""
    segment = segments[-1]
    end_step = weights.run_end(step, limit=step + 1_000_000)
    warmup = settings.warmup
    if warmup is not None and step < warmup.steps:
        return None
    end_position = segment.position + (end_step - segment.step) * segment.replicas
    shares = np.array(active, dtype=np.float64)
    fill = math.inf
    if counter.policy != "repeat":  # up to about where the first source runs out
        fill = min(
            counter.available[d] / (rows * shares[d]) for d in range(weights.size) if shares[d] > 0
        ) + 2
    batches = int(min(end_position - position, slots_left // rows, fill, 1 << 22))
    if batches < 2:
        return None
    errors = np.array(counter.errors, dtype=np.float64)
    steps = np.arange(1, batches + 1, dtype=np.float64)[:, None]
    targets = steps * (rows * shares)[None, :] - errors[None, :]
    floors = np.floor(targets)
    floors[:, shares <= 0] = 0
    short = (np.arange(1, batches + 1) * rows - floors.sum(axis=1)).astype(np.int64)
    remainders = np.where(shares > 0, targets - floors, -np.inf)
    order = np.argsort(-remainders, axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(weights.size)[None, :].repeat(batches, axis=0), axis=1)
    cumulative = floors.astype(np.int64) + (ranks < short[:, None])
    if (short < 0).any() or (short > int((shares > 0).sum())).any() or (cumulative < 0).any():
        return None
    counts = np.diff(cumulative, axis=0, prepend=np.zeros((1, weights.size), dtype=np.int64))
    if (counts < 0).any():
        negative = int(np.flatnonzero((counts < 0).any(axis=1))[0])
        if negative < 2:
            return None
        counts, cumulative = counts[:negative], cumulative[:negative]
    totals = cumulative[-1]
    available = np.array(counter.available, dtype=np.float64)
    if counter.policy != "repeat" and (totals > available).any():
        fits = (cumulative <= available[None, :]).all(axis=1)
        keep = int(np.argmin(fits)) if not fits.all() else fits.size
        if keep < 2:
            return None
        counts, cumulative = counts[:keep], cumulative[:keep]
    kept = counts.shape[0]
    # a source's error: its count minus its target since the run began, plus its error before
    result_errors = errors[None, :] + cumulative - steps[:kept] * (rows * shares)[None, :]
    for d in range(weights.size):
        counter.errors[d] = float(result_errors[-1, d])
        counter.available[d] -= int(cumulative[-1, d])
    return counts, result_errors


def _sort_by_label_and_length(
    labels: npt.NDArray[np.int64], padded: npt.NDArray[np.int64], samples: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """``samples`` ordered by (label, padded length, index): one sort of packed keys."""
    if not samples.size:
        return _EMPTY
    index_bits = int(samples.max()).bit_length()
    length_bits = int(padded.max()).bit_length()
    label_bits = int(labels.max()).bit_length()
    if index_bits + length_bits + label_bits > 62:
        return samples[np.lexsort((samples, padded, labels))]
    keys = labels << (length_bits + index_bits)
    keys |= padded << index_bits
    keys |= samples
    keys.sort()
    keys &= (1 << index_bits) - 1
    return keys


def _compose_budget(
    settings: MixtureSettings,
    weights: MixtureWeights,
    streams: Streams,
    segments: list[Segment],
    first_position: int,
    errors: list[float],
    slot_limit: float,
    policy: str,
) -> MixturePlan:
    counter = _Counter(weights, streams, errors, policy)
    size = weights.size
    padded = settings.padded
    per_window = settings.window if settings.window is not None else 1 << 40
    all_counts: list[list[int]] = []
    all_errors: list[list[float]] = []
    pieces: list[npt.NDArray[np.int64]] = []
    used = 0
    position = first_position
    finished = False
    while not finished and used < slot_limit:
        step = _step_of(segments, position)
        active = counter.active_weights(step)
        if active is None:
            break
        budget = _rows_at(settings, step)
        rows_guess = max(1.0, budget / max(settings.mean_padded, 1.0))
        if settings.batch_size is not None:
            rows_guess = min(rows_guess, settings.batch_size)
        want = min(per_window * rows_guess * 1.25 + 8, slot_limit - used + size)
        chunks = []
        for d in range(size):
            amount = int(min(math.ceil(want * max(active[d], 1e-3)) + 2, counter.available[d]))
            taken = streams.take(d, max(amount, 0))
            chunks.append(taken[np.lexsort((taken, padded[taken]))] if taken.size else _EMPTY)
        pointers = [0] * size
        chunk_lengths = [padded[chunk] for chunk in chunks]
        last_rows = 0
        made = 0
        while made < per_window and used < slot_limit:
            step = _step_of(segments, position)
            active = counter.active_weights(step)
            if active is None:
                finished = True
                break
            budget = _rows_at(settings, step)
            cap_limit = min(slot_limit - used, settings.batch_size or budget, budget)
            if policy in ("renormalize", "drain"):
                cap_limit = min(cap_limit, sum(counter.available[d] for d in range(size) if active[d] > 0))
            cap = int(cap_limit)
            if cap <= 0:
                finished = True
                break

            def fits(
                rows: int,
                active: list[float] = active,
                budget: int = budget,
                pointers: list[int] = pointers,
                chunks: list[npt.NDArray[np.int64]] = chunks,
            ) -> tuple[bool, list[int] | None]:
                counts = counter.split(rows, active)
                if counts is None:
                    return False, None
                longest = 0
                for d in range(size):
                    if counts[d]:
                        end = pointers[d] + counts[d]
                        if end > chunks[d].size:
                            return False, counts
                        longest = max(longest, int(padded[chunks[d][end - 1]]))
                return rows * longest <= budget, counts

            chosen_counts: list[int] | None = _vector_choice(
                counter, active, budget, cap, pointers, chunk_lengths, 2 * last_rows + 8
            )
            if chosen_counts is not None:
                counts_found: list[int] = chosen_counts
                last_rows = sum(counts_found)
                counter.commit(counts_found, last_rows, active)
                pieces.append(
                    np.concatenate([chunks[d][pointers[d] : pointers[d] + counts_found[d]] for d in range(size)])
                )
                for d in range(size):
                    pointers[d] += counts_found[d]
                all_counts.append(counts_found)
                all_errors.append(list(counter.errors))
                used += last_rows
                position += 1
                made += 1
                continue
            ok, counts = fits(1)
            if counts is None:
                finished = True
                break
            if not ok:
                if any(pointers[d] + counts[d] > chunks[d].size for d in range(size)):
                    break  # the window's chunks ran dry: take fresh ones
                chosen, chosen_counts = 1, counts  # one sample always forms a batch
                assert chosen_counts is not None
            else:
                low, high = 1, cap
                chosen_counts = counts
                while low < high:
                    middle = (low + high + 1) // 2
                    ok, middle_counts = fits(middle)
                    if ok:
                        low, chosen_counts = middle, middle_counts
                    else:
                        high = middle - 1
                chosen = low
            assert chosen_counts is not None
            chosen = sum(chosen_counts)
            if not chosen:
                finished = True
                break
            counter.commit(chosen_counts, chosen, active)
            batch = [chunks[d][pointers[d] : pointers[d] + chosen_counts[d]] for d in range(size)]
            for d in range(size):
                pointers[d] += chosen_counts[d]
            pieces.append(np.concatenate(batch))
            all_counts.append(chosen_counts)
            all_errors.append(list(counter.errors))
            used += chosen
            position += 1
            made += 1
        for d in range(size):
            rest = chunks[d][pointers[d] :]
            streams.give_back(d, rest)
        if made == 0 and not finished:
            # not one batch fit the fetched samples: fetch more next time, unless nothing is left
            if all(streams.available(d) <= 0 for d in range(size)):
                break
            per_window = max(per_window, 1)
            if all(chunks[d].size == 0 for d in range(size)):
                break
    counts_array = np.array(all_counts, dtype=np.int64).reshape(-1, size)
    rows_array = counts_array.sum(axis=1)
    starts = np.concatenate(([0], np.cumsum(rows_array)[:-1])).astype(np.int64) if rows_array.size else _EMPTY
    indices = np.concatenate(pieces) if pieces else _EMPTY
    return _finish(settings, indices, starts, starts + rows_array, counts_array, all_errors, segments, streams)


def _vector_choice(
    counter: _Counter,
    active: list[float],
    budget: int,
    cap: int,
    pointers: list[int],
    chunk_lengths: list[npt.NDArray[np.int64]],
    guess: int,
) -> list[int] | None:
    """The composition of the largest batch (in rows) whose every prefix of rows fits the
    budget, found for all row counts up to ``guess`` at once (doubled while all fit); the
    counts are ``_Counter.split``'s. ``None`` where the loop must decide (a source that runs
    out, no row fits, or a split that would clip)."""
    shares = np.array(active, dtype=np.float64)
    positive = shares > 0
    errors = np.array(counter.errors, dtype=np.float64)
    sizes = np.array([lengths.size for lengths in chunk_lengths], dtype=np.int64)
    available = np.array(counter.available, dtype=np.float64)
    start = np.array(pointers, dtype=np.int64)
    high = max(1, min(cap, guess))
    while True:
        rows = np.arange(1, high + 1, dtype=np.int64)
        deficits = rows[:, None] * shares[None, :] - errors[None, :]
        counts = np.where(positive[None, :], np.maximum(np.floor(deficits), 0), 0).astype(np.int64)
        short = rows - counts.sum(axis=1)
        if (short < 0).any() or (short > int(positive.sum())).any():
            return None
        keys = np.where(positive[None, :], counts - deficits, np.inf)
        order = np.argsort(keys, axis=1, kind="stable")
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(shares.size)[None, :].repeat(high, axis=0), axis=1)
        counts += ranks < short[:, None]
        if counter.policy != "repeat" and (counts > available[None, :]).any():
            return None
        ends = start[None, :] + counts
        within = (ends <= sizes[None, :]).all(axis=1)
        longest = np.zeros(high, dtype=np.int64)
        for d, lengths in enumerate(chunk_lengths):
            if lengths.size:
                last = lengths[np.minimum(np.maximum(ends[:, d] - 1, 0), lengths.size - 1)]
                longest = np.maximum(longest, np.where(counts[:, d] > 0, last, 0))
        fit = within & (rows * longest <= budget)
        if not fit[0]:
            return None
        failing = np.flatnonzero(~fit)
        if failing.size:
            return [int(value) for value in counts[int(failing[0]) - 1]]
        if high >= cap:
            return [int(value) for value in counts[-1]]
        high = min(cap, high * 2)


def _finish(
    settings: MixtureSettings,
    indices: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    errors: Any,
    segments: list[Segment],
    streams: Streams,
) -> MixturePlan:
    size = counts.shape[1]
    tokens = np.zeros_like(counts)
    if indices.size:
        batch_of = np.repeat(np.arange(starts.size, dtype=np.int64), stops - starts)
        flat = batch_of * size + settings.source_of[indices]
        tokens = (
            np.bincount(flat, weights=settings.token_lengths[indices], minlength=starts.size * size)
            .round()
            .astype(np.int64)
            .reshape(-1, size)
        )
    indices.flags.writeable = False
    return MixturePlan(
        indices=indices,
        starts=starts.astype(np.int64),
        stops=stops.astype(np.int64),
        counts=counts,
        tokens=tokens,
        errors=np.array(errors, dtype=np.float64).reshape(-1, size),
        padded=settings.padded,
        segments=list(segments),
        streams=streams,
    )


def join(head: MixturePlan, position: int, tail: MixturePlan) -> MixturePlan:
    """``head``'s batches before ``position``, then ``tail``'s."""
    end = int(head.stops[position - 1]) if position else 0
    kept_indices = head.indices[:end]
    indices = np.concatenate((kept_indices, tail.indices))
    indices.flags.writeable = False
    return MixturePlan(
        indices=indices,
        starts=np.concatenate((head.starts[:position], tail.starts + end)),
        stops=np.concatenate((head.stops[:position], tail.stops + end)),
        counts=np.concatenate((head.counts[:position], tail.counts)),
        tokens=np.concatenate((head.tokens[:position], tail.tokens)),
        errors=np.concatenate((head.errors[:position], tail.errors)),
        padded=head.padded,
        segments=tail.segments,
        streams=tail.streams,
    )


def even_out(
    plan: MixturePlan,
    deal_start: int,
    replicas: int,
    token_lengths: npt.NDArray[np.int64],
    first_free: int,
) -> MixturePlan:
    """``plan`` with its largest batches from ``first_free`` on (the last of equals first) split
    in two until the batches from ``deal_start`` on divide evenly among ``replicas`` ranks, so
    that no rank repeats a batch to fill the last round (while a batch has two samples)."""
    short = -(plan.num_batches - deal_start) % replicas
    if not short or plan.num_batches <= deal_start:
        return plan
    starts, stops = plan.starts.tolist(), plan.stops.tolist()
    counts, tokens, errors = list(plan.counts), list(plan.tokens), list(plan.errors)
    source_of = np.searchsorted(plan.streams.offsets, plan.indices, side="right") - 1
    indices = plan.indices
    while short:
        sizes = [stop - start for start, stop in zip(starts[first_free:], stops[first_free:], strict=True)]
        if not sizes or max(sizes) < 2:
            break
        largest = len(starts) - 1 - int(np.argmax(sizes[::-1]))  # the last of the largest
        start, stop = starts[largest], stops[largest]
        middle = start + (stop - start + 1) // 2
        if indices is plan.indices:
            indices = plan.indices.copy()
        batch = indices[start:stop]  # every other sample: each source's share halves
        indices[start:stop] = np.concatenate((batch[0::2], batch[1::2]))
        source_of[start:stop] = np.searchsorted(plan.streams.offsets, indices[start:stop], side="right") - 1
        size = plan.counts.shape[1]
        first = np.bincount(source_of[start:middle], minlength=size).astype(np.int64)
        first_tokens = np.bincount(
            source_of[start:middle], weights=token_lengths[indices[start:middle]], minlength=size
        ).round().astype(np.int64)
        starts[largest : largest + 1] = [start, middle]
        stops[largest : largest + 1] = [middle, stop]
        counts[largest : largest + 1] = [first, counts[largest] - first]
        tokens[largest : largest + 1] = [first_tokens, tokens[largest] - first_tokens]
        errors[largest : largest + 1] = [errors[largest], errors[largest]]
        short -= 1
    indices.flags.writeable = False
    return replace(
        plan,
        indices=indices,
        starts=np.array(starts, dtype=np.int64),
        stops=np.array(stops, dtype=np.int64),
        counts=np.array(counts, dtype=np.int64).reshape(-1, plan.counts.shape[1]),
        tokens=np.array(tokens, dtype=np.int64).reshape(-1, plan.counts.shape[1]),
        errors=np.array(errors, dtype=np.float64).reshape(-1, plan.counts.shape[1]),
        cumulative={},
    )


def remaining_streams(plan: MixturePlan, position: int, *, keep_tail: bool) -> Streams:
    """Streams of the samples in ``plan``'s batches from ``position`` on (in batch order), then,
    with ``keep_tail``, what the plan's streams still hold."""
    streams = plan.streams
    start = int(plan.starts[position]) if position < plan.num_batches else int(plan.indices.size)
    rest = plan.indices[start:]
    size = len(streams.members)
    source_of = np.searchsorted(streams.offsets, rest, side="right") - 1 if rest.size else _EMPTY
    heads = []
    for d in range(size):
        mine = rest[source_of == d] if rest.size else _EMPTY
        if keep_tail:
            mine = np.concatenate((mine, streams.heads[d]))
        heads.append(mine)
    return Streams(
        members=streams.members if keep_tail else [_EMPTY] * size,
        heads=heads,
        drawn=list(streams.drawn) if keep_tail else [0] * size,
        seed=streams.seed,
        epoch=streams.epoch,
        shuffle=streams.shuffle,
        passes=streams.passes if keep_tail else False,
        offsets=streams.offsets,
    )


__all__ = [
    "MIXTURE_POLICIES",
    "MixturePlan",
    "MixtureSettings",
    "MixtureWeights",
    "Segment",
    "Streams",
    "compose",
    "join",
    "remaining_streams",
]
