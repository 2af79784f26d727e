"""A mixture of whole-sample batches apportioned by tokens (``share="tokens"``).

Each window of ``window`` batches takes from every source about its share of the window's
samples and sorts them by length. A batch is then filled one sample at a time: the source
furthest behind its weights in tokens gives its shortest sample left in the window, until the
batch has ``batch_size`` rows, or (``max_tokens``) the next sample would take the padded batch
over the budget. Every sample so brings its source nearer its target: over the batches so far
each source is less than one sample's tokens ahead of its weights, so over any window of
batches within one sample at each end. Batches of a window come shortest first, as with a
token budget by samples. Sources that run out follow the mixture's policy (``"repeat"``,
``"stop"``, ``"renormalize"``, and ``"drain"`` for the rest of an epoch re-dealt to other
ranks). Cost: one Python step per sample, ``O(sources)`` each: about 2 µs, so 1 M samples
of 5 sources plan in 1.9 s (by samples: 0.09 s; ``benchmarks/README.md``).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from fastload._sampling._mixpack import active_weights
from fastload._sampling._mixture import (
    MixturePlan,
    MixtureSettings,
    MixtureWeights,
    Segment,
    Streams,
)

_EMPTY = np.zeros(0, dtype=np.int64)


def compose_by_tokens(
    settings: MixtureSettings,
    weights: MixtureWeights,
    streams: Streams,
    segments: list[Segment],
    first_position: int,
    errors: list[float],
    slot_limit: float,
    policy: str,
) -> MixturePlan:
    """Plan batches from global position ``first_position`` on (see the module text), at most
    ``slot_limit`` samples in all."""
    size = weights.size
    padded = settings.padded.tolist()
    tokens_of = settings.token_lengths.tolist()
    errors = list(errors)
    left = [streams.available(d) for d in range(size)]
    rows_guess = settings.batch_size or max(1.0, (settings.max_tokens or 1) / max(settings.mean_padded, 1.0))
    per_window = settings.window if settings.window is not None else 1 << 40
    # Tokens per sample of each source: a window takes each source's samples in proportion to
    # its weight over them, so that the sources go through their sorted samples in step.
    mean_tokens = []
    for d in range(size):
        pool = streams.members[d] if streams.members[d].size else streams.heads[d]
        mean_tokens.append(float(settings.token_lengths[pool].mean()) if pool.size else 1.0)
    order: list[int] = []
    sizes: list[int] = []
    all_counts: list[list[int]] = []
    all_errors: list[list[float]] = []
    used = 0
    position = first_position
    ended = False
    while not ended and used < slot_limit:
        step = _step(segments, position)
        has = [left[d] > 0 for d in range(size)]
        active = active_weights(weights.at(step), has, policy)
        if active is None:
            break
        # The window's samples, every source's sorted by length (ties by index).
        want = min(per_window * rows_guess, slot_limit - used) * 1.25 + 8
        per_sample = [active[d] / max(mean_tokens[d], 1e-9) for d in range(size)]
        shares = [value / math.fsum(per_sample) for value in per_sample]
        chunks: list[list[int]] = []
        for d in range(size):
            amount = int(min(math.ceil(want * max(shares[d], 1e-3)), left[d]))
            taken = streams.take(d, amount) if amount > 0 else _EMPTY
            left[d] -= taken.size
            chunks.append(_by_length(taken, settings.padded))
        pointers = [0] * size
        made = 0
        while made < per_window and not ended and used < slot_limit:
            step = _step(segments, position)
            raw = weights.at(step)
            has = [pointers[d] < len(chunks[d]) or left[d] > 0 for d in range(size)]
            refreshed = active_weights(raw, has, policy)
            if refreshed is None:
                ended = True
                break
            active = refreshed
            target = settings.batch_size if settings.max_tokens is None else settings.max_tokens
            assert target is not None
            if settings.warmup is not None:
                target = min(target, settings.warmup.size_at(step))
            budget = None if settings.max_tokens is None else target
            row_cap = target if budget is None else (settings.batch_size or target)
            batch: list[int] = []
            counts = [0] * size
            longest = 0
            before = (list(pointers), list(errors), used)
            dry = False
            turns = [d for d in range(size) if active[d] > 0]
            while len(batch) < row_cap and used < slot_limit:
                chosen = min(turns, key=errors.__getitem__)  # ties: the first source
                if pointers[chosen] >= len(chunks[chosen]) and left[chosen] > 0:
                    if made:  # the window ran dry: this batch comes from fresh windows
                        dry = True
                        break
                    more = int(min(max(8, len(chunks[chosen])), left[chosen]))
                    taken = streams.take(chosen, more)
                    left[chosen] -= taken.size
                    chunks[chosen] += _by_length(taken, settings.padded)
                if pointers[chosen] >= len(chunks[chosen]):  # the source ran out
                    if policy == "stop":
                        ended = True
                        break
                    has[chosen] = False
                    again = active_weights(raw, has, policy)
                    if again is None:
                        ended = True
                        break
                    active = again
                    turns = [d for d in range(size) if active[d] > 0]
                    continue
                sample = chunks[chosen][pointers[chosen]]
                if budget is not None and batch and (len(batch) + 1) * max(longest, padded[sample]) > budget:
                    break
                pointers[chosen] += 1
                batch.append(sample)
                counts[chosen] += 1
                longest = max(longest, padded[sample])
                unit = tokens_of[sample]
                for d in turns:
                    errors[d] -= active[d] * unit
                errors[chosen] += unit
                used += 1
            if dry:
                pointers, errors, used = before
                break
            if not batch:
                ended = True
                break
            order.extend(batch)
            sizes.append(len(batch))
            all_counts.append(counts)
            all_errors.append(list(errors))
            position += 1
            made += 1
        for d in range(size):  # what the window did not use goes back, in its order
            streams.give_back(d, np.array(chunks[d][pointers[d] :], dtype=np.int64))
            left[d] = streams.available(d)
    if (
        settings.drop_last
        and sizes
        and settings.max_tokens is None
        and settings.batch_size is not None
        and sizes[-1] < settings.batch_size
    ):  # a short last batch is dropped; its samples stay in the streams
        last = sizes.pop()
        dropped = np.array(order[len(order) - last :], dtype=np.int64)
        del order[len(order) - last :]
        all_counts.pop()
        all_errors.pop()
        source = np.searchsorted(streams.offsets, dropped, side="right") - 1
        for d in range(size):
            streams.give_back(d, dropped[source == d])
    return _finish(settings, order, sizes, all_counts, all_errors, segments, streams)


def _by_length(samples: npt.NDArray[np.int64], padded: npt.NDArray[np.int64]) -> list[int]:
    """``samples`` by padded length, ties by index."""
    return samples[np.lexsort((samples, padded[samples]))].tolist()


def _step(segments: list[Segment], position: int) -> int:
    segment = segments[-1]
    return segment.step + (position - segment.position) // segment.replicas


def _finish(
    settings: MixtureSettings,
    order: list[int],
    sizes: list[int],
    counts: list[list[int]],
    errors: list[list[float]],
    segments: list[Segment],
    streams: Streams,
) -> MixturePlan:
    size = len(streams.members)
    indices = np.array(order, dtype=np.int64)
    rows = np.array(sizes, dtype=np.int64)
    stops = np.cumsum(rows).astype(np.int64)
    starts = stops - rows
    batch_of = np.repeat(np.arange(rows.size, dtype=np.int64), rows)
    flat = batch_of * size + settings.source_of[indices]
    tokens = np.bincount(flat, weights=settings.token_lengths[indices], minlength=rows.size * size)
    indices.flags.writeable = False
    return MixturePlan(
        indices=indices,
        starts=starts,
        stops=stops,
        counts=np.array(counts, dtype=np.int64).reshape(-1, size),
        tokens=tokens.round().astype(np.int64).reshape(-1, size),
        errors=np.array(errors, dtype=np.float64).reshape(-1, size),
        padded=settings.padded,
        segments=list(segments),
        streams=streams,
    )


__all__ = ["compose_by_tokens"]
