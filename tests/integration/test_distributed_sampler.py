"""A real two-process torch.distributed run (gloo, CPU), started the way torchrun starts it:
each rank builds the sampler with the default ``num_replicas``/``rank`` and the shards must be
disjoint with equal batch counts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _gloo import run_world

WORLD_SIZE = 2
TIMEOUT_S = 90

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist

    from fastload import LengthGroupedBatchSampler, PackedBatchSampler

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    lengths = np.random.default_rng(0).integers(1, 512, 3_001)
    report = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    for name, options in {
        "padded": {"max_tokens": 4096},
        "dropped": {"batch_size": 64, "drop_last": True},
    }.items():
        sampler = LengthGroupedBatchSampler(lengths, seed=5, **options)
        sampler.set_epoch(1)
        batches = list(sampler)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, batches)
        report[name] = {
            "num_replicas": sampler.num_replicas,
            "sampler_rank": sampler.rank,
            "len": len(sampler),
            "batches": batches,
            "gathered": gathered,
        }
    packed = PackedBatchSampler(lengths, seq_len=384, rows=4, seed=5)
    packed.set_epoch(1)
    report["packed"] = {
        "num_replicas": packed.num_replicas,
        "len": len(packed),
        "batches": [[b.row(r) for r in range(b.rows)] for b in packed],
    }
    dist.barrier()
    dist.destroy_process_group()
    with open(sys.argv[1], "w") as out:
        json.dump(report, out)
    """
)


def run_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_world(script, WORLD_SIZE, lambda rank: [str(tmp_path / f"rank{rank}.json")], TIMEOUT_S)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S * 2)
def test_two_gloo_ranks_get_disjoint_shards_with_equal_batch_counts(tmp_path: Path) -> None:
    reports = run_ranks(tmp_path)
    for rank, report in enumerate(reports):
        assert (report["rank"], report["world_size"]) == (rank, WORLD_SIZE)
        for name in ("padded", "dropped"):
            assert report[name]["num_replicas"] == WORLD_SIZE  # defaults from the process group
            assert report[name]["sampler_rank"] == rank
            assert report[name]["len"] == len(report[name]["batches"])
            # What every rank gathered is what each rank yielded.
            assert report[name]["gathered"] == [r[name]["batches"] for r in reports]

    dropped = [report["dropped"]["batches"] for report in reports]
    assert len(dropped[0]) == len(dropped[1]) == 3_001 // 64 // WORLD_SIZE
    shards = [{i for batch in batches for i in batch} for batches in dropped]
    assert not shards[0] & shards[1]
    assert sum(len(batch) for batches in dropped for batch in batches) == sum(map(len, shards))

    padded = [report["padded"]["batches"] for report in reports]
    assert len(padded[0]) == len(padded[1])
    shards = [{i for batch in batches for i in batch} for batches in padded]
    assert shards[0] | shards[1] == set(range(3_001))
    total_batches = len(padded[0]) * WORLD_SIZE
    if total_batches == len({tuple(b) for batches in padded for b in batches}):
        assert not shards[0] & shards[1]
    else:  # one padding batch: the last round repeats the epoch's first batch
        assert len(shards[0] & shards[1]) == len(padded[0][0])

    # Packed: equal counts, and together every token of every sample once (split at 384).
    packed = [report["packed"]["batches"] for report in reports]
    assert all(report["packed"]["num_replicas"] == WORLD_SIZE for report in reports)
    assert len(packed[0]) == len(packed[1]) == reports[0]["packed"]["len"]
    pieces = sorted(tuple(p) for batches in packed for batch in batches for row in batch for p in row)
    lengths = np.random.default_rng(0).integers(1, 512, 3_001)
    expected = sorted(
        (i, start, min(start + 384, int(n))) for i, n in enumerate(lengths) for start in range(0, int(n), 384)
    )
    assert pieces == expected
