"""Weighted sampling and dataset mixing, both with length grouping.

The weighted sampler draws each epoch's samples from a seeded generator (a pure function of
``(seed, epoch)``), then hands the draw to the same planner, dealer and resume logic as
:class:`~fastload.LengthGroupedBatchSampler`. The mixture plans its own batches (``_mixture.py``:
each batch split among the sources by the weights of its step) on the same dealer and resume
logic.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._sampling._base import GroupedBatchSamplerBase
from fastload._sampling._batch_options import (
    as_lengths,
    check_choice,
    check_int,
    check_optional_int,
)
from fastload._sampling._epoch_plan import STREAM_DRAW, epoch_rng
from fastload._sampling._mixpack import (
    MIXTURE_SHARES,
    PackedMixturePlan,
    PackSettings,
    compose_packed,
    join_packed,
    mixture_documents,
)
from fastload._sampling._mixtokens import compose_by_tokens
from fastload._sampling._mixture import (
    MIXTURE_POLICIES,
    MixturePlan,
    MixtureSettings,
    MixtureWeights,
    Segment,
    Streams,
    as_weight_vector,
    compose,
    even_out,
    join,
    remaining_streams,
)
from fastload._sampling._packed import _rows_per_batch
from fastload._sampling._packing_plan import PACK_OVERSIZE_POLICIES
from fastload._sampling._ranks import Cursor, per_rank_count, rank_positions
from fastload._sampling._warmup import BatchSizeWarmup


def _as_weights(name: str, values: npt.ArrayLike, size: int) -> npt.NDArray[np.float64]:
    weights = np.array(values, dtype=np.float64, copy=True)
    if weights.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), one per sample; got {weights.shape}")
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{first}] is {weights[first]}; weights must be finite and >= 0")
    weights.flags.writeable = False
    return weights


class WeightedLengthGroupedSampler(GroupedBatchSamplerBase):
    """Draws ``num_samples`` samples per epoch with probability proportional to ``weights``
    (like ``torch.utils.data.WeightedRandomSampler``), then batches them by length exactly like
    :class:`~fastload.LengthGroupedBatchSampler`, whose options it shares.

    * ``replacement=True`` (default): independent draws; a sample may appear several times in an
      epoch (in several batches or twice in one).
    * ``replacement=False``: ``num_samples`` distinct samples (at most the number of positive
      weights), drawn by weighted sampling without replacement (exponential keys).

    ``num_samples`` defaults to ``len(lengths)``. Samples that ``oversize="skip"`` leaves out, and
    samples of weight 0, are never drawn. Resume, ranks and ``len`` behave as for
    ``LengthGroupedBatchSampler``: the draw is a function of ``(seed, epoch)`` alone.
    """

    def __init__(
        self,
        lengths: npt.ArrayLike,
        weights: npt.ArrayLike,
        *,
        num_samples: int | None = None,
        replacement: bool = True,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad_to_multiple_of: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        longest_first: bool = False,
        oversize: str = "error",
        window: int | None = 100,
        warmup: BatchSizeWarmup | None = None,
    ) -> None:
        super().__init__(
            lengths,
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad_to_multiple_of=pad_to_multiple_of,
            num_replicas=num_replicas,
            rank=rank,
            longest_first=longest_first,
            oversize=oversize,
            window=window,
            warmup=warmup,
        )
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement must be True or False; got {replacement!r}")
        weights = _as_weights("weights", weights, self._lengths.size)
        self._checksum = zlib.crc32(weights.tobytes())
        effective = np.where(self._kept, weights, 0.0)
        self._candidates = np.flatnonzero(effective > 0).astype(np.int64)
        self._candidate_weights = effective[self._candidates]
        count = check_optional_int("num_samples", num_samples, minimum=0)
        self._num_samples = int(self._lengths.size) if count is None else count
        self._replacement = replacement
        if self._num_samples and not self._candidates.size:
            raise ValueError(
                "every weight is 0 (or belongs to a sample oversize='skip' left out); "
                f"cannot draw num_samples={self._num_samples}"
            )
        if not replacement and self._num_samples > self._candidates.size:
            raise ValueError(
                f"num_samples={self._num_samples} exceeds the {self._candidates.size} samples "
                "with positive weight, as replacement=False requires"
            )

    def _population_size(self) -> int:
        return self._num_samples

    def _mean_padded_length(self) -> float:
        if not self._candidates.size:
            return 1.0
        # Elementwise product and numpy's sum, not np.dot: BLAS kernels sum in a CPU-dependent
        # order, and this mean sizes the windows, which must be identical on every rank.
        padded = self._padded[self._candidates]
        weighted = (padded * self._candidate_weights).sum()
        return float(weighted / self._candidate_weights.sum())

    def _epoch_population(self, epoch: int) -> npt.NDArray[np.int64]:
        rng = epoch_rng(self._seed, epoch, STREAM_DRAW)
        if self._replacement:
            cumulative = np.cumsum(self._candidate_weights)
            targets = rng.random(self._num_samples) * cumulative[-1]
            picks = np.searchsorted(cumulative, targets, side="right")
            return self._candidates[np.minimum(picks, self._candidates.size - 1)]
        if self._num_samples == 0:
            return np.zeros(0, dtype=np.int64)
        # Efraimidis-Spirakis: the k smallest Exp(1) / weight keys are a weighted draw without
        # replacement. The chosen set does not depend on the partition algorithm; sorting it
        # fixes the order.
        keys = rng.standard_exponential(self._candidates.size) / self._candidate_weights
        chosen = np.argpartition(keys, self._num_samples - 1)[: self._num_samples]
        return self._candidates[np.sort(chosen)]

    def _population_state(self) -> dict[str, Any]:
        return {
            **super()._population_state(),
            "draws": self._num_samples,
            "replacement": self._replacement,
            "weights_crc32": self._checksum,
        }


class MixtureBatchSampler(GroupedBatchSamplerBase):
    """Length-grouped batches over several datasets (sources) mixed by weights that may change
    during training, accounted exactly per source and resumable on any number of ranks.

    ``lengths`` holds one length array per source. Indices are global over the sources
    concatenated in that order, as in ``torch.utils.data.ConcatDataset``: source ``d``'s sample
    ``i`` is index ``offsets[d] + i``.

    ``proportions`` is one of: fixed weights (one per source, normalized); a schedule of pieces
    ``[(step, weights), ...]`` (the first at step 0; each holds from its step on); or a callable
    ``step -> weights``. A step is a per-rank training step counted from the start of the run
    (epoch 0), as for ``warmup``. :meth:`set_proportions` replaces the weights from the next
    batch this sampler plans (or from ``step=``) for the rest of the run; the change is recorded
    in ``state_dict``. The plan is a pure function of the lengths, ``seed``, the epoch, the
    schedule, the recorded changes (with their steps) and the number of ranks.

    **Composition.** Every batch's rows are split among the sources by the weights in force at
    its step: over the batches so far each source is less than about one sample ahead of or
    behind its weights, so over any window of batches its share follows the weights within one
    batch's rounding (one sample at each end). Batches are length-grouped inside a source's
    share: each window of ``window`` batches sorts each source's samples by length and deals
    them out to the window's batches in a seeded random order (with ``max_tokens``: cut front
    to back, shortest batches of a window first, so that no batch exceeds the budget).

    **Epochs and exhaustion** (``exhausted``): each source is read in seeded random passes.
    ``"repeat"`` (default): a source that runs out starts a new pass (``consumed()`` counts the
    passes); an epoch holds ``num_samples`` samples (default: all sources' sizes summed).
    ``"stop"``: the epoch ends before the first batch a source with weight > 0 cannot fill.
    ``"renormalize"``: an exhausted source's weight goes to the others; the epoch ends when every
    source with weight is exhausted, so it covers each of their samples once. ``"repeat"`` is
    the default because in pretraining the weights are the experiment: it keeps them exact for
    the whole epoch, where ``"stop"`` shortens the epoch to the smallest source and
    ``"renormalize"`` silently shifts the mixture towards the largest sources at its end.

    **Share** (``share``): ``"samples"`` (default) apportions each batch's samples as above;
    ``"tokens"`` apportions their tokens: a batch is filled one sample at a time by the source
    furthest behind its weights in tokens (its shortest sample left in the window), so over any
    window of batches each source's tokens follow the weights within one sample at each end.

    **Packing** (``pack_length``): batches are :class:`~fastload._types.PackedBatch` es of
    ``batch_size`` rows (or ``max_tokens // pack_length``) of ``pack_length`` tokens, which
    ``fastload.DataLoader(dataset, batch_sampler=...)`` collates as for its own
    ``pack_length``. Each document goes to the source furthest behind its weights (by tokens,
    the default here; ``share="samples"``: by documents), best-fit into the batch's rows
    (``_mixpack.py``); ``oversize`` is ``"split"`` (default), ``"truncate"`` or ``"error"`` as
    for :class:`~fastload.PackedBatchSampler`, and ``num_samples`` counts documents. The rows
    are a function of the plan, so resume, ``set_proportions`` and a resize behave as without
    packing; the last round of ranks gets batches of padding only (``drop_last`` drops the
    batches that do not divide among the ranks instead). ``longest_first``,
    ``pad_to_multiple_of``, ``window`` and ``warmup`` do not apply.

    **Accounting.** :meth:`consumed` gives, per source, the samples and tokens delivered (on all
    ranks together) in the epoch and in the run; ``state_dict`` holds it.

    **Resume.** ``state_dict(batches_consumed=...)`` / ``load_state_dict`` resume mid-epoch
    exactly on the same ranks. On another number of ranks the batches delivered stay delivered;
    the rest of the epoch's samples are planned anew for the new ranks (each once, none
    repeated) with the schedule continuing at its step.
    """

    def __init__(
        self,
        lengths: Sequence[npt.ArrayLike],
        *,
        proportions: Any,
        num_samples: int | None = None,
        exhausted: str = "repeat",
        share: str | None = None,
        pack_length: int | None = None,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad_to_multiple_of: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        longest_first: bool = False,
        oversize: str | None = None,
        window: int | None = 100,
        warmup: BatchSizeWarmup | None = None,
    ) -> None:
        parts = [as_lengths(f"lengths[{d}]", part) for d, part in enumerate(lengths)]
        if not parts:
            raise ValueError("lengths must hold at least one dataset's length array; got none")
        self._weights = MixtureWeights(proportions, len(parts))
        self._policy = check_choice("exhausted", exhausted, MIXTURE_POLICIES)
        seq_len = check_optional_int("pack_length", pack_length, minimum=1)
        packed_oversize = "split"
        if seq_len is not None:
            _refuse_with_packing(pad_to_multiple_of=pad_to_multiple_of, longest_first=longest_first, warmup=warmup)
            if window != 100:  # the default: a packed batch is filled from each source's stream
                _refuse_with_packing(window=window if window is not None else "None")
            batch_size, max_tokens = _rows_per_batch(seq_len, batch_size, max_tokens), None
            if oversize is not None:
                packed_oversize = check_choice("oversize", oversize, PACK_OVERSIZE_POLICIES)
            oversize = None
        self._share = (
            ("tokens" if seq_len is not None else "samples")
            if share is None
            else check_choice("share", share, MIXTURE_SHARES)
        )
        super().__init__(
            np.concatenate(parts),
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad_to_multiple_of=pad_to_multiple_of,
            num_replicas=num_replicas,
            rank=rank,
            longest_first=longest_first,
            oversize="error" if oversize is None else oversize,
            window=window,
            warmup=warmup,
        )
        sizes = np.array([part.size for part in parts], dtype=np.int64)
        self._pack: PackSettings | None = None
        if seq_len is not None:
            documents, document_offsets = mixture_documents(parts, seq_len, packed_oversize)
            self._pack = PackSettings(
                documents=documents,
                source_of=np.repeat(np.arange(len(parts), dtype=np.int64), np.diff(document_offsets)),
                offsets=document_offsets,
                rows=int(batch_size),  # type: ignore[arg-type]
                seq_len=seq_len,
                share=self._share,
                oversize=packed_oversize,
            )
            self._kept = self._kept & (self._lengths > 0)  # an empty sample is in no row
            self.wraps = False  # the last round of ranks gets batches of padding only
        self._offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self._offsets.flags.writeable = False
        if num_samples is None:
            per_epoch = int(sizes.sum()) if self._pack is None else self._pack.documents.size
            self._num_samples: int | None = per_epoch if self._policy == "repeat" else None
        else:
            self._num_samples = check_int("num_samples", num_samples, minimum=0)
        self._members = [
            np.flatnonzero(self._kept[self._offsets[d] : self._offsets[d + 1]]) + self._offsets[d]
            for d in range(len(parts))
        ]
        for d, members in enumerate(self._members):
            if not members.size and self._weights.function is None and any(
                weights[d] > 0 for _, weights in self._weights.pieces
            ):
                raise ValueError(
                    f"dataset {d} has weight > 0 in proportions but no sample to give"
                    + (
                        (" after oversize='skip'" if self._pack is None else " (every one is empty)")
                        if sizes[d]
                        else ""
                    )
                    + "; give it weight 0 or drop it from lengths"
                )
        token_lengths = self._lengths
        cut = self.truncate_length
        if cut is not None:
            token_lengths = np.minimum(token_lengths, cut)
        means = [
            int(self._padded[members].sum()) / members.size if members.size else 0.0
            for members in self._members
        ]
        first = self._weights.at(0)
        self._settings = MixtureSettings(
            source_of=np.repeat(np.arange(len(parts), dtype=np.int64), sizes),
            padded=self._padded,
            token_lengths=token_lengths,
            batch_size=self._options.batch_size,
            max_tokens=self._options.max_tokens,
            window=self._options.window,
            shuffle=self._options.shuffle,
            drop_last=self._drop_last,
            policy=self._policy,
            warmup=self._warmup,
            mean_padded=max(1.0, math.fsum(w * m for w, m in zip(first, means, strict=True))),
        )
        # Changes of weights: (step, weights, epoch, global batch) in the order they were made.
        self._changes: list[tuple[int, tuple[float, ...], int, int]] = []
        # Continuations of the current epoch's plan: ("change", position, index into _changes)
        # or ("redeal", position, replicas), in the order they happened.
        self._events: list[tuple[str, int, int]] = []
        self._events_epoch = 0
        self._first_steps: dict[int, int] = {0: 0}
        self._run_before: dict[int, tuple[list[int], list[int]]] = {0: ([0] * len(parts), [0] * len(parts))}
        self._mixture_cache: tuple[tuple[int, int, int, int], MixturePlan] | None = None

    # -- public --------------------------------------------------------------------------------

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Dataset ``d`` owns the global indices ``offsets[d] .. offsets[d + 1] - 1``."""
        return self._offsets

    @property
    def num_sources(self) -> int:
        return int(self._offsets.size - 1)

    @property
    def share(self) -> str:
        """What the weights apportion: ``"samples"`` or ``"tokens"``."""
        return self._share

    @property
    def pack_length(self) -> int | None:
        """Tokens per packed row, or ``None`` for batches of whole samples."""
        return None if self._pack is None else self._pack.seq_len

    @property
    def seq_len(self) -> int | None:
        """With ``pack_length``: tokens per packed row (what a packing collate reads)."""
        return self.pack_length

    @property
    def rows(self) -> int | None:
        """With ``pack_length``: rows per packed batch."""
        return None if self._pack is None else self._pack.rows

    @property
    def exhausted(self) -> str:
        """The policy for a source that runs out: ``"repeat"``, ``"stop"`` or ``"renormalize"``."""
        return self._policy

    @property
    def samples_per_dataset(self) -> list[int]:
        """How many samples each source contributes to the current epoch's plan."""
        plan = self._plan(self._epoch, self._num_replicas)
        return [int(value) for value in plan.counts.sum(axis=0)]

    def proportions_at(self, step: int) -> list[float]:
        """The normalized weights in force at per-rank step ``step`` (changes included)."""
        return list(self._weights_with(len(self._changes)).at(check_int("step", step, minimum=0)))

    def set_proportions(self, weights: Sequence[float], *, step: int | None = None) -> None:
        """Use ``weights`` (one per source) from the next batch this sampler plans on, for the
        rest of the run (the schedule given at construction no longer applies). ``step`` (a
        per-rank step of the run, not before the next batch) picks a later batch instead: call it
        with the same arguments on every rank. Recorded in ``state_dict``."""
        vector = as_weight_vector("weights", weights, self.num_sources)
        cursor, yielded = self._position()
        plan = self._plan(cursor.epoch, cursor.plan_replicas)
        position = cursor.start + (cursor.consumed + yielded) * cursor.replicas
        next_step = plan.step_of(position) if position < plan.num_batches else self._epoch_end_step(plan)
        if step is not None:
            chosen = check_int("step", step, minimum=0)
            if chosen < next_step:
                raise ValueError(
                    f"step={chosen} is before the next batch this sampler plans (step "
                    f"{next_step}): batches up to there are already handed out"
                )
            position += (chosen - next_step) * cursor.replicas
            next_step = chosen
        self._changes.append((next_step, vector, cursor.epoch, position))
        if position < plan.num_batches:
            self._events_for(cursor.epoch).append(("change", position, len(self._changes) - 1))
        self._mixture_cache = None
        self._plan_cache = None
        self._refresh_iterator()

    def consumed(self, *, batches_consumed: int | None = None) -> dict[str, Any]:
        """Per source, the samples and tokens delivered on all ranks together, in the current
        epoch (``"epoch"``) and in the run (``"run"``, earlier epochs included), each a dict of
        lists ``{"samples": [...], "tokens": [...]}`` indexed by source; ``"passes"`` is how many
        passes over each source the epoch has begun. ``batches_consumed`` counts the batches this
        rank received of the latest ``iter()`` (default: all it yielded), as for ``state_dict``."""
        cursor, yielded = self._position()
        done = yielded if batches_consumed is None else check_int(
            "batches_consumed", batches_consumed, minimum=0
        )
        plan = self._plan(cursor.epoch, cursor.plan_replicas)
        reach = cursor.start + (cursor.consumed + done) * cursor.replicas
        samples, tokens = plan.totals(reach)
        if reach > plan.num_batches and self.wraps:  # the last round repeats the deal's first batches
            extra_samples, extra_tokens = plan.totals(
                cursor.start + reach - plan.num_batches, cursor.start
            )
            samples, tokens = samples + extra_samples, tokens + extra_tokens
        before_samples, before_tokens = self._run_before.get(cursor.epoch, self._run_totals(cursor.epoch))
        sizes = np.array([members.size for members in self._members], dtype=np.int64)
        passes = [int(-(-count // size)) if size else 0 for count, size in zip(samples.tolist(), sizes.tolist(), strict=True)]
        return {
            "epoch": {"samples": samples.tolist(), "tokens": tokens.tolist()},
            "run": {
                "samples": (samples + np.array(before_samples)).tolist(),
                "tokens": (tokens + np.array(before_tokens)).tolist(),
            },
            "passes": passes,
        }

    # -- epochs, state -------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        epoch = check_int("epoch", epoch, minimum=0)
        if self._pending is not None and self._pending.epoch == epoch:
            return
        cursor, _ = self._position()
        if epoch == cursor.epoch + 1:  # the run moves on: carry its totals and its step
            totals = self.consumed()
            self._run_before[epoch] = (totals["run"]["samples"], totals["run"]["tokens"])
            self._first_steps[epoch] = self._epoch_end_step(self._plan(cursor.epoch, cursor.plan_replicas))
        if epoch != self._events_epoch:
            self._events = []
            self._events_epoch = epoch
            self._mixture_cache = None
        super().set_epoch(epoch)

    def state_dict(self, *, batches_consumed: int | None = None) -> dict[str, Any]:
        state = super().state_dict(batches_consumed=batches_consumed)
        epoch = state["epoch"]
        state["mixture"] = {
            "changes": [[step, list(weights), ep, position] for step, weights, ep, position in self._changes],
            "events": [list(event) for event in self._events_for(epoch)],
            "epoch_first_step": self._first_step(epoch),
            "run_before": list(map(list, self._run_before.get(epoch, self._run_totals(epoch)))),
            "consumed": self.consumed(batches_consumed=batches_consumed),
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mixture = state.get("mixture")
        if not isinstance(mixture, Mapping):
            raise ValueError(
                f"sampler state lacks 'mixture' (the weights' changes and where the epoch's plan "
                f"was continued); got keys {sorted(state)}"
            )
        epoch = check_int("state['epoch']", state.get("epoch"), minimum=0)
        previous = (list(self._changes), list(self._events), self._events_epoch, dict(self._first_steps))
        try:
            self._changes = [
                (int(step), as_weight_vector("state['mixture']['changes']", weights, self.num_sources), int(ep), int(position))
                for step, weights, ep, position in mixture["changes"]
            ]
            self._events = [(str(kind), int(position), int(value)) for kind, position, value in mixture["events"]]
            self._events_epoch = epoch
            self._first_steps[epoch] = check_int(
                "state['mixture']['epoch_first_step']", mixture["epoch_first_step"], minimum=0
            )
            samples, tokens = mixture["run_before"]
            self._run_before[epoch] = ([int(x) for x in samples], [int(x) for x in tokens])
            self._mixture_cache = None
            self._plan_cache = None
            super().load_state_dict(state)
        except (KeyError, TypeError, ValueError) as error:
            self._changes, self._events, self._events_epoch, self._first_steps = previous
            self._mixture_cache = None
            if isinstance(error, ValueError):
                raise
            raise ValueError(f"sampler state's 'mixture' is malformed: {error!r}") from error
        pending = self._pending
        assert pending is not None
        if self._events_changed_deal(pending):
            # Another number of ranks: plan the rest of the epoch anew for them.
            self._events.append(("redeal", pending.start, pending.replicas))
            self._mixture_cache = None

    def _events_changed_deal(self, cursor: Cursor) -> bool:
        replicas = cursor.plan_replicas
        for kind, _, value in self._events:
            if kind == "redeal":
                replicas = value
        return replicas != cursor.replicas

    # -- planning ------------------------------------------------------------------------------

    def _population_size(self) -> int:
        return self._num_samples if self._num_samples is not None else int(self._kept.sum())

    def _mean_padded_length(self) -> float:
        return self._settings.mean_padded

    def _epoch_population(self, epoch: int) -> npt.NDArray[np.int64]:
        raise AssertionError("a mixture plans its own epochs")  # pragma: no cover

    def _population_state(self) -> dict[str, Any]:
        return {
            **super()._population_state(),
            "dataset_sizes": np.diff(self._offsets).tolist(),
            "proportions": self._weights.identity(),
            "exhausted": self._policy,
            "draws": self._num_samples,
            # absent at the defaults, so that earlier states still load
            **({} if self._share == "samples" or self._pack is not None else {"share": self._share}),
            **(
                {}
                if self._pack is None
                else {"pack": [self._pack.seq_len, self._pack.rows, self._pack.oversize, self._share]}
            ),
        }

    def _events_for(self, epoch: int) -> list[tuple[str, int, int]]:
        if epoch != self._events_epoch:
            self._events = []
            self._events_epoch = epoch
        return self._events

    def _weights_with(self, changes: int) -> MixtureWeights:
        return self._weights.with_changes([(step, w) for step, w, _, _ in self._changes[:changes]])

    def _first_step(self, epoch: int) -> int:
        known = self._first_steps.get(epoch)
        if known is not None:
            return known
        earlier = max(e for e in self._first_steps if e < epoch)
        step = self._first_steps[earlier]
        for e in range(earlier, epoch):
            plan = self._base_plan(e, self._num_replicas, step)
            step = self._epoch_end_step(plan)
            self._first_steps[e + 1] = step
        return step

    def _run_totals(self, epoch: int) -> tuple[list[int], list[int]]:
        """Samples and tokens per source of the epochs before ``epoch``, when no run was
        recorded (each earlier epoch counted whole)."""
        if epoch in self._run_before:
            return self._run_before[epoch]
        earlier = max(e for e in self._run_before if e < epoch)
        samples = np.array(self._run_before[earlier][0], dtype=np.int64)
        tokens = np.array(self._run_before[earlier][1], dtype=np.int64)
        for e in range(earlier, epoch):
            plan = self._base_plan(e, self._num_replicas, self._first_step(e))
            more_samples, more_tokens = plan.totals(plan.num_batches)
            samples, tokens = samples + more_samples, tokens + more_tokens
            self._run_before[e + 1] = (samples.tolist(), tokens.tolist())
        return self._run_before[epoch]

    def _epoch_end_step(self, plan: MixturePlan) -> int:
        last = plan.segments[-1]
        count = per_rank_count(plan.num_batches, last.position, last.replicas, drop_last=self._drop_last)
        return last.step + count

    def _streams(self, epoch: int) -> Streams:
        pack = self._pack
        return Streams(
            members=self._members
            if pack is None
            else [np.arange(pack.offsets[d], pack.offsets[d + 1], dtype=np.int64) for d in range(self.num_sources)],
            heads=[np.zeros(0, dtype=np.int64)] * self.num_sources,
            drawn=[0] * self.num_sources,
            seed=self._seed,
            epoch=epoch,
            shuffle=self._options.shuffle,
            passes=self._policy == "repeat",
            offsets=self._offsets if pack is None else pack.offsets,
        )

    def _compose(
        self,
        weights: MixtureWeights,
        streams: Streams,
        segments: list[Segment],
        position: int,
        errors: list[float],
        limit: float,
        policy: str,
    ) -> MixturePlan:
        if self._pack is not None:
            return compose_packed(self._pack, weights, streams, segments, position, errors, limit, policy)
        if self._share == "tokens":
            return compose_by_tokens(self._settings, weights, streams, segments, position, errors, limit, policy)
        return compose(self._settings, weights, streams, segments, position, errors, limit, policy)

    def _base_plan(self, epoch: int, plan_replicas: int, first_step: int) -> MixturePlan:
        weights = self._weights.with_changes([(s, w) for s, w, ep, _ in self._changes if ep < epoch])
        segments = [Segment(position=0, step=first_step, replicas=plan_replicas)]
        limit = math.inf if self._num_samples is None else self._num_samples
        plan = self._compose(weights, self._streams(epoch), segments, 0, [0.0] * self.num_sources, limit, self._policy)
        if self._options.longest_first and plan.num_batches > 1:
            plan = _largest_first(plan, plan_replicas)
        return plan

    def _plan(self, epoch: int, plan_replicas: int) -> MixturePlan:  # type: ignore[override]
        events = self._events_for(epoch) if epoch == self._events_epoch else []
        key = (self._seed, epoch, plan_replicas, len(events))
        if self._mixture_cache is not None and self._mixture_cache[0] == key:
            return self._mixture_cache[1]
        plan = self._base_plan(epoch, plan_replicas, self._first_step(epoch))
        token_lengths = self._settings.token_lengths
        evens = not self._drop_last and self._pack is None  # packing fills with padding batches
        if evens:
            plan = even_out(plan, 0, plan_replicas, token_lengths, 0)
        changes = [(step, weights) for step, weights, ep, _ in self._changes if ep < epoch]
        deal_start = 0
        for kind, position, value in events:
            position = min(position, plan.num_batches)
            step = plan.step_of(position) if position < plan.num_batches else self._epoch_end_step(plan)
            replicas = plan.segments[-1].replicas
            errors = plan.errors[position - 1].tolist() if position else [0.0] * self.num_sources
            if kind == "redeal":  # the epoch keeps the samples it planned, for the new ranks
                streams = remaining_streams(plan, position, keep_tail=False)
                replicas = value
                limit: float = float(sum(head.size for head in streams.heads))
                policy = "drain"
            else:  # new weights: the rest of the epoch is drawn from the streams
                change_step, weights, _, _ = self._changes[value]
                changes.append((change_step, weights))
                streams = remaining_streams(plan, position, keep_tail=True)
                delivered = (
                    int(plan.counts[:position].sum())
                    if not isinstance(plan, PackedMixturePlan)
                    else int(plan.stops[position - 1]) if position else 0  # documents
                )
                limit = math.inf if self._num_samples is None else self._num_samples - delivered
                policy = self._policy
            segments = [*plan.segments, Segment(position=position, step=step, replicas=replicas)]
            tail = self._compose(self._weights.with_changes(changes), streams, segments, position, errors, limit, policy)
            if isinstance(plan, PackedMixturePlan):
                assert isinstance(tail, PackedMixturePlan)
                plan = join_packed(plan, position, tail)
            else:
                plan = join(plan, position, tail)
            if kind == "redeal":
                deal_start = position
            if evens:
                plan = even_out(plan, deal_start, replicas, token_lengths, position)
        self._mixture_cache = (key, plan)
        return plan

    # -- helpers -------------------------------------------------------------------------------

    def _position(self) -> tuple[Cursor, int]:
        """The cursor of the latest stream and how many batches it has yielded."""
        if self._pending is not None:
            return self._pending, 0
        if self._iterator is not None:
            return self._current, self._iterator.yielded
        return self._current, 0

    def _refresh_iterator(self) -> None:
        """After the plan changed: the latest iteration continues on the new plan."""
        stream = self._iterator
        if stream is None or self._pending is not None:
            return
        cursor = self._current
        plan = self._plan(cursor.epoch, cursor.plan_replicas)
        positions = rank_positions(
            plan.num_batches, cursor, self._rank, drop_last=self._drop_last, wrap=self.wraps
        )
        done = stream.yielded
        stream._plan = plan
        stream._positions = stream._positions[:done] + positions[done:].tolist()


def _refuse_with_packing(**options: Any) -> None:
    """Options of unpacked batches that packed rows cannot honour, refused by name."""
    for name, value in options.items():
        if value not in (None, False):
            raise ValueError(
                f"{name}={value!r} does not apply with pack_length: packed rows are full "
                f"sequences of pack_length tokens; leave {name} out"
            )


def _largest_first(plan: MixturePlan, replicas: int) -> MixturePlan:
    """``plan`` with its ``replicas`` largest batches (padded size) first, largest first."""
    sizes = np.array(
        [(stop - start) * int(plan.padded[plan.indices[start:stop]].max()) if stop > start else 0
         for start, stop in zip(plan.starts.tolist(), plan.stops.tolist(), strict=True)],
        dtype=np.int64,
    )
    front = np.argsort(-sizes, kind="stable")[:replicas]
    rest = np.ones(plan.num_batches, dtype=bool)
    rest[front] = False
    order = np.concatenate((front, np.flatnonzero(rest)))
    return replace(
        plan,
        starts=plan.starts[order],
        stops=plan.stops[order],
        counts=plan.counts[order],
        tokens=plan.tokens[order],
        cumulative={},
    )
