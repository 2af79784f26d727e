"""``DataLoader(readahead=True)``: workers tell the kernel which byte ranges the tasks queued
behind their current one will read (``willneed``), with real worker processes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file


class Recording(fastload.HDF5Dataset):
    """A reader that appends the indices of each ``willneed`` call to a file, one line per
    call, and builds each batch slowly (so that tasks queue behind the one being built)."""

    def __init__(self, path: Path, log: Path) -> None:
        super().__init__(path)
        self.log = log

    def willneed(self, indices: npt.ArrayLike) -> int:
        advised = super().willneed(indices)
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()} {advised} " + " ".join(map(str, np.asarray(indices).tolist())) + "\n")
        return advised

    def read_batch(self, indices: npt.ArrayLike) -> Any:
        time.sleep(0.01)
        return super().read_batch(indices)


@pytest.mark.parametrize("readahead", [True, False])
def test_workers_hint_the_batches_queued_behind_their_current_one(tmp_path: Path, readahead: bool) -> None:
    path = write_token_file(tmp_path / "t.h5", 400, 300, seed=0)
    log = tmp_path / "hints.log"
    dataset = Recording(path, log)
    loader = fastload.DataLoader(
        dataset, batch_size=8, shuffle=True, num_workers=2, prefetch_factor=4, readahead=readahead,
        collate_fn=fastload.PadCollate(),
    )
    batches = [b["lengths"].tolist() for b in loader]
    assert sorted(n for b in batches for n in b) == sorted(dataset.lengths.tolist())
    if not readahead:
        assert not log.exists()
        return
    calls = [line.split() for line in log.read_text().splitlines()]
    assert calls, "no worker hinted a queued task"
    hinted = [sorted(map(int, c[2:])) for c in calls]
    assert all(len(h) == 8 and h[0] >= 0 and h[-1] < 400 for h in hinted)  # whole batches
    assert all(int(c[1]) > 0 for c in calls)  # the fastload layout: ranges known, bytes advised
    assert os.getpid() not in {int(c[0]) for c in calls}  # the workers hint, not the main process


def test_readahead_is_checked() -> None:
    with pytest.raises((TypeError, ValueError), match="readahead"):
        fastload.DataLoader(range(4), readahead="yes")


def test_a_bad_index_in_a_queued_task_fails_its_batch_not_the_worker(tmp_path: Path) -> None:
    # The hint of the bad task is ignored; its read raises what torch's loader would.
    path = write_token_file(tmp_path / "t.h5", 40, 50, seed=0)
    batches = [[0, 1], [2, 3], [4, 999], [5, 6]]
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(path), batch_sampler=batches, num_workers=1, prefetch_factor=4,
        readahead=True, collate_fn=fastload.PadCollate(),
    )
    it = iter(loader)
    assert [next(it)["lengths"].shape[0] for _ in range(2)] == [2, 2]
    with pytest.raises(IndexError, match="999"):
        next(it)
