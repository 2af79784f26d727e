"""``loader.stats()`` and friends, wired to a real loader with real workers (timing-free checks:
the arithmetic itself is tested with a manual clock in tests/unit/metrics)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


class _SlowToStart(torch.utils.data.Sampler[list[int]]):
    """A batch sampler whose ``iter()`` itself takes ``delay_s`` (not lazily, at the first
    batch), as an iterator over a remote dataset whose ``iter()`` lists and opens shards does."""

    def __init__(self, n: int, batch_size: int, delay_s: float) -> None:
        self.batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        time.sleep(self.delay_s)
        return iter(self.batches)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_first_batch_time_counts_from_the_call_to_iter(h5: Path, num_workers: int) -> None:
    dataset = fastload.HDF5Dataset(h5)
    loader = fastload.DataLoader(
        dataset, batch_sampler=_SlowToStart(len(dataset), 16, 0.5), num_workers=num_workers
    )
    for _ in range(2):
        for _ in loader:
            pass
    # iter() alone slept 0.5 s in each epoch: start-up the consumer waited for.
    assert all(s.first_batch_s is not None and s.first_batch_s >= 0.5 for s in loader.epoch_stats)
    run = loader.stats()
    assert run.first_batch_s is not None and run.first_batch_s >= 0.5


def test_stats_between_epochs_name_the_epoch_just_ended_and_count_it_alone(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=50, num_workers=2)
    for epoch in range(3):
        for _ in loader:
            pass
        run, last = loader.stats(), loader.stats("epoch")
        assert loader.epoch_stats[-1].epoch == epoch
        assert (run.epoch, last.epoch) == (epoch, epoch)
        assert last.batches == 8 and last == loader.epoch_stats[-1]
        assert run.scope == "run" and run.batches == 8 * (epoch + 1) and run.epoch_batches == 8
        text = str(run)
        assert text.startswith(f"run ({epoch + 1} epoch") and f"8 in epoch {epoch}" in text
        assert str(last).startswith(f"epoch {epoch} | 8 batches |")


def test_epochs_are_numbered_as_the_sampler_numbers_them(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=50, length_grouped=True)
    loader.set_epoch(5)
    for _ in range(2):
        for _ in loader:
            pass
    assert [s.epoch for s in loader.epoch_stats] == [5, 6]
    assert loader.stats().epoch == 6 and loader.state_dict()["sampler"]["epoch"] == 6


def test_a_loop_that_breaks_off_leaves_the_next_epoch_its_own_start_up_and_counts(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=50)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    for _ in loader:
        pass
    (summary,) = loader.epoch_stats
    assert summary.epoch == 1 and summary.batches == 8 and summary.first_batch_s is not None
    assert loader.stats().batches == 11  # the run: the broken-off iteration's 3 batches too


def test_the_advice_fits_whether_the_loader_is_on_the_fast_path(h5: Path) -> None:
    fast = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=16, num_workers=2)
    plain = fastload.DataLoader(Slow(64), batch_size=16, num_workers=2)
    for loader, on_it in ((fast, True), (plain, False)):
        for _ in loader:
            pass
        stats = loader.stats()
        assert stats.fast_path is on_it and loader.epoch_stats[0].fast_path is on_it
        # The figures of a delivery-bound run, on this loader's own snapshot.
        stalled = dataclasses.replace(
            stats, steady_batches=100, stall_fraction=0.3, worker_busy=(0.2, 0.2), storage_wait_share=None
        ).with_diagnosis()
        assert stalled.diagnosis.startswith("delivery-bound")
        assert ("use the fast path (a dataset" in stalled.diagnosis) is not on_it
