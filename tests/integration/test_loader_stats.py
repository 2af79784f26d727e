"""``loader.stats()`` and friends, wired to a real loader with real workers (timing-free checks:
the arithmetic itself is tested with a manual clock in tests/unit/metrics)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _fault_datasets import Slow
from test_fastpath import _write


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stats") / "data.h5"
    _write(path, 400)
    return path


def test_stats_count_every_batch_sample_and_token(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=16, num_workers=2, length_grouped=True)
    real = padded = 0
    for batch in loader:
        real += int(batch["lengths"].sum())
        padded += batch["attention_mask"].numel()
    stats = loader.stats()
    assert stats.batches == len(loader) and stats.samples == 400
    assert stats.padding_efficiency == pytest.approx(real / padded)
    assert stats.num_workers == 2 and len(stats.worker_busy) == 2
    assert 0.0 <= stats.stall_fraction <= 1.0
    assert stats.first_batch_s is not None and stats.first_batch_s > 0
    assert stats.diagnosis


def test_one_summary_per_epoch(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=50, num_workers=2)
    for _ in range(3):
        for _ in loader:
            pass
    assert [s.epoch for s in loader.epoch_stats] == [0, 1, 2]
    assert all(s.batches == 8 and s.num_workers == 2 for s in loader.epoch_stats)


def test_live_stats_show_slots_in_use_and_per_worker_busy_time(h5: Path) -> None:
    # Host tuning off: every batch comes from a worker (a tuned main process may build the
    # first ones itself, and the workers would then have no busy time to report yet).
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, host_tuning=False)
    it = iter(loader)
    held = [next(it) for _ in range(6)]
    stats = it.stats()
    assert stats.slots_in_use is not None and stats.slots_in_use >= len(held)
    assert stats.worker_read_share is not None and 0.0 <= stats.worker_read_share <= 1.0
    assert any(b > 0 for b in stats.worker_busy)
    del it, held


def test_respawns_and_retries_are_counted() -> None:
    loader = fastload.DataLoader(Slow(200, delay_s=0.002), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    os.kill(it.worker_pids[0], signal.SIGKILL)
    for _ in it:
        pass
    assert loader.stats().respawns == 1
    assert loader.epoch_stats[0].retries >= 1


def test_log_every_s_logs_stats_and_epoch_summaries(h5: Path, caplog: pytest.LogCaptureFixture) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=16, log_every_s=1e-9)
    with caplog.at_level(logging.INFO, logger="fastload"):
        for _ in loader:
            pass
    messages = [r.getMessage() for r in caplog.records if r.name == "fastload"]
    assert len(messages) >= len(loader)
    assert messages[-1].startswith("epoch 0:")


def test_log_every_s_must_be_positive(h5: Path) -> None:
    with pytest.raises(ValueError, match="log_every_s must be a positive"):
        fastload.DataLoader(fastload.HDF5Dataset(h5), log_every_s=0)


def test_progress_bar_reports_on_stderr(h5: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=40, progress=True)
    assert sum(len(b["lengths"]) for b in loader) == 400
    err = capsys.readouterr().err
    assert "10/10" in err and "batch" in err
