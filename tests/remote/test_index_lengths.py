"""An index whose lengths disagree with its shards: the lengths plan every batch (the token
budget included), so a shard is checked against them when it is first read, and a mismatch is
a ``DataFormatError`` naming the shard, the sample, the index's length and the shard's. Real
shards in a real folder, served over HTTP, with a doctored ``fastload-index.json``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import write_token_file

import fastload
from fastload._formats._indexing import build_index, write_index
from fastload.errors import DataFormatError

SAMPLES = 60  # per shard


def _arrow_shard(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 999, int(n)).tolist() for n in rng.integers(1, 200, SAMPLES)]
    table = pa.table({"tokens": pa.array(ids, pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)


def _doctored_folder(root: Path, kind: str) -> tuple[str, int, int, int]:
    """Two shards and an index that says sample 7 of the second is 3 long. Returns the second
    shard's name, that sample's global index, and its lengths in the index and in the shard."""
    folder = root / kind
    folder.mkdir()
    suffix = "h5" if kind == "hdf5" else "arrow"
    for shard in range(2):
        if kind == "hdf5":
            write_token_file(folder / f"part-{shard}.h5", SAMPLES, 200, seed=shard)
        else:
            _arrow_shard(folder / f"part-{shard}.arrow", shard)
    index = build_index(folder)
    sample = SAMPLES + 7
    true = int(index.lengths[sample])
    lengths = index.lengths.copy()
    lengths[sample] = 3 if true != 3 else 4
    write_index(folder, dataclasses.replace(index, lengths=lengths))
    return f"part-1.{suffix}", sample, int(lengths[sample]), true


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["hdf5", "arrow"])
def test_a_shard_whose_lengths_disagree_with_the_index_is_named_when_first_read(
    http_server: Any, tmp_path: Path, kind: str, num_workers: int
) -> None:
    name, sample, indexed, stored = _doctored_folder(http_server.root, kind)
    reader = fastload.HDF5Dataset if kind == "hdf5" else fastload.ArrowDataset
    dataset = reader(f"{http_server.endpoint}/{kind}/", cache_dir=tmp_path / "cache")
    loader = fastload.DataLoader(dataset, max_tokens=256, shuffle=False, num_workers=num_workers)
    pattern = rf"{name}.*sample {sample}.*index says {indexed}.*shard holds {stored}"
    with pytest.raises(DataFormatError, match=pattern):
        for _ in loader:
            pass
