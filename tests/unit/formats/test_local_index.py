"""A local folder with ``fastload-index.json`` is read as its index says (``fastload index
--help``): the shards it lists, in its order, and no other; files it does not list are named in
a warning, listed files that are missing are an error. The index is written with the mode a
shard gets (``0666`` less the umask), not ``mkstemp``'s ``0600``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _token_files import write_token_file

import fastload
from fastload._formats._indexing import build_index, write_index
from fastload.errors import DataFileNotFoundError, DataFormatError


def indexed_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    write_token_file(root / "a.h5", 30, 50, seed=1)
    write_token_file(root / "sub" / "b.h5", 20, 50, seed=2)
    write_index(root, build_index(root))
    return root


def test_a_folder_is_read_as_its_index_lists_it(tmp_path: Path) -> None:
    folder = indexed_folder(tmp_path / "corpus")
    dataset = fastload.HDF5Dataset(folder)
    assert dataset.files == [str(folder / "a.h5"), str(folder / "sub" / "b.h5")]
    assert len(dataset) == 50


def test_shards_the_index_does_not_list_are_named_and_not_loaded(tmp_path: Path) -> None:
    folder = indexed_folder(tmp_path / "corpus")
    write_token_file(folder / "c.h5", 7, 50, seed=3)  # written after the index
    write_token_file(folder / "sub" / "d.h5", 5, 50, seed=4)
    with pytest.warns(UserWarning, match=r"2 shard files the index does not list.*: c\.h5, sub/d\.h5"):
        dataset = fastload.HDF5Dataset(folder)
    assert len(dataset) == 50 and str(folder / "c.h5") not in dataset.files


def test_a_listed_shard_that_is_missing_is_an_error(tmp_path: Path) -> None:
    folder = indexed_folder(tmp_path / "corpus")
    (folder / "sub" / "b.h5").unlink()
    with pytest.raises(DataFileNotFoundError, match=r"sub/b\.h5.*fastload index"):
        fastload.HDF5Dataset(folder)


def test_an_index_of_the_other_format_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "arrow"
    folder.mkdir()
    pq.write_table(pa.table({"ids": [[1, 2], [3]]}), folder / "x.parquet")
    write_index(folder, build_index(folder))
    assert len(fastload.ArrowDataset(folder, cache_dir=False)) == 2
    with pytest.raises(DataFormatError, match=r"fastload-index\.json.*arrow.*ArrowDataset"):
        fastload.HDF5Dataset(folder)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_index_gets_the_mode_a_shard_gets(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        folder = indexed_folder(tmp_path / "corpus")
    finally:
        os.umask(previous)
    shard = (folder / "a.h5").stat().st_mode & 0o777
    assert (folder / "fastload-index.json").stat().st_mode & 0o777 == shard == 0o666 & ~umask
