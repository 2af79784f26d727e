"""The fast path: workers pad whole batches into shared-memory slots; the consumer gets views.

Every test compares against the generic path (torch's own DataLoader calling
``__getitems__`` + ``PadCollate``) on the same file and the same batches. The central ones run
with both of the workers' builders: the general one (a file's every field) and the one-call
builds (a single token field, ``fields=["tokens"]``).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data
from _procs import alive
from _token_files import write_token_file
from _user_readers import UserReader  # no fastload base class

import fastload

N = 300


def _write(path: Path, n: int = N, seed: int = 0, *, names: bool = False) -> Path:
    return write_token_file(path, n, 120, seed=seed, label=True, names=names)


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fast") / "data.h5"
    _write(path)
    return path


@pytest.fixture(params=["general", "one-call"])
def fields(request: pytest.FixtureRequest) -> list[str] | None:
    """The fields to read: all of them (the general builder), or the token field alone (the
    one-call builds)."""
    return None if request.param == "general" else ["tokens"]


def _collate() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)


def _reference(path: Path, plan: list[list[int]], fields: list[str] | None = None) -> list[dict[str, Any]]:
    """The generic path on torch's own DataLoader."""
    return list(
        torch.utils.data.DataLoader(fastload.HDF5Dataset(path, fields=fields), batch_sampler=plan, collate_fn=_collate())
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _plan(n: int = N, size: int = 16, seed: int = 3) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i : i + size].tolist() for i in range(0, n, size)]


@pytest.mark.parametrize("workers", [0, 2])
def test_fast_path_batches_equal_the_generic_path(h5: Path, workers: int, fields: list[str] | None) -> None:
    plan = _plan()
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5, fields=fields), batch_sampler=plan, num_workers=workers, collate_fn=_collate())
    it = iter(loader)
    assert it.fast_path
    got = list(it)
    for a, b in zip(got, _reference(h5, plan, fields), strict=True):
        _same(a, b)


def test_fast_path_is_the_default_for_a_reader_and_pads_with_padcollate(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2)
    it = iter(loader)
    assert it.fast_path
    batch = next(it)
    assert set(batch) >= {"tokens", "attention_mask", "lengths", "label"}
    assert batch["tokens"].shape == (8, int(batch["lengths"].max()))
    del it


def test_a_user_dataset_with_read_batch_and_lengths_takes_the_fast_path(h5: Path) -> None:
    loader = fastload.DataLoader(UserReader(h5), batch_size=10, num_workers=2, collate_fn=_collate())
    it = iter(loader)
    assert it.fast_path
    assert sum(len(b["lengths"]) for b in it) == N


class _Reversed(fastload.HDF5Dataset):
    """A reader subclass whose own ``read_batch`` changes the samples (each row reversed)."""

    def read_batch(self, indices: Any) -> Any:
        batch = super().read_batch(indices)
        tokens = batch["tokens"]
        starts = np.concatenate([[0], np.cumsum(tokens.lengths)[:-1]])
        rows = [tokens.values[s : s + n][::-1] for s, n in zip(starts, tokens.lengths, strict=True)]
        return {**batch, "tokens": type(tokens)(np.concatenate(rows), tokens.lengths)}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_subclass_that_overrides_read_batch_is_read_through_it(h5: Path, workers: int, fields: list[str] | None) -> None:
    plan = _plan()[:6]
    loader = fastload.DataLoader(_Reversed(h5, fields=fields), batch_sampler=plan, num_workers=workers, collate_fn=_collate())
    for got, want in zip(loader, _reference(h5, plan, fields), strict=True):
        for row, n in enumerate(want["lengths"].tolist()):
            assert torch.equal(got["tokens"][row, :n], want["tokens"][row, :n].flip(0))


class _NoLen(torch.utils.data.Dataset):
    """``read_batch`` and ``lengths`` but no ``__len__``: its batches come from a plan."""

    def __init__(self, path: Path) -> None:
        self.inner = fastload.HDF5Dataset(path, fields=["tokens"])
        self.lengths, self.fields = self.inner.lengths, self.inner.fields

    def read_batch(self, indices: Any) -> Any:
        return self.inner.read_batch(indices)


def test_a_dataset_without_len_takes_the_fast_path_with_workers(h5: Path) -> None:
    plan = _plan()[:5]
    loader = fastload.DataLoader(_NoLen(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate())
    for a, b in zip(loader, _reference(h5, plan, ["tokens"]), strict=True):
        _same(a, b)


@pytest.mark.parametrize("options", [{"length_grouped": True, "batch_size": 16}, {"max_tokens": 600}])
def test_length_grouped_fast_path_covers_the_epoch_once(h5: Path, options: dict[str, Any]) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), num_workers=2, collate_fn=_collate(), **options)
    seen: list[int] = []
    for batch in loader:
        seen.extend(batch["lengths"].tolist())
        if "max_tokens" in options:
            assert batch["tokens"].numel() <= options["max_tokens"]
    lengths = fastload.HDF5Dataset(h5).lengths
    assert sorted(seen) == sorted(lengths.tolist())
    assert len(seen) == len(loader.batch_sampler.lengths)


def test_held_batches_never_change(h5: Path, fields: list[str] | None) -> None:
    plan = _plan(size=5)  # 60 batches
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5, fields=fields), batch_sampler=plan, num_workers=2, collate_fn=_collate())
    held = list(loader)  # keeps all 60 alive while the workers keep writing
    assert len(held) == 60
    gc.collect()
    for a, b in zip(held, _reference(h5, plan, fields), strict=True):
        _same(a, b)


def test_slots_are_reused_when_batches_are_released(h5: Path) -> None:
    plan = _plan(size=4) * 3
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate())
    it = iter(loader)
    next(it)
    start = it._runner._arena.total_bytes
    for _ in it:
        pass
    assert it._runner is None  # released at the end of the epoch
    assert start > 0


class _Plan:
    """A user's batch sampler that claims batches of 2 rows but yields one far larger."""

    batch_size = 2

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_an_oversize_batch_gets_a_temporary_slot(h5: Path, fields: list[str] | None) -> None:
    plan = [[0, 1], list(range(2, N)), [0], [3, 4]]
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5, fields=fields), batch_sampler=_Plan(plan), num_workers=1, collate_fn=_collate())
    it = iter(loader)
    codec = it._runner._codec
    for a, b in zip(it, _reference(h5, plan, fields), strict=True):
        _same(a, b)
    assert codec.oversize_batches == 1


def test_object_fields_pass_through_the_fast_path(tmp_path: Path) -> None:
    path = tmp_path / "names.h5"
    _write(path, 40, names=True)
    loader = fastload.DataLoader(fastload.HDF5Dataset(path), batch_size=7, num_workers=2, collate_fn=_collate())
    names = [n for b in loader for n in b["name"]]
    assert names == [f"s{i}" for i in range(40)]


class _FailsAt(torch.utils.data.Dataset):
    def __init__(self, path: Path, bad: int) -> None:
        self.inner = fastload.HDF5Dataset(path)
        self.lengths, self.fields, self.bad = self.inner.lengths, self.inner.fields, bad

    def __len__(self) -> int:
        return len(self.inner)

    def read_batch(self, indices: Any) -> Any:
        if self.bad in list(indices):
            raise ValueError(f"sample {self.bad} is corrupt")
        return self.inner.read_batch(indices)


def test_a_read_error_in_a_worker_names_the_batch_and_indices_and_frees_its_slot(h5: Path) -> None:
    loader = fastload.DataLoader(_FailsAt(h5, bad=21), batch_size=10, num_workers=2, collate_fn=_collate())
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(ValueError, match=r"(?s)worker process \d.*batch 2 from sample indices \[20, 21,.*sample 21 is corrupt"):
        next(it)
    rest = list(it)  # the epoch goes on after the failed batch, as with torch
    assert len(rest) == len(loader) - 3


def test_killing_a_worker_during_fast_path_iteration_loses_nothing(tmp_path: Path, fields: list[str] | None) -> None:
    path = tmp_path / "big.h5"
    _write(path, 3000)
    plan = _plan(3000, size=8)
    loader = fastload.DataLoader(fastload.HDF5Dataset(path, fields=fields), batch_sampler=plan, num_workers=2, collate_fn=_collate())
    it = iter(loader)
    got = [next(it) for _ in range(5)]
    os.kill(it.worker_pids[0], signal.SIGKILL)
    got.extend(it)
    ref = _reference(path, plan, fields)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        _same(a, b)


def test_persistent_workers_keep_their_slots_across_epochs(h5: Path) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=32, num_workers=2, persistent_workers=True, collate_fn=_collate()
    )
    first = [b["lengths"].clone() for b in loader]
    it = loader._iterator
    arena = it._runner._arena
    for _ in range(3):
        again = [b["lengths"].clone() for b in loader]
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert loader._iterator._runner._arena is arena


def test_breaking_out_of_a_persistent_epoch_then_iterating_again_is_exact(h5: Path) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=16, num_workers=2, persistent_workers=True, collate_fn=_collate()
    )
    for i, _ in enumerate(loader):
        if i == 2:
            break
    full = [b["lengths"].tolist() for b in loader]
    assert sum(len(x) for x in full) == N
    assert [x for b in full for x in b] == fastload.HDF5Dataset(h5).lengths.tolist()


def test_pin_memory_without_cuda_warns_and_returns_the_same_batches(h5: Path) -> None:
    plan = _plan()
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate(), pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator"):
        got = list(loader)
    for a, b in zip(got, _reference(h5, plan), strict=True):
        _same(a, b)


def test_device_cuda_without_cuda_is_a_clear_error_at_construction(h5: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, device="cuda")


def test_device_cpu_is_a_no_op(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=50, device="cpu", collate_fn=_collate())
    assert sum(len(b["lengths"]) for b in loader) == N


def test_rss_stays_flat_over_many_epochs(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=16, num_workers=2, collate_fn=_collate())
    proc = psutil.Process()

    def epochs(k: int) -> None:
        for _ in range(k):
            for batch in loader:
                del batch
        gc.collect()

    epochs(5)
    rss = proc.memory_info().rss
    epochs(40)
    assert proc.memory_info().rss - rss < 24 * 2**20


def test_a_hundred_persistent_epochs_leave_memory_descriptors_and_threads_flat(h5: Path) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=32, num_workers=2, persistent_workers=True, collate_fn=_collate()
    )
    proc = psutil.Process()

    def epochs(k: int) -> int:
        rows = 0
        for _ in range(k):
            for batch in loader:
                rows += len(batch["lengths"])
                del batch
        gc.collect()
        return rows

    assert epochs(5) == 5 * N
    rss, fds, threads = proc.memory_info().rss, proc.num_fds(), threading.active_count()
    assert epochs(95) == 95 * N
    assert proc.memory_info().rss - rss < 16 * 2**20
    # No growth: fewer is fine (an earlier test's worker, reaped meanwhile, may have held some).
    assert proc.num_fds() <= fds
    assert threading.active_count() <= threads


_PARENT = textwrap.dedent(
    """
    import sys, torch, fastload
    ds = fastload.HDF5Dataset({path!r})
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=fastload.PadCollate())
    it = iter(loader)
    next(it)
    print(" ".join(map(str, it.worker_pids)), flush=True)
    import time
    while True:
        time.sleep(1)
    """
)


def test_sigkill_of_the_parent_during_fast_path_leaves_no_worker_and_no_shm(h5: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-c", _PARENT.format(path=str(h5))], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30  # bounds a wait, not a race: passes with every core busy
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, "workers outlived their parent by 30 s"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()  # type: ignore[union-attr]
    # Only fastload's or torch's names: other programs on the machine create their own meanwhile.
    assert {e for e in set(os.listdir("/dev/shm")) - before if "torch" in e or "fastload" in e} == set()


@pytest.mark.gpu
def test_async_device_copies_equal_synchronous_copies(h5: Path) -> None:
    plan = _plan()
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate(), device="cuda"
    )
    for got, ref in zip(loader, _reference(h5, plan), strict=True):
        assert got["tokens"].is_cuda
        torch.cuda.current_stream().synchronize()
        _same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}, ref)


@pytest.mark.gpu
def test_slots_are_page_locked_with_cuda(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, pin_memory=True, collate_fn=_collate())
    batch = next(iter(loader))
    assert batch["tokens"].is_pinned()


@pytest.mark.gpu
def test_gpu_idle_is_measured_with_cuda_events(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate(), device="cuda")
    it = iter(loader)
    for batch in it:
        torch.cuda._sleep(1_000_000)  # a long GPU step: the loader keeps up, the GPU never waits
        batch["tokens"].sum()
    stats = it.stats()
    assert stats.gpu_idle_s is not None
    assert 0.0 <= stats.gpu_idle_s < 0.1 * stats.step_s + 0.05


@pytest.mark.parametrize("device", [None, pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bad", [5, 21, N - 5])
def test_with_device_cuda_a_failed_batch_raises_in_its_turn_and_the_epoch_goes_on(
    h5: Path, device: str | None, workers: int, bad: int
) -> None:
    # The device prefetcher holds one batch ahead: the error of a batch must not cost the batch
    # before it, nor end the epoch (the host path, device=None, goes on too), and every other
    # batch arrives, on the device, equal to the host path's, its rows counted once.
    loader = fastload.DataLoader(
        _FailsAt(h5, bad=bad), batch_size=10, num_workers=workers, collate_fn=_collate(), device=device
    )
    failed = bad // 10
    it = iter(loader)
    got: list[dict[str, Any] | None] = []
    for _ in range(len(loader)):
        try:
            got.append(next(it))
        except ValueError as exc:
            assert f"sample {bad} is corrupt" in str(exc)
            got.append(None)
    with pytest.raises(StopIteration):
        next(it)
    assert [i for i, batch in enumerate(got) if batch is None] == [failed]
    reference = _reference(h5, [list(range(i, min(i + 10, N))) for i in range(0, N, 10)])
    for i, (batch, ref) in enumerate(zip(got, reference, strict=True)):
        if batch is None:
            continue
        assert batch["tokens"].is_cuda == (device == "cuda"), i
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        _same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, ref)
    stats = it.stats()
    assert (stats.batches, stats.samples) == (len(loader) - 1, N - 10)
    assert (stats.gpu_idle_s is not None) == (device == "cuda")
