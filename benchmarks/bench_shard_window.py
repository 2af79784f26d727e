"""Shard-window shuffle (``shuffle_shards=K``): what it costs in plan time and in shuffle quality.

What it isolates: the epoch plan alone, on the issue's lognormal lengths (median 200, sigma 0.75,
clipped 8..2048) cut into 1,000 equal shards in index order, at K = 1, 8, 64 shards per group
and without ``shuffle_shards`` (the global shuffle).

Figures:

1. plan time per epoch (the ``len`` that builds it), ``LengthGroupedBatchSampler`` with
   ``batch_size=64`` and with ``max_tokens=16384``, ``PackedBatchSampler`` with ``seq_len=2048,
   rows=8``: medians of interleaved rounds, each against the global plan of the same round;
2. shuffle quality of the length-grouped plan at ``batch_size=64``, over one epoch's stream of
   samples (the batches in training order, one after the other):
   * the correlation of neighbouring samples' source shards (the shard's number in the
     dataset), for one sample drawn at random from each batch and the one drawn from the next
     batch: about 0 for a global shuffle, 1 when consecutive batches always share their shard,
     and about 1 / K in between (the K shards of a group are a random draw);
   * how often those two samples come from the same shard (about 1 / K);
   * the mean number of distinct shards in a batch of 64;
   * the padding efficiency (real tokens / padded tokens) and the number of partial batches,
     which grouping changes too (each group has its own windows and its own partial batch).
   And the packing efficiency of the packed plan.

Every plan is checked to hold every sample exactly once.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_shard_window.py -s -p no:cacheprovider
--size full`` (``--size smoke``, the default, runs in seconds).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from bench_sampling import interleaved_medians, lognormal_lengths, next_epoch_planner, table

from fastload import LengthGroupedBatchSampler, PackedBatchSampler

# The full size plans ten million lengths some fifty times: more than the suite's timeout.
pytestmark = pytest.mark.timeout(1800)

SIZES = {"smoke": 200_000, "full": 10_000_000}
SHARDS = 1_000
GROUPINGS: tuple[int | None, ...] = (None, 1, 8, 64)
BATCH = 64


def label(shards_per_group: int | None) -> str:
    return "global shuffle" if shards_per_group is None else f"K = {shards_per_group}"


def shard_options(shards_per_group: int | None, num_samples: int) -> dict[str, Any]:
    if shards_per_group is None:
        return {}
    sizes = np.full(SHARDS, num_samples // SHARDS, dtype=np.int64)
    sizes[: num_samples % SHARDS] += 1
    return {"shuffle_shards": shards_per_group, "shard_sizes": sizes}


def epoch_stream(sampler: LengthGroupedBatchSampler) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One epoch's samples in training order, and the batch each belongs to."""
    batches = list(sampler.iter_arrays())
    samples = np.concatenate(batches)
    batch_of = np.repeat(np.arange(len(batches)), [b.size for b in batches])
    return samples, batch_of


def quality(
    lengths: npt.NDArray[np.int64], shards_per_group: int | None
) -> dict[str, float]:
    sampler = LengthGroupedBatchSampler(
        lengths, batch_size=BATCH, seed=1, **shard_options(shards_per_group, lengths.size)
    )
    samples, batch_of = epoch_stream(sampler)
    assert np.array_equal(np.sort(samples), np.arange(lengths.size))  # every sample once
    shard_starts = np.arange(SHARDS) * (lengths.size // SHARDS) + np.minimum(
        np.arange(SHARDS), lengths.size % SHARDS
    )
    shards = np.searchsorted(shard_starts, samples, "right") - 1
    pairs = np.unique(batch_of * SHARDS + shards)  # (batch, shard) pairs present
    sizes = np.bincount(batch_of)
    starts = np.cumsum(sizes) - sizes
    longest = np.maximum.reduceat(lengths[samples], starts)
    # One sample of each batch, drawn at random: inside a batch samples are sorted by (length,
    # index), so neighbours there share shards through ties of length even in a global shuffle.
    picked = starts + (np.random.default_rng(5).random(sizes.size) * sizes).astype(np.int64)
    first, then = shards[picked][:-1], shards[picked][1:]
    return {
        "shard correlation": float(np.corrcoef(first, then)[0, 1]),
        "same shard": float(np.mean(first == then)),
        "distinct shards per batch": pairs.size / sizes.size,
        "padding efficiency": float(lengths.sum() / (sizes * longest).sum()),
        "partial batches": float(np.count_nonzero(sizes < BATCH)),
    }


def test_shuffle_quality(bench_size: str, benchmark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = lognormal_lengths(SIZES[bench_size])
    results = {k: quality(lengths, k) for k in GROUPINGS}
    packing = {
        k: PackedBatchSampler(
            lengths, seq_len=2048, rows=8, seed=1, **shard_options(k, lengths.size)
        ).efficiency()
        for k in GROUPINGS
    }
    rows = [
        (
            label(k),
            f"{r['shard correlation']:.3f}",
            f"{r['same shard']:.3f}",
            f"{r['distinct shards per batch']:.1f}",
            f"{r['padding efficiency']:.3f}",
            f"{r['partial batches']:.0f}",
            f"{packing[k]:.4f}",
        )
        for k, r in results.items()
    ]
    with capsys.disabled():
        print(
            table(
                f"shuffle quality, {lengths.size:,} lognormal lengths in {SHARDS:,} shards, "
                f"batches of {BATCH}",
                (
                    "shuffle",
                    "shard correlation",
                    "same shard",
                    "distinct shards / batch",
                    "padding eff.",
                    "partial batches",
                    "packing eff.",
                ),
                rows,
            )
        )
    benchmark.extra_info.update(
        {f"{label(k)}: {name}": round(v, 4) for k, r in results.items() for name, v in r.items()}
    )
    benchmark.pedantic(lambda: None, rounds=1)
    # The trade-off the option documents: fewer shards per group, stronger correlation.
    correlations = [results[k]["shard correlation"] for k in (1, 8, 64, None)]
    assert correlations == sorted(correlations, reverse=True)
    assert results[1]["distinct shards per batch"] <= 1.0 + 1e-9


def test_plan_time(bench_size: str, benchmark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = lognormal_lengths(SIZES[bench_size])
    kinds: dict[str, Any] = {
        f"length-grouped, batch_size={BATCH}": lambda extra: LengthGroupedBatchSampler(
            lengths, batch_size=BATCH, **extra
        ),
        "length-grouped, max_tokens=16384": lambda extra: LengthGroupedBatchSampler(
            lengths, max_tokens=16_384, **extra
        ),
        "packed, seq_len=2048, rows=8": lambda extra: PackedBatchSampler(
            lengths, seq_len=2048, rows=8, **extra
        ),
    }
    rows = []
    ratios: dict[str, float] = {}
    for kind, build in kinds.items():
        runs = {
            label(k): next_epoch_planner(build(shard_options(k, lengths.size))) for k in GROUPINGS
        }
        medians = interleaved_medians(runs, 7)
        base = medians[label(None)]
        for name, seconds in medians.items():
            rows.append((kind, name, f"{seconds * 1e3:,.0f} ms", f"{seconds / base:.2f}x"))
            ratios[f"{kind}, {name}"] = seconds / base
    with capsys.disabled():
        print(
            table(
                f"plan time per epoch, {lengths.size:,} lengths in {SHARDS:,} shards",
                ("sampler", "shuffle", "median", "vs global"),
                rows,
            )
        )
    benchmark.extra_info.update({k: round(v, 3) for k, v in ratios.items()})
    benchmark.pedantic(lambda: None, rounds=1)
