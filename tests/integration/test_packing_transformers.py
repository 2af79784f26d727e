"""Packed batches from ``fastload.DataLoader(pack_length=...)`` train a Hugging Face causal
language model exactly as its documents would train alone.

The acceptance check of sequence packing: a tiny Llama (random weights, CPU, float32, ``sdpa``
attention) fed a packed batch as HF models take one — ``input_ids``, ``position_ids`` and
``labels``, **no** ``attention_mask`` — gives every document the logits it has run alone
(max abs difference ≤ 1e-4) and the batch the mean loss of its documents' tokens run alone.

How transformers keeps the documents apart (read in ``transformers/masking_utils.py``, 4.57.1):
with no ``attention_mask`` and no ``past_key_values``, ``create_causal_mask`` derives each
token's sequence from ``position_ids`` (``find_packed_sequence_indices``: a new sequence
wherever a position is not the previous one plus 1) and ands that block-diagonal mask into the
causal one (a 2-D ``attention_mask``, even of all ones, turns this off). fastload's
``position_ids`` restart at 0 at every document and at the row's padding, so every document and
every padding run is a sequence of its own; no mask is built here. The catch: the model creates
a ``DynamicCache`` whenever ``use_cache`` is on, which it is by default
(``config.use_cache=True``, in training mode too unless gradient checkpointing turns it off),
and with a cache the detection is skipped and documents attend to each other. So the forward
pass here passes ``use_cache=False``, as a packed training step must;
``test_with_the_kv_cache_on_transformers_lets_documents_attend_to_each_other`` pins that pitfall
(and shows that the logit comparison catches attention across documents).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _token_files import write_documents

import fastload

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ_LEN = 32
ROWS = 3
LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5
#: Documents of 1 token (no label at all), of exactly ``SEQ_LEN``, and ``LONG`` (longer than
#: ``SEQ_LEN``: split into pieces of 32, 32 and 6 tokens); 289 tokens in 10 rows, so the epoch's
#: last planned batch is completed with rows of padding only.
LENGTHS = [5, 17, 1, 30, 9, 70, 12, 3, 25, 8, 32, 2, 11, 20, 6, 14, 4, 2, 18]
LONG = LENGTHS.index(70)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_documents(tmp_path_factory.mktemp("hf") / "docs.h5", LENGTHS, vocab=VOCAB)


@pytest.fixture(scope="module")
def documents(token_file: Path) -> list[torch.Tensor]:
    """Each sample's token ids as the file holds them, int64."""
    dataset = fastload.HDF5Dataset(token_file)
    return [torch.as_tensor(np.asarray(dataset[i]["tokens"]), dtype=torch.int64) for i in range(len(dataset))]


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2 * SEQ_LEN,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def _read_epoch(token_file: Path, workers: int = 0) -> list[dict[str, torch.Tensor]]:
    """One epoch of packed batches, as a training loop gets them."""
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(token_file), pack_length=SEQ_LEN, batch_size=ROWS, num_workers=workers
    )
    return list(loader)


@pytest.fixture(scope="module", params=[0, 2], ids=lambda w: f"workers={w}")
def epoch(request: pytest.FixtureRequest, token_file: Path) -> list[dict[str, torch.Tensor]]:
    return _read_epoch(token_file, request.param)


def _forward(model: Any, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """A packed training step's forward pass: ``use_cache=False``, else transformers skips the
    document separation (see the module text)."""
    with torch.no_grad():
        return model(
            input_ids=batch["tokens"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            use_cache=False,
            **kwargs,
        )


def _alone(model: Any, tokens: torch.Tensor) -> Any:
    """One document run by itself: positions 0..n-1, labels its own ids (the model shifts)."""
    with torch.no_grad():
        return model(input_ids=tokens[None], labels=tokens[None], use_cache=False)


def _segments(batch: dict[str, torch.Tensor]) -> Iterator[tuple[int, int, int]]:
    """``(row, start, stop)`` of every document piece in the batch; the rows' padding runs
    (ids 0, which no document holds) are left out."""
    tokens, ids = batch["tokens"], batch["document_ids"]
    for row in range(tokens.shape[0]):
        for doc in torch.unique(ids[row]).tolist():
            where = torch.nonzero(ids[row] == doc).flatten()
            start, stop = int(where[0]), int(where[-1]) + 1
            assert torch.equal(where, torch.arange(start, stop)), "a document's tokens are contiguous"
            if not bool((tokens[row, start:stop] == 0).all()):
                yield row, start, stop


def _pieces(documents: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every document cut as ``oversize="split"`` cuts it: pieces of ``SEQ_LEN`` tokens."""
    return [piece for doc in documents for piece in torch.split(doc, SEQ_LEN)]


def test_every_document_of_a_packed_batch_has_the_logits_it_has_alone(
    epoch: list[dict[str, torch.Tensor]], documents: list[torch.Tensor], model: Any
) -> None:
    unseen = {tuple(piece.tolist()): piece for piece in _pieces(documents)}
    worst = 0.0
    for batch in epoch:
        logits = _forward(model, batch).logits
        for row, start, stop in _segments(batch):
            tokens = batch["tokens"][row, start:stop]
            # Run alone what the file holds, so that the batch's tokens are checked too.
            piece = unseen.pop(tuple(tokens.tolist()), None)
            assert piece is not None, f"row {row} [{start}:{stop}] is no document of the file, or is one twice"
            assert torch.equal(batch["position_ids"][row, start:stop], torch.arange(stop - start))
            alone = _alone(model, piece).logits[0]
            worst = max(worst, float((logits[row, start:stop] - alone).abs().max()))
    assert not unseen, f"{len(unseen)} documents (of lengths {[len(k) for k in unseen]}) are in no batch"
    assert worst <= LOGITS_ATOL, f"max abs logit difference {worst:.2e} > {LOGITS_ATOL}"


def test_a_packed_batch_has_the_mean_loss_of_its_documents_alone(
    epoch: list[dict[str, torch.Tensor]], model: Any
) -> None:
    for number, batch in enumerate(epoch):
        loss_sum, predicted = 0.0, 0
        for row, start, stop in _segments(batch):
            tokens = batch["tokens"][row, start:stop]
            if tokens.numel() > 1:  # alone, a document predicts its tokens 1..n-1
                loss_sum += float(_alone(model, tokens).loss) * (tokens.numel() - 1)
                predicted += tokens.numel() - 1
        # The labels ignore each document's first token, so the packed loss counts no other.
        assert int((batch["labels"] != -100).sum()) == predicted, f"batch {number}"
        packed = float(_forward(model, batch).loss)
        assert packed == pytest.approx(loss_sum / predicted, rel=LOSS_RTOL), f"batch {number}"


def test_rows_of_padding_leave_the_loss_as_the_other_rows_make_it(
    token_file: Path, model: Any
) -> None:
    (last,) = [b for b in _read_epoch(token_file) if bool((b["tokens"] == 0).all(dim=1).any())]
    padding = (last["tokens"] == 0).all(dim=1)
    assert not bool(padding.all())
    assert bool((last["labels"][padding] == -100).all())
    real = {name: last[name][~padding] for name in ("tokens", "position_ids", "labels")}
    assert float(_forward(model, last).loss) == pytest.approx(float(_forward(model, real).loss), rel=LOSS_RTOL)


def test_a_batch_of_padding_only_adds_no_loss_and_no_gradient(token_file: Path, model: Any) -> None:
    """The ranks' last round is completed with batches of padding only. Their mean loss is 0/0
    (NaN), so a step that may see one divides the summed loss by a token count, as HF's
    ``num_items_in_batch`` does: then the batch adds exactly nothing."""
    dataset = fastload.HDF5Dataset(token_file)
    batches = len(fastload.PackedBatchSampler(dataset.lengths, seq_len=SEQ_LEN, rows=ROWS, num_replicas=1, rank=0))
    # One batch per rank and one rank more than batches: the last rank's batch is padding.
    sampler = fastload.PackedBatchSampler(
        dataset.lengths, seq_len=SEQ_LEN, rows=ROWS, num_replicas=batches + 1, rank=batches
    )
    (batch,) = list(fastload.DataLoader(dataset, batch_sampler=sampler))
    assert batch["tokens"].shape == (ROWS, SEQ_LEN)
    assert bool((batch["tokens"] == 0).all()) and bool((batch["labels"] == -100).all())
    model.zero_grad()
    loss = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        labels=batch["labels"],
        use_cache=False,
        num_items_in_batch=1,
    ).loss
    loss.backward()
    try:
        assert float(loss.detach()) == 0.0
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(bool((g == 0).all()) for g in grads)
    finally:
        model.zero_grad(set_to_none=True)


def test_a_split_document_is_trained_as_separate_documents(
    token_file: Path, documents: list[torch.Tensor], model: Any
) -> None:
    """A sample longer than ``SEQ_LEN`` is cut into pieces; each piece starts at position 0
    with its first label ignored, so it learns without the previous piece as context."""
    long = documents[LONG]
    wanted = torch.split(long, SEQ_LEN)
    assert len(wanted) == 3
    found: dict[int, tuple[dict[str, torch.Tensor], int, int, int]] = {}
    for batch in _read_epoch(token_file):
        for row, start, stop in _segments(batch):
            tokens = batch["tokens"][row, start:stop]
            for index, piece in enumerate(wanted):
                if torch.equal(tokens, piece):
                    found[index] = (batch, row, start, stop)
    assert sorted(found) == [0, 1, 2], "every piece of the long document is packed"
    whole = _alone(model, long).logits[0]
    for index, (batch, row, start, stop) in found.items():
        assert batch["labels"][row, start] == -100
        assert torch.equal(batch["labels"][row, start + 1 : stop], wanted[index][1:])
        logits = _forward(model, batch).logits[row, start:stop]
        alone = _alone(model, wanted[index]).logits[0]
        torch.testing.assert_close(logits, alone, atol=LOGITS_ATOL, rtol=0)
        if index > 0:  # not what the piece gets as the continuation of the whole document
            offset = index * SEQ_LEN
            assert float((logits - whole[offset : offset + stop - start]).abs().max()) > 1e-2


def test_with_the_kv_cache_on_transformers_lets_documents_attend_to_each_other(
    token_file: Path, model: Any
) -> None:
    """transformers 4.57.1 skips the packed-sequence mask whenever a cache exists, and the
    model makes one by default: the second document of a row then sees the first."""
    batch, row, start, stop = next(
        (batch, *segment) for batch in _read_epoch(token_file) for segment in _segments(batch) if segment[1] > 0
    )
    with torch.no_grad():
        cached = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
    alone = _alone(model, batch["tokens"][row, start:stop]).logits[0]
    assert float((cached[row, start:stop] - alone).abs().max()) > 1e-2
