"""The written file: attributes, sharding, compression, determinism and existing outputs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import Run, is_contiguous, ragged, texts

import fastload
from fastload._apps._convert._convert_options import Compression, ConvertOptions
from fastload._apps._convert._crash_safe import TempArea, remove_stale_temps, temp_folder_for
from fastload._apps._convert._writer import smallest_int_dtype
from fastload._formats._indexing import sha256_of
from fastload._remote import INDEX_NAME, DatasetIndex
from fastload.errors import UsageError

LINES = [f"sample {i} " + "w" * (i % 13) for i in range(100)]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"{line}\n" for line in LINES))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_attributes_record_sources_tokenizer_options_counts_and_version(
    corpus: Path, run: Run
) -> None:
    run(corpus, max_length=10)
    with h5py.File(corpus.with_name("out.h5")) as f:
        attrs = dict(f.attrs)
        assert f["lengths"].attrs["field"] == "input_ids"
    assert attrs["fastload_format"] == 1 and attrs["num_samples"] == len(LINES)
    assert attrs["fastload_version"] == fastload.__version__
    assert json.loads(attrs["source"]) == {
        "inputs": [str(corpus)],
        "files": [str(corpus)],
        "num_files": 1,
    }
    assert json.loads(attrs["tokenizer"]) == {"kind": "bytes", "vocab_size": 256}
    options = json.loads(attrs["options"])
    assert options["max_length"] == 10 and "workers" not in options
    counts = json.loads(attrs["counts"])
    assert counts["records_read"] == len(LINES) and counts["truncated_to_max_length"] == sum(
        len(s) > 10 for s in LINES
    )
    assert json.loads(attrs["num_tokens"]) == {"input_ids": sum(min(len(s), 10) for s in LINES)}


def test_the_same_conversion_writes_the_same_bytes(corpus: Path, run: Run) -> None:
    run(corpus, out="a.h5")
    run(corpus, out="b.h5")
    assert digest(corpus.with_name("a.h5")) == digest(corpus.with_name("b.h5"))


def test_shards_hold_shard_size_samples_and_concatenate_to_the_input(
    corpus: Path, run: Run
) -> None:
    report = run(corpus, shard_size=30, block_bytes=100)
    names = [p.name for p in report.outputs]
    assert names == ["out-00000.h5", "out-00001.h5", "out-00002.h5", "out-00003.h5"]
    samples = []
    for index, path in enumerate(report.outputs):
        with h5py.File(path) as f:
            assert (f.attrs["shard_index"], f.attrs["num_shards"]) == (index, 4)
            assert f.attrs["num_samples"] == min(30, len(LINES) - 30 * index)
        samples += texts(path)
    assert samples == LINES
    assert not corpus.with_name("out.h5").exists()


def test_shards_share_one_dtype_chosen_from_every_shard(tmp_path: Path, run: Run) -> None:
    (tmp_path / "ids.jsonl").write_text('{"text": [1]}\n{"text": [2]}\n{"text": [300]}\n')
    report = run(tmp_path / "ids.jsonl", shard_size=2)
    dtypes = set()
    for path in report.outputs:
        with h5py.File(path) as f:
            dtypes.add(f["input_ids/values"].dtype)
    assert dtypes == {np.dtype(np.uint16)}


def test_overwriting_a_larger_sharded_run_removes_its_extra_shards(corpus: Path, run: Run) -> None:
    run(corpus, shard_size=30)
    report = run(corpus, shard_size=60, overwrite=True)
    assert sorted(p.name for p in corpus.parent.glob("out-*.h5")) == [
        "out-00000.h5",
        "out-00001.h5",
    ]
    assert [p.name for p in report.outputs] == ["out-00000.h5", "out-00001.h5"]


def test_a_sharded_output_gets_an_index_of_its_own_shards_and_a_single_file_none(
    corpus: Path, run: Run
) -> None:
    (corpus.parent / "unrelated.h5").write_bytes(b"not this run's")
    report = run(corpus, shard_size=30)
    assert report.index_file == corpus.with_name(INDEX_NAME)
    assert f"index written to {report.index_file}" in report.notes()
    index = DatasetIndex.from_json(report.index_file.read_bytes(), "test")
    assert [s.path for s in index.shards] == [p.name for p in report.outputs]
    assert [s.sha256 for s in index.shards] == [sha256_of(p) for p in report.outputs]
    assert [s.samples for s in index.shards] == [30, 30, 30, 10]
    assert index.lengths.tolist() == [len(line.encode()) for line in LINES]
    corpus.with_name("single").mkdir()
    assert run(corpus, out="single/one.h5").index_file is None
    assert sorted(p.name for p in corpus.with_name("single").iterdir()) == ["one.h5"]


def test_an_index_beside_the_shards_needs_overwrite_and_names_the_new_ones(
    corpus: Path, run: Run
) -> None:
    corpus.with_name(INDEX_NAME).write_text("another dataset's index")
    with pytest.raises(FileExistsError, match=rf"{INDEX_NAME} exists; pass --overwrite"):
        run(corpus, shard_size=30)
    assert corpus.with_name(INDEX_NAME).read_text() == "another dataset's index"
    run(corpus, shard_size=60, overwrite=True)
    index = DatasetIndex.from_json(corpus.with_name(INDEX_NAME).read_bytes(), "test")
    assert [s.path for s in index.shards] == ["out-00000.h5", "out-00001.h5"]


@pytest.mark.parametrize("compression", ["lzf", "gzip:6"])
def test_compressed_output_is_chunked_and_reads_back_equal(
    corpus: Path, run: Run, compression: str
) -> None:
    run(corpus, compression=Compression.parse(compression))
    with h5py.File(corpus.with_name("out.h5")) as f:
        values = f["input_ids/values"]
        assert values.compression == compression.split(":")[0] and values.chunks is not None
        assert is_contiguous(f["lengths"]) and is_contiguous(f["input_ids/offsets"])
    assert texts(corpus.with_name("out.h5")) == LINES


def test_existing_output_needs_overwrite(corpus: Path, run: Run) -> None:
    run(corpus)
    before = digest(corpus.with_name("out.h5"))
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        run(corpus, max_length=3)
    assert digest(corpus.with_name("out.h5")) == before
    run(corpus, max_length=3, overwrite=True)
    assert all(len(s) <= 3 for s in ragged(corpus.with_name("out.h5")))


def test_a_failed_conversion_leaves_no_temporary_and_no_output(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="missing field"):
        run(tmp_path / "a.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_output_folder_problems_are_reported_before_reading(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(FileNotFoundError, match="output folder does not exist"):
        from fastload._apps._convert._convert import convert

        convert(ConvertOptions(inputs=(str(corpus),), output=tmp_path / "nowhere" / "x.h5"))
    with pytest.raises(UsageError, match="is a folder"):
        convert(ConvertOptions(inputs=(str(corpus),), output=tmp_path))


def test_stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dest = tmp_path / "out.h5"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = temp_folder_for(dest, int(dead.stdout))
    stale.mkdir()
    (stale / "spool-00000-0.values").write_bytes(b"x")
    live = temp_folder_for(dest, os.getppid())
    live.mkdir()
    assert remove_stale_temps(dest) == [stale]
    assert not stale.exists() and live.exists()


def test_commit_replaces_the_destination_and_removes_the_temporary(tmp_path: Path) -> None:
    dest = tmp_path / "out.h5"
    dest.write_bytes(b"old")
    with TempArea(dest) as area:
        assert area.path.name == f".out.h5.fastload-tmp-{os.getpid()}"
        (area.path / "out.h5").write_bytes(b"new")
        area.commit([(area.path / "out.h5", dest)])
    assert dest.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [dest]


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0, 255, "uint8"),
        (0, 256, "uint16"),
        (0, 70000, "uint32"),
        (-1, 127, "int8"),
        (-129, 0, "int16"),
        (0, 2**40, "uint64"),
    ],
)
def test_smallest_integer_dtype_holds_the_range(low: int, high: int, expected: str) -> None:
    assert smallest_int_dtype(low, high) == np.dtype(expected)
