"""``num_workers="auto"`` with real workers: the pool grows when the loader cannot keep up and
stays at one when one suffices; the batches never change."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _fault_datasets import Slow
from _token_files import write_token_file


def _consume(loader: fastload.DataLoader, step_s: float, seconds: float) -> list[int]:
    seen: list[int] = []
    deadline = time.monotonic() + seconds
    it = iter(loader)
    for batch in it:
        seen.extend(batch.tolist())
        time.sleep(step_s)
        if time.monotonic() > deadline:
            break
    del it
    return seen


@pytest.mark.slow
def test_a_slow_loader_grows_to_the_core_count() -> None:
    cores = fastload._metrics.available_cores()
    loader = fastload.DataLoader(Slow(100_000, delay_s=0.004), batch_size=4, num_workers="auto")
    seen = _consume(loader, step_s=0.001, seconds=8)
    assert seen == list(range(len(seen)))  # order and content do not depend on the pool size
    assert loader.stats().num_workers == cores


@pytest.mark.slow
def test_a_fast_loader_settles_at_one_worker() -> None:
    loader = fastload.DataLoader(Slow(100_000), batch_size=4, num_workers="auto")
    seen = _consume(loader, step_s=0.05, seconds=5)  # a batch takes ~0.1 ms to build
    assert seen == list(range(len(seen)))
    assert loader.stats().num_workers == 1


def test_auto_workers_give_the_same_batches_as_a_fixed_pool() -> None:
    ds = Slow(200)
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    fixed = [b.tolist() for b in fastload.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, generator=gen())]
    auto = [b.tolist() for b in fastload.DataLoader(ds, batch_size=8, shuffle=True, num_workers="auto", generator=gen())]
    assert auto == fixed


@pytest.mark.parametrize("path", ["generic", "fast"])
def test_a_declined_retirement_holds_back_no_task(path: str, tmp_path: Path) -> None:
    # Two requests in a row: the first retires a worker (two tasks fewer in flight), the second
    # is declined (one retirement at a time). Holding back tasks for it too would leave nothing
    # in flight: the generic path ended the epoch early, the fast path waited for ever.
    if path == "generic":
        loader = fastload.DataLoader(Slow(40), batch_size=2, num_workers=2, timeout=5)
        expected = list(range(40))
    else:
        h5 = write_token_file(tmp_path / "t.h5", 40, 20)
        loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=2, num_workers=2, timeout=5)
        expected = fastload.HDF5Dataset(h5).lengths.tolist()
    it = iter(loader)
    got = [next(it) for _ in range(2)]
    it._runner.retire_worker()
    it._runner.retire_worker()
    got.extend(it)
    if path == "generic":
        assert [int(v) for b in got for v in b] == expected
    else:
        assert [int(v) for b in got for v in b["lengths"]] == expected
