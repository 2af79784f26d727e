"""Packing over a mixture through ``fastload.DataLoader``, on a real HDF5 file and real workers:
packed rows of the sources' documents, exact resume at every 7th batch, per-source accounting."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _token_files import write_token_file

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from test_packing_loader import documents_of, expected_documents, stored_tokens

SEQ_LEN = 64
ROWS = 4
N = 300
CUTS = [0, 150, 240, N]  # three sources


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Lengths 1..149 at seq_len 64: a third of the samples are split into pieces.
    return write_token_file(tmp_path_factory.mktemp("mixpack") / "tokens.h5", N, 150, label=True)


def _loader(path: Path, workers: int, **options: Any) -> fastload.DataLoader:
    lengths = fastload.HDF5Dataset(str(path)).lengths
    settings: dict[str, Any] = {
        "proportions": [(0, [3, 2, 1]), (8, [1, 1, 2])],
        "pack_length": SEQ_LEN,
        "batch_size": ROWS,
        "seed": 4,
        "exhausted": "renormalize",
    }
    settings.update(options)
    sampler = fastload.MixtureBatchSampler([lengths[a:b] for a, b in itertools.pairwise(CUTS)], **settings)
    return fastload.DataLoader(fastload.HDF5Dataset(str(path)), batch_sampler=sampler, num_workers=workers)


def _docs(batch: dict[str, Any]) -> list[tuple[int, ...]]:
    assert batch["tokens"].shape == (ROWS, SEQ_LEN)
    return [tuple(doc) for doc in documents_of(batch)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_7th_batch_equals_the_uninterrupted_run(token_file: Path, workers: int) -> None:
    full = [_docs(b) for b in _loader(token_file, workers)]
    assert Counter(doc for batch in full for doc in batch) == expected_documents(token_file)
    for stop in range(7, len(full), 7):
        loader = _loader(token_file, workers)
        it = iter(loader)
        head = [_docs(next(it)) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = _loader(token_file, workers)
        resumed.load_state_dict(state)
        assert head + [_docs(b) for b in resumed] == full, stop


def test_the_loader_counts_delivered_tokens_per_source(token_file: Path) -> None:
    loader = _loader(token_file, 2)
    it = iter(loader)
    got = [next(it) for _ in range(6)]
    sources = loader.stats().sources
    assert sources is not None
    tokens = stored_tokens(token_file)
    owner = {}
    for sample, values in enumerate(tokens):
        for start in range(0, values.size, SEQ_LEN):
            owner[tuple(values[start : start + SEQ_LEN].tolist())] = int(np.searchsorted(CUTS, sample, side="right") - 1)
    per_source = [0, 0, 0]
    for batch in got:
        for doc in _docs(batch):
            per_source[owner[doc]] += len(doc)
    assert sources["epoch"]["tokens"] == per_source
    assert int(sum(int((b["labels"] != -100).sum()) for b in got)) <= sum(per_source)
    assert all(isinstance(b["tokens"], torch.Tensor) for b in got)
    del it


def test_pack_length_on_the_loader_takes_a_packing_mixture(token_file: Path) -> None:
    own = _loader(token_file, 0).batch_sampler  # a sampler of its own: not shared by loaders
    again = fastload.DataLoader(fastload.HDF5Dataset(str(token_file)), batch_sampler=own, pack_length=SEQ_LEN)
    assert [_docs(b) for b in again] == [_docs(b) for b in _loader(token_file, 0)]
    lengths = fastload.HDF5Dataset(str(token_file)).lengths
    unpacked = fastload.MixtureBatchSampler([lengths[:150], lengths[150:]], proportions=[1, 1], batch_size=4)
    with pytest.raises(ValueError, match=r"MixtureBatchSampler\(\.\.\., pack_length=64"):
        fastload.DataLoader(fastload.HDF5Dataset(str(token_file)), batch_sampler=unpacked, pack_length=SEQ_LEN)
