"""Gradient accumulation: micro-batches under a token cap whose weighted mean losses add up to
the full batch's, checked on the gradients of a real (tiny) torch model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fastload import PadCollate, split_microbatches
from fastload._types import ColumnarBatch, Ragged

VOCAB = 37


def padded_batch(lengths: list[int], *, side: str = "right", seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    samples = [
        {"ids": rng.integers(1, VOCAB, n).tolist(), "targets": rng.integers(0, VOCAB, n).tolist()}
        for n in lengths
    ]
    collate = PadCollate(padding_side=side, pad_value={"targets": -100}, dtype=torch.int64)
    return dict(collate(samples))


class TinyTagger(nn.Module):
    """Embedding, a position-wise MLP and a per-token classifier: float64 so that the only
    difference between full and accumulated gradients is the accumulation itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids))


def token_mean_loss(model: TinyTagger, batch: dict[str, Any]) -> torch.Tensor:
    logits = model(batch["ids"])
    return nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), batch["targets"].reshape(-1), ignore_index=-100
    )


def sample_mean_loss(model: TinyTagger, batch: dict[str, Any]) -> torch.Tensor:
    logits = model(batch["ids"])
    per_token = nn.functional.cross_entropy(
        logits.transpose(1, 2), batch["targets"], ignore_index=-100, reduction="none"
    )
    return (per_token.sum(dim=1) / batch["lengths"].clamp(min=1)).mean()


def gradients(model: TinyTagger) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize(
    ("weight_by", "loss"), [("tokens", token_mean_loss), ("samples", sample_mean_loss)]
)
def test_accumulated_gradient_equals_the_full_batch_gradient(
    side: str, weight_by: str, loss: Any
) -> None:
    batch = padded_batch([3, 5, 8, 8, 13, 21, 34, 2], side=side)
    model = TinyTagger()
    loss(model, batch).backward()
    full = gradients(model)
    micro = split_microbatches(batch, max_tokens=48, weight_by=weight_by, padding_side=side)
    assert len(micro) > 2
    assert len({m.num_tokens for m in micro}) > 1  # micro-batches differ in real tokens
    for part in micro:
        (part.weight * loss(model, part.batch)).backward()
    accumulated = gradients(model)
    for expected, got in zip(full, accumulated, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_equal_weights_would_not_match_so_the_weights_matter() -> None:
    batch = padded_batch([2, 2, 2, 30])
    model = TinyTagger()
    token_mean_loss(model, batch).backward()
    full = gradients(model)
    micro = split_microbatches(batch, max_tokens=30)
    for part in micro:
        (token_mean_loss(model, part.batch) / len(micro)).backward()
    naive = gradients(model)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full, naive, strict=True))


def test_micro_batches_respect_the_cap_and_are_trimmed_to_their_own_longest_row() -> None:
    batch = padded_batch([1, 2, 3, 4, 10, 11, 30])
    micro = split_microbatches(batch, max_tokens=24, pad_to_multiple_of=2)
    assert [m.rows for m in micro] == [slice(0, 4), slice(4, 6), slice(6, 7)]
    for part in micro:
        rows, width = part.batch["ids"].shape
        assert width == max(2, -(-int(part.batch["lengths"].max()) // 2) * 2)
        assert rows * width <= 24 or rows == 1  # a row longer than the cap stands alone
        assert part.batch["attention_mask"].shape == (rows, width)
        assert part.batch["targets"].shape == (rows, width)
    assert sum(m.weight for m in micro) == pytest.approx(1.0)
    assert sum(m.num_tokens for m in micro) == 61


def test_left_padded_micro_batches_keep_the_rightmost_columns() -> None:
    batch = padded_batch([2, 6], side="left")
    first = split_microbatches(batch, max_tokens=2, padding_side="left")[0]
    assert first.batch["ids"].tolist() == batch["ids"][:1, -2:].tolist()
    assert first.batch["attention_mask"].tolist() == [[1, 1]]


def test_columnar_batches_split_into_columnar_micro_batches() -> None:
    batch: ColumnarBatch = {
        "ids": Ragged(np.arange(10, dtype=np.int32), np.array([1, 2, 3, 4], dtype=np.int64)),
        "label": np.arange(4),
        "text": ["a", "b", "c", "d"],
    }
    micro = split_microbatches(batch, max_tokens=6)
    assert [m.rows for m in micro] == [slice(0, 2), slice(2, 3), slice(3, 4)]
    second = micro[1].batch
    assert second["ids"].values.tolist() == [3, 4, 5]
    assert second["label"].tolist() == [2] and second["text"] == ["c"]
    assert [m.weight for m in micro] == [0.3, 0.3, 0.4]


def test_micro_batches_without_real_tokens_get_weight_zero() -> None:
    batch = padded_batch([0, 0, 5])
    micro = split_microbatches(batch, max_tokens=5)
    assert [m.weight for m in micro] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_tokens": 0}, ["max_tokens", ">= 1"]),
        ({"max_tokens": 8, "weight_by": "rows"}, ["weight_by", "'rows'"]),
        ({"max_tokens": 8, "padding_side": "up"}, ["padding_side", "'up'"]),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        split_microbatches(padded_batch([1, 2]), **kwargs)
    for word in words:
        assert word in str(caught.value)


def test_a_batch_without_lengths_or_ragged_fields_is_rejected() -> None:
    with pytest.raises(ValueError, match="padded batch"):
        split_microbatches({"x": torch.zeros(2, 3)}, max_tokens=4)
