"""Every kind of bad input gets a DataFormatError (or FieldNotFoundError) at construction that
names the file, the field, the sample and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pytest
from _format_files import (
    Corpus,
    corpus_table,
    write_arrow_file,
    write_arrow_stream,
    write_fastload,
    write_parquet,
)

from fastload import ArrowDataset, HDF5Dataset
from fastload.errors import DataFormatError, FieldNotFoundError

# ---- files that are missing, foreign, truncated ---------------------------------------------


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
def test_a_missing_file_is_named(reader: type, tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"nope\.bin: no such file or directory"):
        reader(tmp_path / "nope.bin")


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
def test_a_glob_that_matches_nothing_is_named(reader: type, tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"the glob '.*\*\.h5' matches no file"):
        reader(str(tmp_path / "*.h5"))


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
def test_an_empty_list_or_an_empty_directory_is_rejected(reader: type, tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="empty list"):
        reader([])
    with pytest.raises(DataFormatError, match="holds no file ending in"):
        reader(tmp_path)


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
def test_a_file_of_no_known_format_is_named(reader: type, tmp_path: Path) -> None:
    path = tmp_path / "notes.h5"
    path.write_text("just some text, not a dataset\n")
    with pytest.raises(
        DataFormatError, match=r"notes\.h5: not an .*no HDF5, Arrow or Parquet signature"
    ):
        reader(path)


def test_hdf5_reader_says_when_it_is_given_an_arrow_file(corpus: Corpus, tmp_path: Path) -> None:
    path = write_arrow_file(tmp_path / "data.h5", corpus_table(corpus), 5)
    with pytest.raises(
        DataFormatError, match=r"not an HDF5 file: it is an Arrow IPC file .*ArrowDataset"
    ):
        HDF5Dataset(path)


def test_arrow_reader_says_when_it_is_given_an_hdf5_file(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "data.arrow", corpus)
    with pytest.raises(DataFormatError, match=r"it is an HDF5 file .*HDF5Dataset"):
        ArrowDataset(path)


def _truncate(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def test_a_truncated_hdf5_file_is_rejected(corpus: Corpus, tmp_path: Path) -> None:
    path = _truncate(write_fastload(tmp_path / "data.h5", corpus), 0.6)
    with pytest.raises(
        DataFormatError, match=r"data\.h5: has an HDF5 signature .* truncated or damaged"
    ):
        HDF5Dataset(path)


@pytest.mark.parametrize(
    "write",
    [
        lambda p, t: write_arrow_file(p, t, 5),
        lambda p, t: write_arrow_stream(p, t, 5),
        lambda p, t: write_parquet(p, t, 5),
    ],
    ids=["ipc-file", "ipc-stream", "parquet"],
)
def test_a_truncated_arrow_or_parquet_file_is_rejected(
    write: object, corpus: Corpus, tmp_path: Path
) -> None:
    path = _truncate(write(tmp_path / "data.bin", corpus_table(corpus)), 0.6)  # type: ignore[operator]
    with pytest.raises(
        DataFormatError, match=r"data\.bin: cannot be read as .* truncated or damaged"
    ):
        ArrowDataset(path)


# ---- fields ---------------------------------------------------------------------------------


def test_a_missing_field_lists_the_fields_that_exist(corpus: Corpus, tmp_path: Path) -> None:
    h5 = write_fastload(tmp_path / "a.h5", corpus)
    with pytest.raises(
        FieldNotFoundError, match=r"a\.h5: no field 'input_ids'; the file has: 'emb', 'frames'"
    ) as info:
        HDF5Dataset(h5, fields=["tokens", "input_ids"])
    assert isinstance(info.value, KeyError)
    arrow = write_arrow_file(tmp_path / "a.arrow", corpus_table(corpus), 5)
    with pytest.raises(
        FieldNotFoundError, match=r"a\.arrow: no field 'ids'; the file has: 'tokens', 'frames'"
    ):
        ArrowDataset(arrow, fields=["ids"])


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
def test_length_field_must_be_a_ragged_field_that_is_read(
    reader: type, corpus: Corpus, tmp_path: Path
) -> None:
    path = (
        write_fastload(tmp_path / "a.h5", corpus)
        if reader is HDF5Dataset
        else write_arrow_file(tmp_path / "a.arrow", corpus_table(corpus), 5)
    )
    with pytest.raises(DataFormatError, match="length_field 'label' is a fixed field"):
        reader(path, length_field="label")
    with pytest.raises(
        FieldNotFoundError, match="length_field 'frames' is not among the fields read"
    ):
        reader(path, fields=["tokens"], length_field="frames")


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
def test_options_are_validated_naming_the_option(
    reader: type, corpus: Corpus, tmp_path: Path
) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    with pytest.raises(ValueError, match="cache_bytes must be >= 0; got -1"):
        reader(path, cache_bytes=-1)
    with pytest.raises(TypeError, match="fields must be a list of field names"):
        reader(path, fields="tokens")
    with pytest.raises(ValueError, match="names a field twice"):
        reader(path, fields=["tokens", "tokens"])


def test_unsupported_hdf5_dtypes_are_named_and_can_be_left_out(
    corpus: Corpus, tmp_path: Path
) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    with h5py.File(path, "a") as f:
        f["pairs"] = np.zeros(len(corpus), dtype=[("a", "i4"), ("b", "f4")])
        refs = f.create_dataset("refs", (len(corpus),), dtype=h5py.ref_dtype)
        refs[0] = f["label"].ref
    with pytest.raises(
        DataFormatError,
        match=r"a\.h5: cannot read 'pairs': has dtype .* not supported.* Pass fields=",
    ):
        HDF5Dataset(path)
    with pytest.raises(DataFormatError, match=r"field 'refs': has dtype object"):
        HDF5Dataset(path, fields=["label", "refs"])
    assert len(HDF5Dataset(path, fields=["label", "tokens"])) == len(corpus)


def test_unsupported_arrow_types_are_named_and_can_be_left_out(tmp_path: Path) -> None:
    table = pa.table(
        {
            "ids": pa.array([[1], [2, 3]]),
            "when": pa.array([1, 2], pa.timestamp("s")),
            "nested": pa.array([[[1]], [[2], [3]]]),
            "category": pa.array(["a", "b"]).dictionary_encode(),
        }
    )
    path = write_arrow_file(tmp_path / "a.arrow", table, 5)
    with pytest.raises(
        DataFormatError,
        match=r"cannot read column 'when' has type timestamp.*'nested' is list<.*list",
    ):
        ArrowDataset(path)
    with pytest.raises(DataFormatError, match="field 'category' has type dictionary"):
        ArrowDataset(path, fields=["category"])
    assert ArrowDataset(path, fields=["ids"]).lengths.tolist() == [1, 2]


def test_a_file_without_any_field_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f["version"] = 1
    with pytest.raises(DataFormatError, match=r"a\.h5: holds no dataset that could be a field"):
        HDF5Dataset(path)


def test_a_newer_fastload_format_is_rejected(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    with h5py.File(path, "a") as f:
        f.attrs["fastload_format"] = 2
    with pytest.raises(
        DataFormatError, match="fastload_format is 2, but this version of fastload reads format 1"
    ):
        HDF5Dataset(path)


# ---- offsets, lengths, sample counts ----------------------------------------------------------


def _rewrite(path: Path, name: str, data: np.ndarray) -> None:
    with h5py.File(path, "a") as f:
        del f[name]
        f[name] = data


def _offsets(corpus: Corpus) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(t) for t in corpus.tokens])]).astype(np.int64)


def test_offsets_of_the_wrong_length_are_rejected(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus, lengths=False)
    _rewrite(path, "tokens/offsets", _offsets(corpus)[:-1])
    with pytest.raises(
        DataFormatError,
        match=r"different numbers of samples \('\(attribute num_samples\)': 57, .*'tokens': 56",
    ):
        HDF5Dataset(path)


def test_offsets_not_starting_at_zero_are_rejected(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus, lengths=False)
    _rewrite(path, "tokens/offsets", _offsets(corpus) + 3)
    with pytest.raises(
        DataFormatError,
        match=r"a\.h5: field 'tokens' \(/tokens/offsets\): offsets\[0\] must be 0; got 3",
    ):
        HDF5Dataset(path)


def test_decreasing_offsets_name_the_sample(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus, lengths=False)
    offsets = _offsets(corpus)
    offsets[6] = offsets[5] - 1
    _rewrite(path, "tokens/offsets", offsets)
    with pytest.raises(
        DataFormatError, match=r"field 'tokens'.*offsets decrease at sample 5: offsets\[5\]"
    ):
        HDF5Dataset(path)


def test_offsets_ending_past_the_values_are_rejected(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus, lengths=False)
    offsets = _offsets(corpus)
    offsets[-1] += 1
    _rewrite(path, "tokens/offsets", offsets)
    with pytest.raises(
        DataFormatError,
        match=rf"offsets\[-1\] \(sample 57\) is {offsets[-1]}, but values holds {offsets[-1] - 1}",
    ):
        HDF5Dataset(path)


def test_a_lengths_index_disagreeing_with_the_offsets_names_the_sample(
    corpus: Corpus, tmp_path: Path
) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    lengths = np.diff(_offsets(corpus))
    lengths[9] += 1
    _rewrite(path, "lengths", lengths)
    with pytest.raises(
        DataFormatError,
        match=r"a\.h5: /lengths vs field 'frames' \(nor those of 'tokens'\): sample \d+ has length",
    ):
        HDF5Dataset(path)
    with h5py.File(path, "a") as f:
        f["lengths"].attrs["field"] = "tokens"
    with pytest.raises(
        DataFormatError,
        match=rf"/lengths vs field 'tokens': sample 9 has length {lengths[9]} in the lengths index but {lengths[9] - 1}",
    ):
        HDF5Dataset(path)
    with h5py.File(path, "a") as f:
        f["lengths"].attrs["field"] = "label"
    with pytest.raises(
        DataFormatError, match="/lengths has field='label', which is not a ragged field"
    ):
        HDF5Dataset(path)


def test_fields_with_different_sample_counts_are_rejected(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    _rewrite(path, "emb", corpus.emb[:-2])
    with pytest.raises(
        DataFormatError, match=r"a\.h5: fields have different numbers of samples .*'emb': 55"
    ):
        HDF5Dataset(path)


def test_a_malformed_fastload_group_is_named(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    _rewrite(path, "frames/offsets", _offsets(corpus).astype(np.float64))
    with pytest.raises(
        DataFormatError, match=r"'frames': offsets has dtype float64 .* expected int64 \[N\+1\]"
    ):
        HDF5Dataset(path)


# ---- Hugging Face folders ---------------------------------------------------------------------


def test_a_datasetdict_folder_asks_for_a_split(corpus: Corpus, tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    write_arrow_stream(tmp_path / "train" / "data-00000-of-00001.arrow", corpus_table(corpus), 5)
    (tmp_path / "train" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(
        DataFormatError, match=r"is a DatasetDict folder; point at one split's folder: .*train"
    ):
        ArrowDataset(tmp_path)
    assert len(ArrowDataset(tmp_path / "train")) == len(corpus)


def test_a_state_json_naming_missing_or_no_files_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    with pytest.raises(
        DataFormatError,
        match=r"state\.json: lists data files that do not exist: .*data-00000-of-00001\.arrow",
    ):
        ArrowDataset(tmp_path)
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(
        DataFormatError,
        match=r"expected a Hugging Face datasets state\.json with a '_data_files' list",
    ):
        ArrowDataset(tmp_path)


def test_a_datasets_cache_folder_asks_for_one_split(corpus: Corpus, tmp_path: Path) -> None:
    for name in ("demo-train.arrow", "demo-test.arrow", "cache-0123abcd.arrow"):
        write_arrow_stream(tmp_path / name, corpus_table(corpus), 10)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    with pytest.raises(
        DataFormatError, match=r"cache folder, .*demo-test\.arrow.*point at the file"
    ):
        ArrowDataset(tmp_path)
    assert len(ArrowDataset(str(tmp_path / "*-train*.arrow"))) == len(corpus)
