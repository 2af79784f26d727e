"""The dataset index: built from real shard folders, written atomically, read back exactly,
and refused with a clear message when damaged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _token_files import write_token_file

import fastload
from fastload._formats._indexing import build_index, sha256_of, write_index
from fastload._remote import INDEX_NAME, DatasetIndex
from fastload.cli import main
from fastload.errors import DataFileNotFoundError, DataFormatError


def hdf5_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    write_token_file(root / "a.h5", 200, 300, seed=1)
    write_token_file(root / "sub" / "b.h5", 50, 3000, seed=2)  # lengths above 255: two bytes
    return root


def test_an_hdf5_folder_indexed_and_read_back(tmp_path: Path) -> None:
    folder = hdf5_folder(tmp_path / "corpus")
    index = build_index(folder)
    written = write_index(folder, index)
    assert written == folder / INDEX_NAME
    back = DatasetIndex.from_json(written.read_bytes(), str(written))
    reference = fastload.HDF5Dataset([folder / "a.h5", folder / "sub" / "b.h5"])
    assert back.kind == "hdf5" and back.fields == reference.fields
    assert back.length_field == "tokens"
    assert [s.path for s in back.shards] == ["a.h5", "sub/b.h5"]  # relative, posix
    assert [s.samples for s in back.shards] == [200, 50]
    assert back.shards[1].bytes == (folder / "sub" / "b.h5").stat().st_size
    assert back.shards[0].sha256 == sha256_of(folder / "a.h5")
    assert np.array_equal(back.lengths, reference.lengths) and not back.lengths.flags.writeable
    assert [t for t in tmp_path.rglob(".fastload-index*")] == []  # no temporary left


def test_an_arrow_and_parquet_folder(tmp_path: Path) -> None:
    table = pa.table({"ids": [[1, 2, 3], [4], [5, 6]], "label": [0, 1, 2]})
    folder = tmp_path / "arrow"
    folder.mkdir()
    pq.write_table(table, folder / "x.parquet")
    with pa.OSFile(str(folder / "y.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    index = build_index(folder)
    assert index.kind == "arrow" and index.lengths.tolist() == [3, 1, 2] * 2
    assert list(index.fields) == ["ids", "label"]


def test_the_cli_writes_it_and_says_what_it_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = hdf5_folder(tmp_path / "c")
    assert main(["index", str(folder)]) == 0
    assert "2 hdf5 shards, 250 samples" in capsys.readouterr().out
    assert (folder / INDEX_NAME).is_file()
    assert main(["index", str(tmp_path / "missing")]) == 2
    assert "is not a directory of shards" in capsys.readouterr().err


def test_folders_it_refuses(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFileNotFoundError, match="holds no shard"):
        build_index(empty)
    mixed = hdf5_folder(tmp_path / "mixed")
    pq.write_table(pa.table({"ids": [[1]]}), mixed / "z.parquet")
    with pytest.raises(DataFileNotFoundError, match="holds both HDF5"):
        build_index(mixed)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: d.update(format="other"), "is not a fastload index"),
        (lambda d: d.update(version=99), "index version 99 is not the supported 1"),
        (lambda d: d["shards"][0].update(path="../escape.h5"), "must be relative to the index"),
        (lambda d: d["shards"][0].update(samples=199), "holds 250 lengths for 249 samples"),
        (lambda d: d["lengths"].update(data="!!"), "damaged fastload index"),
        (lambda d: d.update(kind="zip"), "damaged fastload index .*kind 'zip'"),
    ],
)
def test_a_damaged_index_is_refused_by_name(tmp_path: Path, damage, match: str) -> None:  # type: ignore[no-untyped-def]
    folder = hdf5_folder(tmp_path / "d")
    document = json.loads(build_index(folder).to_json())
    damage(document)
    with pytest.raises(DataFormatError, match=match):
        DatasetIndex.from_json(json.dumps(document).encode(), "s3://bucket/d/fastload-index.json")
    with pytest.raises(DataFormatError, match=r"s3://bucket/d/fastload-index\.json: is not a fastload index"):
        DatasetIndex.from_json(b"\x00garbage", "s3://bucket/d/fastload-index.json")
