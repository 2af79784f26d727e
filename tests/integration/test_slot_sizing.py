"""The fast path's batch slots are sized from the batches that come when the sampler does not
say what its batches hold (a user's own batch sampler), so a batch sampler torch accepts is
never refused and no memory is reserved that no batch needs."""

from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import Sampler

import fastload
from fastload.errors import SharedMemoryError

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file

N = 50_000
ROWS = 64


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("sizing") / "large.h5", N, 512)


class RandomBatches(Sampler[list[int]]):
    """A user's batch sampler (another library's bucketing sampler, say): random batches of
    ``rows`` indices, with no ``batch_size`` or ``max_tokens`` attribute to tell their size."""

    def __init__(self, n: int, rows: int, batches: int, seed: int = 0) -> None:
        self.n, self.rows, self.batches, self.seed = n, rows, batches, seed

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        rng = np.random.default_rng(self.seed)
        for _ in range(self.batches):
            yield rng.integers(0, self.n, self.rows).tolist()


def _slot_bytes() -> int:
    """Bytes of the batch slots this process holds now: its memfd segments (each counted once:
    a memory map holds a descriptor of its own on the same file)."""
    sizes: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "fastload-slots" in os.readlink(f"/proc/self/fd/{fd}"):
                stat = os.fstat(int(fd))
                sizes[stat.st_ino] = stat.st_size
        except OSError:
            continue
    return sum(sizes.values())


def _nbytes(batch: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def test_a_users_batch_sampler_gets_slots_sized_from_its_batches(h5: Path) -> None:
    gc.collect()  # a persistent-workers loader of an earlier test is freed only by the collector
    before = _slot_bytes()
    ds = fastload.HDF5Dataset(h5)
    sampler = RandomBatches(N, ROWS, 120)
    reference = list(fastload.DataLoader(ds, batch_sampler=sampler, collate_fn=fastload.PadCollate()))
    loader = fastload.DataLoader(ds, batch_sampler=sampler, collate_fn=fastload.PadCollate(), num_workers=2)
    peak = largest = 0
    got = []
    for batch in loader:
        peak = max(peak, _slot_bytes())
        largest = max(largest, _nbytes(batch))
        got.append({k: v.clone() for k, v in batch.items()})
        del batch
    assert len(got) == len(reference) == 120
    for a, b in zip(got, reference, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # prefetch_factor * num_workers + 2 = 6 slots (with some headroom each, and for a moment
    # twice that while they are remade larger): a few batches' worth, not the whole dataset's
    # (50,000 rows of up to 511 tokens would be 255 MB per slot).
    assert peak <= 16 * largest, f"{peak / 2**20:.1f} MiB of slots for batches of {largest / 2**20:.2f} MiB"
    assert _slot_bytes() == before  # released at the end of the epoch


def test_batches_larger_than_the_first_get_room_without_a_refusal(h5: Path) -> None:
    # The first batches are short, then the sampler moves to its longest samples: the slots
    # are remade larger (or a batch takes a temporary slot), and every batch arrives intact.
    ds = fastload.HDF5Dataset(h5)
    order = np.argsort(ds.lengths, kind="stable")
    plan = [order[i : i + ROWS].tolist() for i in range(0, N, N // 40)][:40]

    class Growing(Sampler[list[int]]):
        def __len__(self) -> int:
            return len(plan)

        def __iter__(self) -> Any:
            return iter(plan)

    reference = list(fastload.DataLoader(ds, batch_sampler=Growing(), collate_fn=fastload.PadCollate()))
    loader = fastload.DataLoader(ds, batch_sampler=Growing(), collate_fn=fastload.PadCollate(), num_workers=2)
    for a, b in zip(loader, reference, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _one_long_sample(path: Path, tokens: int, at: int = 777) -> Path:
    """2,000 samples of 1..59 tokens, but sample ``at`` has ``tokens``."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, 2_000).astype(np.int64)
    lengths[at] = tokens
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = len(lengths)
        f.create_dataset("tokens/values", data=rng.integers(1, 30_000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("lengths", data=lengths)
    return path


def _five_bytes_a_token() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int32, mask_dtype=torch.bool)


def test_a_bound_that_does_not_fit_in_shared_memory_is_not_a_refusal(tmp_path: Path) -> None:
    # One sample of 40,000 tokens among short ones: with batch_size=64 the largest possible
    # batch is 64 rows of 40,000 (12.8 MB), six of which do not fit in max_shared_bytes. The
    # slots are then sized from the batches that come; the one batch holding the long sample
    # gets a temporary slot of its own, as torch's loader would allocate it too.
    ds = fastload.HDF5Dataset(_one_long_sample(tmp_path / "one_long.h5", 40_000))
    reference = list(fastload.DataLoader(ds, batch_size=64, collate_fn=_five_bytes_a_token()))
    loader = fastload.DataLoader(
        ds, batch_size=64, num_workers=2, max_shared_bytes=32 << 20, collate_fn=_five_bytes_a_token()
    )
    got = 0
    for a, b in zip(loader, reference, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
        got += 1
    assert got == len(reference) == 32


def test_a_temporary_slot_past_max_shared_bytes_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    # One sample of 4,000,000 tokens: its batch of 64 rows needs 1.2 GiB, 80 times
    # max_shared_bytes. The batches before it come; its own is refused before any memory is
    # taken for it, with the bound, the size needed, the samples and what to change.
    ds = fastload.HDF5Dataset(_one_long_sample(tmp_path / "huge.h5", 4_000_000, at=300))
    loader = fastload.DataLoader(
        ds, batch_size=64, num_workers=2, max_shared_bytes=16 << 20, collate_fn=_five_bytes_a_token()
    )
    it = iter(loader)
    for _ in range(300 // 64):
        next(it)
    with pytest.raises(SharedMemoryError) as caught:
        next(it)
    message = str(caught.value)
    assert "max_shared_bytes (16.0 MiB)" in message
    needed = re.search(r"needs ([0-9.]+) MiB", message)
    assert needed is not None and float(needed.group(1)) >= 64 * 4_000_000 * 5 / 2**20
    assert "the batch of 64 samples [256, 257," in message
    assert "Raise max_shared_bytes to at least" in message
