"""Bits flipped in the metadata of a real fastload HDF5 file (seeded, so every run flips the
same ones): reading every sample through the loader, with 0 and with 2 workers, either gives
the data as written or raises a fastload error naming the file; never a bare h5py
``RuntimeError``/``OSError``/``KeyError``/``ValueError``, never a crash or a hang.

The file is laid out as fastload writes it (contiguous arrays). Payload bytes are never
flipped: nothing but a checksum could tell those changed. (Neither could anything tell a flip
in the key of a chunked dataset's chunk index, which HDF5 then reads as the fill value.)"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import fastload
from fastload.errors import FastloadError

SAMPLES = 48
FIELDS = ["tokens", "label"]


def _write(path: Path) -> Path:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 30, SAMPLES).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = SAMPLES
        f.create_dataset("tokens/values", data=rng.integers(1, 30_000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("label", data=rng.integers(0, 5, SAMPLES))
        f.create_dataset("lengths", data=lengths)
    return path


def _metadata_bytes(path: Path) -> np.ndarray:
    """The offsets in ``path`` of every byte that is not a dataset's payload."""
    payload = np.zeros(path.stat().st_size, bool)
    with h5py.File(path, "r") as f:
        for name in ("tokens/values", "tokens/offsets", "lengths", "label"):
            start, size = f[name].id.get_offset(), f[name].id.get_storage_size()
            payload[start : start + size] = True
    return np.flatnonzero(~payload)


def _epoch(path: Path, workers: int) -> list[dict[str, torch.Tensor]]:
    dataset = fastload.HDF5Dataset(path, fields=FIELDS)
    loader = fastload.DataLoader(dataset, batch_size=8, num_workers=workers, timeout=60)
    return list(loader)


def _same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> bool:
    return len(got) == len(want) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize(("workers", "flips"), [(0, 40), (2, 16)])
def test_flipped_metadata_reads_correctly_or_names_the_file(tmp_path: Path, workers: int, flips: int) -> None:
    good = _write(tmp_path / "good.h5")
    want = _epoch(good, 0)
    raw, where = good.read_bytes(), _metadata_bytes(good)
    rng = np.random.default_rng(27)
    outcomes = {"read as written": 0, "named error": 0}
    for trial in range(flips):
        damaged = bytearray(raw)
        at = int(rng.choice(where))
        damaged[at] ^= 1 << int(rng.integers(8))
        # A new name each time: HDF5 keeps a file it failed to close open by name.
        path = tmp_path / f"flip{trial}-byte{at}.h5"
        path.write_bytes(bytes(damaged))
        try:
            got = _epoch(path, workers)
        except FastloadError as exc:
            assert str(path) in str(exc), f"byte {at}: the error does not name the file: {exc!r}"
            outcomes["named error"] += 1
            continue
        assert _same(got, want), f"byte {at}: the loader read other data, and said nothing"
        outcomes["read as written"] += 1
    assert outcomes["named error"] > 0  # the flips do reach metadata HDF5 checks
