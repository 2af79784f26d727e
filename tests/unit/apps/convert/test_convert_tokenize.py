"""Every tokenizer mode, the vocabulary file, dtype selection and the length limits."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import Run, ragged, texts

from fastload._apps._convert._tokenize import (
    PAD,
    UNK,
    UNK_ID,
    BytesTokenizer,
    CallableTokenizer,
    WhitespaceTokenizer,
    build_vocab,
    parse_tokenizer,
)
from fastload.errors import DataFormatError, UsageError


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_vocab_is_specials_then_words_by_count_then_code_point() -> None:
    counts = Counter({"b": 3, "a": 3, "c": 5, "rare": 1, UNK: 9})
    assert build_vocab(counts, min_count=1, max_vocab=None) == (PAD, UNK, "c", "a", "b", "rare")
    assert build_vocab(counts, min_count=2, max_vocab=2) == (PAD, UNK, "c", "a")


def test_whitespace_tokenizer_maps_unknown_words_to_unk() -> None:
    tokenizer = WhitespaceTokenizer((PAD, UNK, "hello", "world"))
    out = tokenizer.encode(["hello  world\tnew", ""])
    assert out.values.tolist() == [2, 3, UNK_ID] and out.lengths.tolist() == [3, 0]


def test_bytes_tokenizer_reports_a_lone_surrogate_unless_replacing() -> None:
    strict = BytesTokenizer("strict").encode(["ok", "bad \ud800"])
    assert strict.lengths.tolist() == [2, 0] and strict.failures[0][0] == 1
    replaced = BytesTokenizer("replace").encode(["bad \ud800"])
    assert bytes(replaced.values) == "bad \ufffd".encode() and not replaced.failures


@pytest.mark.parametrize("spec", ["nonsense", "mod:", "missing.json"])
def test_an_unusable_tokenizer_option_is_a_usage_error(spec: str) -> None:
    with pytest.raises(UsageError, match="--tokenizer"):
        parse_tokenizer(spec, errors="strict", special_tokens=True)


def test_whitespace_mode_saves_the_vocabulary_beside_the_output(tmp_path: Path, run: Run) -> None:
    write_text(tmp_path / "a.txt", ["the cat sat", "the dog", "a cat the"])
    report = run(tmp_path / "a.txt", tokenizer="whitespace", min_count=2)
    vocab = (tmp_path / "out.vocab.txt").read_text().splitlines()
    assert vocab == [PAD, UNK, "the", "cat"] and report.vocab_file == tmp_path / "out.vocab.txt"
    ids = {w: i for i, w in enumerate(vocab)}
    assert [s.tolist() for s in ragged(tmp_path / "out.h5")] == [
        [ids["the"], ids["cat"], UNK_ID],
        [ids["the"], UNK_ID],
        [UNK_ID, ids["cat"], ids["the"]],
    ]
    with h5py.File(tmp_path / "out.h5") as f:
        recorded = json.loads(f.attrs["tokenizer"])
        assert recorded["vocab_file"] == "out.vocab.txt" and recorded["vocab_size"] == 4
        assert f["input_ids/values"].dtype == np.uint8


def test_hf_tokenizer_json_with_and_without_special_tokens(
    tmp_path: Path, run: Run, tokenizer_json: Path
) -> None:
    write_text(tmp_path / "a.txt", ["hello world", "the cat purrs"])
    run(tmp_path / "a.txt", tokenizer=str(tokenizer_json))
    assert [s.tolist() for s in ragged(tmp_path / "out.h5")] == [[1, 2, 3], [1, 4, 5, 0]]
    run(tmp_path / "a.txt", out="plain.h5", tokenizer=str(tokenizer_json), special_tokens=False)
    assert [s.tolist() for s in ragged(tmp_path / "plain.h5")] == [[2, 3], [4, 5, 0]]
    with h5py.File(tmp_path / "out.h5") as f:
        recorded = json.loads(f.attrs["tokenizer"])
    assert (
        recorded["kind"] == "hf" and recorded["vocab_size"] == 6 and len(recorded["sha256"]) == 64
    )


def test_callable_tokenizer_from_module_and_function(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mytok.py").write_text(
        "def words(text):\n    return [len(w) for w in text.split()]\n"
    )
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "a.txt", ["a bb ccc", "dddd"])
    report = run(tmp_path / "a.txt", tokenizer="mytok:words")
    assert [s.tolist() for s in ragged(tmp_path / "out.h5")] == [[1, 2, 3], [4]]
    assert report.dtypes["input_ids"] == "uint8"


def test_callable_failures_are_bad_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Run
) -> None:
    (tmp_path / "picky.py").write_text(
        "def tok(text):\n    if 'x' in text:\n        raise ValueError('no x please')\n    return [1.5] if 'f' in text else [1]\n"
    )
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "a.txt", ["ok", "has x", "has f"])
    with pytest.raises(
        DataFormatError,
        match=r"a\.txt:2: tokenizer failed: picky:tok raised ValueError: no x please",
    ):
        run(tmp_path / "a.txt", tokenizer="picky:tok")
    report = run(tmp_path / "a.txt", tokenizer="picky:tok", on_error="skip")
    assert report.samples == 1 and report.stats.skipped == {"tokenizer failed": 2}
    with pytest.raises(UsageError, match="cannot import"):
        CallableTokenizer("no_such_module_here:f", str(tmp_path))


def test_dtype_override_and_a_value_that_does_not_fit(tmp_path: Path, run: Run) -> None:
    write_text(tmp_path / "a.txt", ["abc"])
    run(tmp_path / "a.txt", dtype="int32")
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["input_ids/values"].dtype == np.int32
    (tmp_path / "ids.jsonl").write_text('{"text": [1, 300]}\n')
    with pytest.raises(DataFormatError, match=r"token id 300 does not fit --dtype uint8"):
        run(tmp_path / "ids.jsonl", out="ids.h5", dtype="uint8")


def test_max_length_truncates_or_drops_and_min_length_drops(tmp_path: Path, run: Run) -> None:
    write_text(tmp_path / "a.txt", ["a", "abcdef", "abc", "abcdefgh"])
    report = run(tmp_path / "a.txt", max_length=4)
    assert (
        texts(tmp_path / "out.h5") == ["a", "abcd", "abc", "abcd"] and report.stats.truncated == 2
    )
    report = run(tmp_path / "a.txt", out="drop.h5", max_length=4, overlong="drop", min_length=2)
    assert texts(tmp_path / "drop.h5") == ["abc"]
    assert (report.stats.dropped_long, report.stats.dropped_short) == (2, 1)
