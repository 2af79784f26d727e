"""Bad input: each case raises naming the file and the physical line, or is skipped and counted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import Run, fixed, texts

from fastload.errors import DataFormatError, UsageError


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"text": "good", "label": 1})


def test_malformed_json_names_the_physical_line_counting_blank_lines(
    tmp_path: Path, run: Run
) -> None:
    path = jsonl(tmp_path / "a.jsonl", [GOOD, "", "", '{"text": "unterminated}', GOOD])
    with pytest.raises(DataFormatError, match=r"a\.jsonl:4: malformed JSON: .*column"):
        run(path)


def test_line_numbers_hold_across_chunks_and_inside_gzip(tmp_path: Path, run: Run) -> None:
    lines = [GOOD] * 500 + ["{nope"] + [GOOD] * 10
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("".join(f"{s}\n" for s in lines).encode()))
    with pytest.raises(DataFormatError, match=r"a\.jsonl\.gz:501: malformed JSON"):
        run(tmp_path / "a.jsonl.gz", block_bytes=1000)


def test_missing_field_lists_the_fields_the_record_has(tmp_path: Path, run: Run) -> None:
    path = jsonl(tmp_path / "a.jsonl", [GOOD, json.dumps({"body": "x", "id": 3})])
    with pytest.raises(
        DataFormatError,
        match=r"a\.jsonl:2: missing field: no field 'text' \(the record has: body, id\)",
    ):
        run(path)


def test_a_first_record_without_the_text_field_explains_how_to_choose_it(
    tmp_path: Path, run: Run
) -> None:
    path = jsonl(tmp_path / "a.jsonl", [json.dumps({"content": "x"})])
    with pytest.raises(DataFormatError, match=r"a\.jsonl:1: missing field: .*--text-field"):
        run(path)


def test_wrong_types_are_bad_records(tmp_path: Path, run: Run) -> None:
    path = jsonl(
        tmp_path / "a.jsonl",
        [
            GOOD,
            json.dumps({"text": "x", "label": "many"}),
            json.dumps({"text": 7, "label": 1}),
            "[1, 2]",
        ],
    )
    with pytest.raises(
        DataFormatError, match=r"a\.jsonl:2: wrong type: field 'label': 'many' is not a number"
    ):
        run(path, label_fields=("label",))
    report = run(path, label_fields=("label",), on_error="skip")
    assert report.samples == 1 and report.stats.skipped == {"wrong type": 3}
    assert report.stats.first_skip["wrong type"].startswith(f"{path}:2:")


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_non_utf8_bytes_name_the_line_unless_replaced(tmp_path: Path, run: Run, name: str) -> None:
    good = b'{"text": "ok"}' if name.endswith("jsonl") else b"ok"
    bad = b'{"text": "caf\xe9"}' if name.endswith("jsonl") else b"caf\xe9"
    (tmp_path / name).write_bytes(good + b"\n" + good + b"\n" + bad + b"\n")
    with pytest.raises(
        DataFormatError, match=rf"{name}:3: non-UTF-8 bytes: invalid byte 0xe9 at column"
    ):
        run(tmp_path / name)
    report = run(tmp_path / name, out="skip.h5", on_error="skip")
    assert report.samples == 2 and report.stats.skipped == {"non-UTF-8 bytes": 1}
    run(tmp_path / name, out="replace.h5", errors="replace")
    assert texts(tmp_path / "replace.h5") == ["ok", "ok", "caf\ufffd"]


def test_non_utf8_in_a_document_names_its_line(tmp_path: Path, run: Run) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_bytes(b"line one\nline two\nbad \xff here\n")
    with pytest.raises(
        DataFormatError, match=r"a\.txt:3: non-UTF-8 bytes: invalid byte 0xff at column 5"
    ):
        run(tmp_path / "docs", per_file=True)


def test_csv_rows_of_the_wrong_width_name_their_first_physical_line(
    tmp_path: Path, run: Run
) -> None:
    (tmp_path / "a.csv").write_text('text,label\n"multi\nline",1\nshort\nx,2\ntoo,many,3\n')
    with pytest.raises(
        DataFormatError,
        match=r"a\.csv:4: wrong CSV row width: the row has 1 fields, the header has 2",
    ):
        run(tmp_path / "a.csv", label_fields=("label",))
    report = run(tmp_path / "a.csv", label_fields=("label",), on_error="skip")
    assert texts(tmp_path / "out.h5") == ["multi\nline", "x"] and report.stats.skipped == {
        "wrong CSV row width": 2
    }
    assert fixed(tmp_path / "out.h5", "label").tolist() == [1, 2]


def test_non_utf8_in_csv_names_the_line(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.csv").write_bytes(b"text\nok\nbad\xc3(\n")
    with pytest.raises(DataFormatError, match=r"a\.csv:3: non-UTF-8 bytes"):
        run(tmp_path / "a.csv")


def test_a_csv_without_the_column_lists_its_header(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.csv").write_text("body,label\nx,1\n")
    with pytest.raises(
        DataFormatError, match=r"no column 'text' in the header \(columns: body, label\)"
    ):
        run(tmp_path / "a.csv")


def write_empty(kind: str, path: Path) -> Path:
    if kind == "txt":
        path = path.with_suffix(".txt")
        path.write_text("")
    elif kind == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("\n  \n")
    elif kind == "json":
        path = path.with_suffix(".json")
        path.write_text("[]")
    elif kind == "csv":
        path = path.with_suffix(".csv")
        path.write_text("text,label\n")
    elif kind == "parquet":
        path = path.with_suffix(".parquet")
        pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), path)
    else:
        path = path.with_suffix(".npz")
        np.savez(path, x=np.zeros((0, 2)))
    return path


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "csv", "parquet", "npz"])
def test_an_empty_input_is_an_error_or_a_counted_skip(tmp_path: Path, run: Run, kind: str) -> None:
    empty = write_empty(kind, tmp_path / "empty")
    with pytest.raises(DataFormatError, match=r"empty input"):
        run(empty)
    with pytest.raises(DataFormatError, match=r"no samples to write"):
        run(empty, on_error="skip")


def test_an_empty_file_among_others_is_skipped_and_counted(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.txt").write_text("")
    report = run(tmp_path / "a.txt", tmp_path / "b.txt", on_error="skip")
    assert report.samples == 1 and report.stats.skipped == {"empty input": 1}
    assert any(note.startswith("skipped 1 record: empty input") for note in report.notes())


def test_malformed_json_array_names_the_line(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.json").write_text('[\n  {"text": "a"},\n  {"text": "b"}\n  {"text": "c"}\n]')
    with pytest.raises(
        DataFormatError, match=r"a\.json:4: malformed JSON: Expecting ',' delimiter"
    ):
        run(tmp_path / "a.json")
    report = run(tmp_path / "a.json", on_error="skip")
    assert texts(tmp_path / "out.h5") == ["a", "b"] and report.stats.skipped == {
        "malformed JSON": 1
    }


def test_truncated_gzip_is_reported_as_corrupt(tmp_path: Path, run: Run) -> None:
    packed = gzip.compress(b"line\n" * 1000)
    (tmp_path / "a.txt.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataFormatError, match=r"a\.txt\.gz: corrupt or truncated gzip data"):
        run(tmp_path / "a.txt.gz")


def test_a_parquet_file_without_the_column_lists_its_columns(tmp_path: Path, run: Run) -> None:
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(
        DataFormatError, match=r"no column 'text' \(choose with --text-field\); columns: body"
    ):
        run(tmp_path / "a.parquet")


def test_options_that_do_not_fit_the_input_are_usage_errors(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(UsageError, match="--fields/--label-field need named fields"):
        run(tmp_path / "a.txt", label_fields=("label",))
    (tmp_path / "b.unknown").write_text("x\n")
    with pytest.raises(UsageError, match="cannot tell the format"):
        run(tmp_path / "b.unknown")
    with pytest.raises(FileNotFoundError, match="input not found"):
        run(tmp_path / "missing.txt")
    with pytest.raises(UsageError, match="--max-length must be >= 1, got 0"):
        run(tmp_path / "a.txt", max_length=0)
