"""Every input kind converts, and reading the layout back gives the source's records."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import Run, fixed, is_contiguous, lengths, ragged, texts

LINES = ["first line", "zweite Zeile ü", "третья", "4th 🙂", "x" * 300]


def write_lines(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes("".join(line + newline for line in lines).encode("utf-8"))
    return path


def test_txt_gives_one_sample_per_line_as_utf8_bytes(tmp_path: Path, run: Run) -> None:
    report = run(write_lines(tmp_path / "a.txt", LINES))
    assert texts(tmp_path / "out.h5") == LINES
    assert report.samples == len(LINES) and report.tokens == sum(len(s.encode()) for s in LINES)
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["input_ids/values"].dtype == np.uint8
        assert all(
            is_contiguous(d) for d in (f["input_ids/values"], f["input_ids/offsets"], f["lengths"])
        )
    np.testing.assert_array_equal(lengths(tmp_path / "out.h5"), [len(s.encode()) for s in LINES])


def test_txt_strips_crlf_and_a_bom_and_reads_a_last_line_without_newline(
    tmp_path: Path, run: Run
) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\nthree")
    run(tmp_path / "a.txt")
    assert texts(tmp_path / "out.h5") == ["one", "two", "three"]


def test_blank_lines_are_dropped_as_empty_not_as_shorter_than_min_length(tmp_path: Path, run: Run) -> None:
    report = run(write_lines(tmp_path / "a.txt", ["a", "", "b", ""]))
    assert texts(tmp_path / "out.h5") == ["a", "b"]
    assert (report.stats.dropped_empty, report.stats.dropped_short) == (2, 0)
    run(tmp_path / "a.txt", out="keep.h5", min_length=0)
    assert texts(tmp_path / "keep.h5") == ["a", "", "b", ""]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_text_reads_like_the_uncompressed_file(
    tmp_path: Path, run: Run, suffix: str
) -> None:
    raw = "".join(f"{line}\n" for line in LINES * 50).encode()
    packed = gzip.compress(raw) if suffix == ".gz" else zstandard.ZstdCompressor().compress(raw)
    (tmp_path / f"a.txt{suffix}").write_bytes(packed)
    report = run(tmp_path / f"a.txt{suffix}", block_bytes=256)
    assert texts(tmp_path / "out.h5") == LINES * 50
    assert report.input_bytes == len(packed)


def test_a_folder_is_read_recursively_in_sorted_order_skipping_hidden_files(
    tmp_path: Path, run: Run
) -> None:
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / ".git").mkdir()
    write_lines(folder / "b" / "c.txt", ["b/c"])
    write_lines(folder / "a.txt", ["a"])
    write_lines(folder / "b.txt", ["b.txt"])
    write_lines(folder / ".hidden.txt", ["hidden"])
    write_lines(folder / ".git" / "x.txt", ["git"])
    (folder / "notes.md").write_text("ignored\n")
    report = run(folder)
    assert texts(tmp_path / "out.h5") == ["a", "b/c", "b.txt"]
    assert report.ignored_files == 1


def test_a_glob_matches_files_in_sorted_order(tmp_path: Path, run: Run) -> None:
    for name in ["s-10", "s-02", "s-01"]:
        write_lines(tmp_path / f"{name}.txt", [name])
    run(str(tmp_path / "s-*.txt"))
    assert texts(tmp_path / "out.h5") == ["s-01", "s-02", "s-10"]


def test_per_file_makes_each_document_one_sample(tmp_path: Path, run: Run) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "x.py").write_text("def f():\n    return 1\n")
    (docs / "y.md").write_text("# Title\n\nbody\n")
    run(docs, format="txt", per_file=True, block_bytes=10)
    assert texts(tmp_path / "out.h5") == ["def f():\n    return 1\n", "# Title\n\nbody\n"]


def test_jsonl_text_field_and_label_field(tmp_path: Path, run: Run) -> None:
    records = [{"text": s, "label": i % 3, "id": i} for i, s in enumerate(LINES)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    run(tmp_path / "a.jsonl", label_fields=("label",))
    assert texts(tmp_path / "out.h5") == LINES
    labels = fixed(tmp_path / "out.h5", "label")
    assert labels.dtype == np.int64 and labels.tolist() == [r["label"] for r in records]


def test_jsonl_lists_of_ints_stay_token_ids_in_the_smallest_dtype(tmp_path: Path, run: Run) -> None:
    rows = [[1, 2, 3], [70000], [0, 5]]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"ids": r, "score": 0.5 * i}) + "\n" for i, r in enumerate(rows))
    )
    report = run(tmp_path / "a.jsonl", text_field="ids", fields=("score",))
    assert [s.tolist() for s in ragged(tmp_path / "out.h5")] == rows
    assert report.dtypes == {"input_ids": "uint32", "score": "float64"}
    assert fixed(tmp_path / "out.h5", "score").tolist() == [0.0, 0.5, 1.0]


def test_extra_text_fields_are_tokenized_under_their_own_names(tmp_path: Path, run: Run) -> None:
    rows = [{"q": "why", "a": "because"}, {"q": "how", "a": "so"}]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(tmp_path / "qa.jsonl", text_field="q", output_field="question", fields=("a",))
    assert texts(tmp_path / "out.h5", "question") == ["why", "how"]
    assert texts(tmp_path / "out.h5", "a") == ["because", "so"]
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["lengths"].attrs["field"] == "question"


def test_json_array_of_records(tmp_path: Path, run: Run) -> None:
    records = [{"text": s} for s in LINES]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=2))
    run(tmp_path / "a.json")
    assert texts(tmp_path / "out.h5") == LINES


def test_json_file_holding_json_lines_is_read_as_json_lines(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.json").write_text("".join(json.dumps({"text": s}) + "\n" for s in LINES))
    run(tmp_path / "a.json")
    assert texts(tmp_path / "out.h5") == LINES


def test_csv_columns_by_name_with_quoted_multiline_fields(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.csv").write_text(
        'label,text\n1,"one, with comma"\n0,"two\nlines"\n2,plain\n', encoding="utf-8"
    )
    run(tmp_path / "a.csv", label_fields=("label",))
    assert texts(tmp_path / "out.h5") == ["one, with comma", "two\nlines", "plain"]
    assert fixed(tmp_path / "out.h5", "label").tolist() == [1, 0, 2]


def test_tsv_keeps_quote_characters_literally(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.tsv").write_text('text\tlabel\nhe said "hi\t1\n"x\t2.5\n', encoding="utf-8")
    run(tmp_path / "a.tsv", label_fields=("label",))
    assert texts(tmp_path / "out.h5") == ['he said "hi', '"x']
    assert fixed(tmp_path / "out.h5", "label").dtype == np.float64


def arrow_table() -> pa.Table:
    return pa.table(
        {
            "text": LINES,
            "ids": pa.array([[i, i + 1] for i in range(len(LINES))], type=pa.list_(pa.int32())),
            "label": pa.array(range(len(LINES)), type=pa.int64()),
        }
    )


def test_parquet_columns_by_name(tmp_path: Path, run: Run) -> None:
    pq.write_table(arrow_table(), tmp_path / "a.parquet", row_group_size=2)
    run(tmp_path / "a.parquet", fields=("ids",), label_fields=("label",))
    assert texts(tmp_path / "out.h5") == LINES
    assert [s.tolist() for s in ragged(tmp_path / "out.h5", "ids")] == [
        [i, i + 1] for i in range(len(LINES))
    ]
    assert fixed(tmp_path / "out.h5", "label").tolist() == list(range(len(LINES)))


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_arrow_ipc_file_and_stream(tmp_path: Path, run: Run, kind: str) -> None:
    table = arrow_table()
    path = tmp_path / "a.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        writer = (
            pa.ipc.new_file(sink, table.schema)
            if kind == "file"
            else pa.ipc.new_stream(sink, table.schema)
        )
        writer.write_table(table, max_chunksize=2)
        writer.close()
    run(path, text_field="ids")
    assert [s.tolist() for s in ragged(tmp_path / "out.h5")] == [
        [i, i + 1] for i in range(len(LINES))
    ]


def test_hugging_face_save_to_disk_folder_in_its_listed_order(tmp_path: Path, run: Run) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]  # state.json's order wins
    for name, part in zip(names, (LINES[:2], LINES[2:]), strict=True):
        table = pa.table({"text": part})
        with (
            pa.OSFile(str(folder / name), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as writer,
        ):
            writer.write_table(table)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names]})
    )
    (folder / "dataset_info.json").write_text("{}")
    run(folder)
    assert texts(tmp_path / "out.h5") == LINES


def test_npy_fixed_fields_and_a_ragged_field_from_values_and_offsets(
    tmp_path: Path, run: Run
) -> None:
    samples = [[5, 6, 7], [8], [9, 10]]
    np.save(tmp_path / "tokens.npy", np.array([t for s in samples for t in s], dtype=np.int64))
    np.save(tmp_path / "offsets.npy", np.array([0, 3, 4, 6], dtype=np.int64))
    np.save(tmp_path / "image.npy", np.arange(3 * 2 * 2, dtype=np.float32).reshape(3, 2, 2))
    paths = [tmp_path / n for n in ("tokens.npy", "offsets.npy", "image.npy")]
    run(*paths, offsets=(("tokens", "offsets"),), block_bytes=8)
    assert [s.tolist() for s in ragged(tmp_path / "out.h5", "tokens")] == samples
    image = fixed(tmp_path / "out.h5", "image")
    assert image.dtype == np.float32 and image.shape == (3, 2, 2)
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["tokens/values"].dtype == np.uint8 and f["lengths"].attrs["field"] == "tokens"


def test_several_npz_files_are_shards_of_one_dataset(tmp_path: Path, run: Run) -> None:
    np.savez(tmp_path / "p0.npz", label=np.array([1, 2]), x=np.zeros((2, 3)))
    np.savez_compressed(tmp_path / "p1.npz", label=np.array([3]), x=np.ones((1, 3)))
    run(tmp_path / "p0.npz", tmp_path / "p1.npz")
    assert fixed(tmp_path / "out.h5", "label").tolist() == [1, 2, 3]
    assert fixed(tmp_path / "out.h5", "x").tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]
    with h5py.File(tmp_path / "out.h5") as f:
        assert "lengths" not in f  # no ragged field: nothing to index
