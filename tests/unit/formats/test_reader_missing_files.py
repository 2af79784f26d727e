"""A file the caller named that is not there is a ``FileNotFoundError`` (hence an ``OSError``),
still a ``DataFormatError`` as before, with ``filename`` set and a message naming the path:
at construction, and when a shard is deleted after it."""

from __future__ import annotations

import errno
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
from _format_files import (
    Corpus,
    corpus_table,
    write_arrow_file,
    write_fastload,
    write_parquet,
)

import fastload
from fastload import ArrowDataset, HDF5Dataset
from fastload.errors import DataFileNotFoundError, DataFormatError

# Each case builds what the reader is given in tmp_path and says which path is missing.
Case = Callable[[Path, Corpus], tuple[type, object, str]]


def _list_with_a_missing_shard(tmp: Path, corpus: Corpus) -> tuple[type, object, str]:
    first = write_fastload(tmp / "part-0.h5", corpus)
    return HDF5Dataset, [first, tmp / "part-1.h5"], str(tmp / "part-1.h5")


def _arrow_list_with_a_missing_shard(tmp: Path, corpus: Corpus) -> tuple[type, object, str]:
    first = write_arrow_file(tmp / "part-0.arrow", corpus_table(corpus), 8)
    return ArrowDataset, [first, tmp / "part-1.parquet"], str(tmp / "part-1.parquet")


def _state_json_listing_a_missing_file(tmp: Path, corpus: Corpus) -> tuple[type, object, str]:
    folder = tmp / "saved"
    folder.mkdir()
    write_arrow_file(folder / "data-0.arrow", corpus_table(corpus), 8)
    names = [{"filename": "data-0.arrow"}, {"filename": "data-1.arrow"}]
    (folder / "state.json").write_text(json.dumps({"_data_files": names}))
    return ArrowDataset, folder, str(folder / "data-1.arrow")


def _empty_directory(tmp: Path, corpus: Corpus) -> tuple[type, object, str]:
    (tmp / "empty").mkdir()
    return HDF5Dataset, tmp / "empty", str(tmp / "empty")


CASES: dict[str, Case] = {
    "hdf5-file": lambda tmp, c: (HDF5Dataset, tmp / "missing.h5", str(tmp / "missing.h5")),
    "arrow-file": lambda tmp, c: (ArrowDataset, tmp / "missing.arrow", str(tmp / "missing.arrow")),
    "parquet-file": lambda tmp, c: (ArrowDataset, tmp / "gone.parquet", str(tmp / "gone.parquet")),
    "hdf5-shard-in-a-list": _list_with_a_missing_shard,
    "arrow-shard-in-a-list": _arrow_list_with_a_missing_shard,
    "missing-directory": lambda tmp, c: (ArrowDataset, tmp / "no" / "dir", str(tmp / "no" / "dir")),
    "glob-matching-nothing": lambda tmp, c: (
        HDF5Dataset,
        str(tmp / "shards-*.h5"),
        str(tmp / "shards-*.h5"),
    ),
    "empty-directory": _empty_directory,
    "state-json-listing-a-missing-file": _state_json_listing_a_missing_file,
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("caught_as", [FileNotFoundError, OSError, DataFormatError, ValueError])
def test_a_missing_path_is_caught_as_file_not_found_and_as_before(
    case: str, caught_as: type[BaseException], corpus: Corpus, tmp_path: Path
) -> None:
    reader, path, missing = CASES[case](tmp_path, corpus)
    with pytest.raises(caught_as) as info:
        reader(path)
    error = info.value
    assert isinstance(error, DataFileNotFoundError)
    assert error.filename == missing
    assert error.errno == errno.ENOENT
    assert missing in str(error)
    assert not str(error).startswith("[Errno"), "the message is fastload's, not OSError's format"


def test_the_error_is_exported_and_keeps_its_path_through_pickling() -> None:
    assert "DataFileNotFoundError" in fastload.errors.__all__
    error = DataFileNotFoundError("/data/a.h5: no such file or directory", "/data/a.h5")
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is DataFileNotFoundError
    assert (str(clone), clone.filename, clone.errno) == (str(error), "/data/a.h5", errno.ENOENT)
    assert str(DataFileNotFoundError("only a message")) == "only a message"


@pytest.mark.parametrize("kind", ["hdf5", "arrow", "parquet-without-copy", "parquet-copy"])
def test_a_shard_deleted_after_construction_is_a_file_not_found_error_at_read(
    kind: str, corpus: Corpus, tmp_path: Path
) -> None:
    table = corpus_table(corpus)
    if kind == "hdf5":
        paths = [write_fastload(tmp_path / f"p{k}.h5", corpus.slice(0, 20)) for k in range(2)]
        ds: HDF5Dataset | ArrowDataset = HDF5Dataset(paths)
    elif kind == "arrow":
        paths = [
            write_arrow_file(tmp_path / f"p{k}.arrow", table.slice(0, 20), 8) for k in range(2)
        ]
        ds = ArrowDataset(paths)
    else:
        paths = [write_parquet(tmp_path / f"p{k}.parquet", table.slice(0, 20), 8) for k in range(2)]
        if kind == "parquet-copy":
            ds = ArrowDataset(paths, cache_dir=tmp_path / "cache")
        else:
            ds = ArrowDataset(paths, cache_dir=False)
    if kind == "parquet-copy":
        (gone,) = (tmp_path / "cache" / "parquet").glob("p1.*.arrow")
        paths[1].unlink()  # the copy serves the reads: this changes nothing
        ds.read_batch([3, 25])
        ds.close()
        gone.unlink()
    else:
        gone = paths[1]
        gone.unlink()
    ds.read_batch([0, 1])  # the first shard is still there
    with pytest.raises(FileNotFoundError) as info:
        ds.read_batch([3, 25])
    assert isinstance(info.value, DataFormatError)
    assert info.value.filename == str(gone)
    assert str(paths[1]) in str(info.value) and str(gone) in str(info.value)


def test_a_worker_that_finds_a_shard_gone_raises_file_not_found_in_the_main_process(
    corpus: Corpus, tmp_path: Path
) -> None:
    table = corpus_table(corpus)
    paths = [write_arrow_file(tmp_path / f"p{k}.arrow", table, 8) for k in range(2)]
    ds = ArrowDataset(paths, fields=["tokens"])
    paths[1].unlink()
    loader = fastload.DataLoader(
        ds, batch_size=len(corpus), num_workers=2, collate_fn=fastload.PadCollate()
    )
    with pytest.raises(FileNotFoundError, match=r"p1\.arrow") as info:
        list(loader)
    assert isinstance(info.value, DataFormatError)
