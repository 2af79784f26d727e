"""A small fastload HDF5 file of random token sequences, for the engine's integration tests."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from fastload._formats._indexing import build_index, write_index


def write_token_file(
    path: Path, samples: int, max_length: int, *, seed: int = 0, label: bool = False, names: bool = False
) -> Path:
    """``samples`` sequences of 1..``max_length - 1`` uint16 ids in the fastload layout; with
    ``label``, an int64 ``label`` field (0..4) per sample; with ``names``, a string ``name``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length, samples).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        f.create_dataset("tokens/values", data=rng.integers(1, 30_000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        if label:
            f.create_dataset("label", data=rng.integers(0, 5, samples).astype(np.int64))
        f.create_dataset("lengths", data=lengths)
        if names:
            f.create_dataset("name", data=[f"s{i}" for i in range(samples)], dtype=h5py.string_dtype())
    return path


def write_documents(path: Path, lengths: list[int], *, vocab: int, seed: int = 0) -> Path:
    """One sample per entry of ``lengths``, uint16 ids in ``1..vocab - 1`` in the fastload
    layout: 0 never occurs, so a packed batch's padding (``pad_value=0``) is told apart from
    every document by its ids alone."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = sizes.size
        f.create_dataset("tokens/values", data=rng.integers(1, vocab, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("lengths", data=sizes)
    return path


def indexed_token_shards(folder: Path, shards: int, samples: int, max_length: int, *, label: bool = False) -> Path:
    """``folder`` holding ``shards`` token files (``part-00000.h5``, ...; shard ``i`` seeded
    ``i``, see :func:`write_token_file`) and their ``fastload-index.json``."""
    for shard in range(shards):
        write_token_file(folder / f"part-{shard:05d}.h5", samples, max_length, seed=shard, label=label)
    write_index(folder, build_index(folder))
    return folder
