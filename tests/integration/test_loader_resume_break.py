"""Resume as a training loop meets it, after torchdata's ``StatefulDataLoader`` tests: the
uninterrupted run equals a run checkpointed at batch ``k`` (the ``for`` loop left by ``break``,
or run to its end), then continued by a fresh loader that loaded the state, for ``k`` at the
start, mid-epoch, at the last batch and at the end of the epoch; on the fast path (fastload HDF5
+ ``PadCollate``, length-grouped) and the generic path (a plain map dataset, torch's default
collate), in the calling process and with worker processes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file

N = 96  # 12 batches of 8 per epoch


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_token_file(tmp_path_factory.mktemp("resume_break") / "data.h5", N, 40, seed=3)
    with h5py.File(path, "a") as f:
        f.create_dataset("idx", data=np.arange(N, dtype=np.int64))  # which sample a row is
    return path


class Numbers(Dataset[dict[str, Any]]):
    """A plain map-style dataset: sample ``i`` is ``{"idx": i}``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"idx": torch.tensor(i)}


def _fast(h5: Path, num_workers: int) -> fastload.DataLoader:
    dataset = fastload.HDF5Dataset(h5, fields=["tokens", "idx"])
    return fastload.DataLoader(dataset, batch_size=8, length_grouped=True, seed=5, num_workers=num_workers)


def _generic(h5: Path, num_workers: int) -> fastload.DataLoader:
    generator = torch.Generator().manual_seed(9)
    return fastload.DataLoader(Numbers(), batch_size=8, shuffle=True, generator=generator, num_workers=num_workers)


PATHS: dict[str, Callable[[Path, int], fastload.DataLoader]] = {"fast": _fast, "generic": _generic}


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["idx"].reshape(-1).tolist()


def _checkpoint_at(loader: fastload.DataLoader, k: int | None) -> tuple[list[list[int]], dict[str, Any]]:
    """The batches a training loop takes before it checkpoints, and the state it saves (through
    JSON, as a checkpoint keeps it): ``break`` after ``k`` batches, or (``None``) after the
    ``for`` loop ran to the end of the epoch."""
    taken: list[list[int]] = []
    if k != 0:
        for batch in loader:
            taken.append(_ids(batch))
            if len(taken) == k:
                break
    return taken, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("k", [0, 1, 5, 11, 12, None], ids=lambda k: "end" if k is None else f"k{k}")
def test_a_checkpoint_after_break_resumes_at_the_next_batch(
    h5: Path, path: str, num_workers: int, k: int | None
) -> None:
    make = PATHS[path]
    reference = make(h5, num_workers)
    uninterrupted = [_ids(b) for _ in range(3) for b in reference]

    taken, state = _checkpoint_at(make(h5, num_workers), k)
    resumed = make(h5, num_workers)
    resumed.load_state_dict(state)
    got = taken + [_ids(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]
    assert len(got) >= 2 * 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_at_the_end_of_an_epoch_starts_the_next(h5: Path, num_workers: int) -> None:
    reference = _fast(h5, num_workers)
    epoch0, epoch1 = [_ids(b) for b in reference], [_ids(b) for b in reference]

    taken, state = _checkpoint_at(_fast(h5, num_workers), None)
    assert taken == epoch0
    resumed = _fast(h5, num_workers)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert [_ids(b) for b in resumed] == epoch1
