"""Workers end when the last reference to what owns them goes, as torch's do, without waiting
for the cyclic garbage collector: ``del loader`` with persistent workers, ``del iterator``
mid-epoch otherwise (the collector is off throughout)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _procs import alive, wait_until


def test_del_loader_ends_its_persistent_workers_at_once(refcounts_only: None) -> None:
    loader = fastload.DataLoader(list(range(40)), batch_size=4, num_workers=2, persistent_workers=True)
    assert sum(len(batch) for batch in loader) == 40
    pids = loader._iterator.worker_pids
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    del loader
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=10.0)


@pytest.mark.parametrize("persistent", [False, True])
def test_del_iterator_mid_epoch_ends_its_workers_at_once(refcounts_only: None, persistent: bool) -> None:
    loader = fastload.DataLoader(list(range(40)), batch_size=4, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    next(it)
    pids = it.worker_pids
    assert len(pids) == 2
    del it
    if persistent:
        del loader  # the loader keeps its persistent iterator, as torch's does
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=10.0)
