"""A small fastload HDF5 file of random token sequences, for the engine's integration tests."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np


def write_token_file(path: Path, samples: int, max_length: int) -> Path:
    """``samples`` sequences of 1..``max_length - 1`` uint16 ids in the fastload layout."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, max_length, samples).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        f.create_dataset("tokens/values", data=rng.integers(1, 30_000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("lengths", data=lengths)
    return path
