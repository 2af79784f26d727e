"""``CausalLMCollate``: int64 ids, the mask, and labels equal to the ids with -100 on padding,
the same through the engine's two halves (``prepare``/``fill`` into given arrays) as through
``__call__``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastload._integrations._causal import CausalLMCollate
from fastload._types import Ragged


def _columnar(rows: list[list[int]]) -> dict[str, object]:
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    values = np.concatenate([np.asarray(r, dtype=np.uint16) for r in rows])
    return {"input_ids": Ragged(values, lengths), "idx": np.arange(len(rows), dtype=np.int64)}


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_labels_are_the_ids_with_minus_100_on_padding(padding_side: str) -> None:
    collate = CausalLMCollate(pad_token_id=7, padding_side=padding_side)
    out = collate(_columnar([[1, 2, 3, 4], [5], [6, 6]]))
    ids, mask, labels = out["input_ids"], out["attention_mask"], out["labels"]
    assert ids.dtype == labels.dtype == torch.int64 and labels.shape == ids.shape == (3, 4)
    assert torch.equal(labels[mask == 1], ids[mask == 1])
    assert torch.equal(labels[mask == 0], torch.full((5,), -100))
    assert torch.equal(ids[mask == 0], torch.full((5,), 7))
    assert out["idx"].tolist() == [0, 1, 2]  # other fields pass through


def test_the_zero_copy_halves_write_what_call_returns() -> None:
    collate = CausalLMCollate(pad_to_multiple_of=8)
    batch = _columnar([[3, 1, 4, 1, 5], [9, 2]])
    prepared = collate.prepare(batch)
    assert prepared.layout["labels"] == ((2, 8), np.dtype(np.int64))
    assert prepared.counts.real_tokens == 7
    out = {name: np.full(shape, 99, dtype=dtype) for name, (shape, dtype) in prepared.layout.items()}
    collate.collate_into(batch, out)
    expected = collate(batch)
    assert set(out) == set(expected)
    for name, array in out.items():
        assert np.array_equal(array, expected[name].numpy()), name


def test_a_list_of_sample_dicts_collates_too() -> None:
    out = CausalLMCollate()([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    assert out["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]


def test_a_dataset_labels_field_or_a_generated_name_is_refused() -> None:
    batch = _columnar([[1, 2]])
    batch["labels"] = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="already has a 'labels' field"):
        CausalLMCollate().prepare(batch)
    with pytest.raises(ValueError, match="field must name the token field"):
        CausalLMCollate(field="labels")
