"""A user's own reader and collate take the fast path through the protocols alone
(``fastload._protocols``), with no fastload base class: the README's example, run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file


class TokenLists(torch.utils.data.Dataset):
    """Token id lists held in memory, read a batch at a time (the README's reader)."""

    process_independent_reads = True  # the same bytes in any process: any worker may build a batch

    def __init__(self, docs: list[np.ndarray]) -> None:
        self._values = np.concatenate(docs).astype(np.int32)
        self._offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
        self.lengths = np.diff(self._offsets)
        self.fields = {"tokens": fastload.Field("tokens", "ragged", np.dtype(np.int32))}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self._values[self._offsets[i] : self._offsets[i + 1]]

    def read_batch(self, indices: Any) -> dict[str, Any]:
        idx = np.asarray(indices, dtype=np.int64)
        rows = [self._values[self._offsets[i] : self._offsets[i + 1]] for i in idx]
        return {"tokens": fastload.Ragged(np.concatenate(rows), self.lengths[idx])}


class FixedLength:
    """Cuts or pads every row to ``length`` ids: batches of one shape (the README's collate)."""

    process_independent = True

    def __init__(self, length: int = 64) -> None:
        self.length = length

    def layout(self, batch: dict[str, Any]) -> dict[str, Any]:
        rows = len(batch["tokens"].lengths)
        return {"input_ids": ((rows, self.length), np.dtype(np.int64))}

    def collate_into(self, batch: dict[str, Any], out: dict[str, np.ndarray]) -> None:
        tokens, ids = batch["tokens"], out["input_ids"]
        ids.fill(0)
        start = 0
        for row, n in enumerate(tokens.lengths.tolist()):
            keep = min(n, self.length)
            ids[row, :keep] = tokens.values[start : start + keep]
            start += n

    def __call__(self, samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
        lengths = np.array([len(s) for s in samples])
        batch = {"tokens": fastload.Ragged(np.concatenate(samples), lengths)}
        out = {"input_ids": np.empty((len(samples), self.length), np.int64)}
        self.collate_into(batch, out)
        return {"input_ids": torch.from_numpy(out["input_ids"])}


def _docs(n: int = 500) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 1000, rng.integers(1, 150)) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_users_reader_and_collate_take_the_fast_path(workers: int) -> None:
    docs = _docs()
    loader = fastload.DataLoader(TokenLists(docs), batch_size=32, num_workers=workers, collate_fn=FixedLength())
    it = iter(loader)
    assert it.fast_path
    got = torch.cat([b["input_ids"] for b in it])
    want = FixedLength()([d.astype(np.int32) for d in docs])["input_ids"]
    assert torch.equal(got, want)


def test_a_users_collate_gets_whole_ragged_columns_from_fastloads_own_readers(tmp_path: Path) -> None:
    # HDF5Dataset can leave samples in its map (Spans) for a collate that gathers from there;
    # a collate that does not say it takes them gets Ragged columns, as read_batch returns.
    ds = fastload.HDF5Dataset(write_token_file(tmp_path / "t.h5", 300, 100))
    loader = fastload.DataLoader(ds, batch_size=16, num_workers=2, collate_fn=FixedLength(32))
    got = torch.cat([b["input_ids"] for b in loader])
    want = FixedLength(32)([ds[i]["tokens"].astype(np.int32) for i in range(len(ds))])["input_ids"]
    assert torch.equal(got, want)
