"""Property test of the token budget as the loader applies it: whatever the lengths, the
budget and the collate's ``pad_to_multiple_of``, no batch the loader hands out is larger than
``max_tokens`` in the shape the collate built (rows x padded length), and every sample whose
padded length fits comes exactly once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload


class Ragged(torch.utils.data.Dataset[dict[str, Any]]):
    """Sample ``i``: ``lengths[i]`` tokens, each equal to ``i + 1``, and its ``lengths``."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"tokens": np.full(int(self.lengths[i]), i + 1, dtype=np.int64)}


@pytest.mark.filterwarnings("ignore::fastload.errors.UniformLengthsWarning")  # equal lengths may be drawn
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=120),
    multiple=st.sampled_from([1, 3, 8, 16, 64]),
    budget=st.integers(128, 2048),
    seed=st.integers(0, 2**20),
)
def test_no_batch_exceeds_max_tokens_in_the_shape_the_collate_builds(
    lengths: list[int], multiple: int, budget: int, seed: int
) -> None:
    loader = fastload.DataLoader(
        Ragged(lengths),
        max_tokens=budget,
        seed=seed,
        collate_fn=fastload.PadCollate(pad_to_multiple_of=multiple, ragged=["tokens"]),
    )
    seen: list[int] = []
    for batch in loader:
        rows, width = batch["tokens"].shape
        assert rows * width <= budget
        assert width % multiple == 0
        seen.extend(int(row[0]) - 1 for row in batch["tokens"])
    assert sorted(seen) == list(range(len(lengths)))
