"""A mixture checkpointed on one number of real gloo ranks and resumed on another: every sample
delivered before stays delivered, the rest of the epoch comes once, nothing twice."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _gloo import run_world

TIMEOUT_S = 120

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist

    from fastload import MixtureBatchSampler

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=90))
    phase, steps, options = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    parts = [np.random.default_rng(d).integers(1, 300, n) for d, n in enumerate((900, 600, 300))]
    sampler = MixtureBatchSampler(
        parts, proportions=[[0, [3, 2, 1]], [6, [1, 1, 2]]], seed=2, exhausted="renormalize",
        **options,
    )
    report = {"world": dist.get_world_size(), "rank": dist.get_rank()}
    if phase == "first":
        it = iter(sampler)
        report["batches"] = [list(next(it)) for _ in range(steps)]
        report["state"] = sampler.state_dict()
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, report["state"])
        report["same_state"] = all(state == states[0] for state in states)
    else:
        with open(sys.argv[5]) as saved:
            sampler.load_state_dict(json.load(saved))
        report["batches"] = [list(b) for b in sampler]
    dist.barrier()
    dist.destroy_process_group()
    with open(sys.argv[1], "w") as out:
        json.dump(report, out)
    """
)


def run_ranks(tmp_path: Path, world: int, *args: str) -> list[dict[str, Any]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_world(script, world, lambda rank: [str(tmp_path / f"rank{rank}.json"), *args], TIMEOUT_S)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S * 3)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 2)])
@pytest.mark.parametrize("options", [{"batch_size": 16}, {"max_tokens": 2_000}], ids=["rows", "tokens"])
def test_a_checkpoint_resumed_on_another_number_of_gloo_ranks_covers_the_epoch_once(
    tmp_path: Path, before: int, after: int, options: dict[str, int]
) -> None:
    first = run_ranks(tmp_path, before, "first", "5", json.dumps(options))
    assert all(report["world"] == before and report["same_state"] for report in first)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[0]["state"]))
    second = run_ranks(tmp_path, after, "second", "0", json.dumps(options), str(state))
    assert len({len(report["batches"]) for report in second}) == 1  # equal counts on every rank
    delivered = [i for report in first for batch in report["batches"] for i in batch]
    rest = [i for report in second for batch in report["batches"] for i in batch]
    assert sorted(delivered + rest) == list(range(1_800))  # the epoch, nothing twice


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S * 3)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 2)])
def test_a_packed_mixture_resumed_on_another_number_of_gloo_ranks_packs_every_sample_once(
    tmp_path: Path, before: int, after: int
) -> None:
    options = json.dumps({"pack_length": 512, "batch_size": 4})  # rows of whole samples
    first = run_ranks(tmp_path, before, "first", "5", options)
    assert all(report["world"] == before and report["same_state"] for report in first)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[0]["state"]))
    second = run_ranks(tmp_path, after, "second", "0", options, str(state))
    assert len({len(report["batches"]) for report in second}) == 1
    pieces = [
        tuple(piece)
        for report in first + second
        for batch in report["batches"]
        for row in batch
        for piece in row
    ]
    assert sorted(sample for sample, _, _ in pieces) == list(range(1_800))  # nothing twice
    assert all(start == 0 for _, start, _ in pieces)
