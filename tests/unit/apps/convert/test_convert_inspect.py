"""``fastload inspect``: statistics, padding figures and the validation verdict."""

from __future__ import annotations

import io
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import Run

import fastload
from fastload._apps._convert._inspect import (
    check_fully,
    grouped_batches,
    histogram,
    padding_efficiency,
    random_batches,
    read_layout,
    run_inspect,
)
from fastload.errors import UsageError


def test_padding_efficiency_is_real_over_padded_tokens() -> None:
    lengths = np.array([1, 3, 2, 2], dtype=np.int64)
    batches = [np.array([0, 1]), np.array([2, 3])]
    assert padding_efficiency(lengths, batches) == pytest.approx((1 + 3 + 2 + 2) / (3 * 2 + 2 * 2))


def test_length_grouped_batches_pad_far_less_than_random_ones() -> None:
    lengths = np.random.default_rng(1).lognormal(5, 1, size=5000).astype(np.int64) + 1
    random_figure = padding_efficiency(lengths, random_batches(lengths.shape[0], 64))
    grouped = grouped_batches(lengths, 64)
    assert sorted(np.concatenate(grouped).tolist()) == list(range(5000))
    assert padding_efficiency(lengths, grouped) > 0.8 > 0.5 > random_figure


def test_histogram_bins_are_powers_of_two_from_first_to_last_used_bin() -> None:
    lines = histogram(np.array([0, 1, 5, 6, 7, 100], dtype=np.int64))
    assert len(lines) == 8  # [0,1) [1,2) [2,4) [4,8) [8,16) [16,32) [32,64) [64,128)
    assert lines[3].split()[:3] == ["[", "4,", "8)"] and lines[3].split()[3] == "3"


def write_layout(path: Path, *, offsets: list[int], lengths: list[int] | None, values: int) -> None:
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = len(offsets) - 1
        f.create_dataset("x/values", data=np.zeros(values, dtype=np.uint8))
        f.create_dataset("x/offsets", data=np.array(offsets, dtype=np.int64))
        if lengths is not None:
            f.create_dataset("lengths", data=np.array(lengths, dtype=np.int64))


@pytest.mark.parametrize(
    ("offsets", "lengths", "values", "problem"),
    [
        ([0, 2, 4], None, 4, "/lengths is missing"),
        ([1, 2, 4], [1, 2], 4, "offsets[0] is 1, expected 0"),
        ([0, 2, 4], [2, 2], 5, "the last offset is 4 but values has 5 elements"),
        ([0, 2, 4], [2, 2, 2], 4, "/lengths: expected int64 [2]"),
    ],
)
def test_structural_problems_are_found_without_reading_the_payload(
    tmp_path: Path, offsets: list[int], lengths: list[int] | None, values: int, problem: str
) -> None:
    write_layout(tmp_path / "f.h5", offsets=offsets, lengths=lengths, values=values)
    with h5py.File(tmp_path / "f.h5") as f:
        assert any(problem in p for p in read_layout(f).problems)


def test_full_checks_find_decreasing_offsets_and_disagreeing_lengths(tmp_path: Path) -> None:
    write_layout(tmp_path / "a.h5", offsets=[0, 3, 2, 4], lengths=[3, -1, 2], values=4)
    write_layout(tmp_path / "b.h5", offsets=[0, 1, 2, 4], lengths=[1, 2, 1], values=4)
    for name, problem in (
        ("a.h5", "decreasing at sample 1"),
        ("b.h5", "/lengths[1] is 2 but /x/offsets gives 1"),
    ):
        with h5py.File(tmp_path / name) as f:
            layout = read_layout(f)
            assert not layout.problems
            assert any(problem in p for p in check_fully(f, layout))


def test_verify_detects_a_vocabulary_file_that_changed(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.txt").write_text("a b c\nb c\n")
    run(tmp_path / "a.txt", tokenizer="whitespace")
    out = io.StringIO()
    assert run_inspect(tmp_path / "out.h5", batch_size=2, verify=True, out=out) == 0
    (tmp_path / "out.vocab.txt").write_text("<pad>\n<unk>\nother\n")
    out = io.StringIO()
    assert run_inspect(tmp_path / "out.h5", batch_size=2, verify=True, out=out) == 1
    assert "does not match the one this file was written with" in out.getvalue()


def test_shards_and_fixed_fields_are_described(tmp_path: Path, run: Run) -> None:
    (tmp_path / "a.jsonl").write_text(
        "".join(f'{{"text": "{"x" * i}", "y": {i}}}\n' for i in range(1, 6))
    )
    report = run(tmp_path / "a.jsonl", label_fields=("y",), shard_size=3)
    out = io.StringIO()
    assert run_inspect(report.outputs[1], batch_size=4, verify=True, out=out) == 0
    text = out.getvalue()
    assert "2 samples" in text and "shard 1 of 2" in text
    assert "y" in text and "fixed   int64" in text and "scalar per sample" in text


def test_pack_adds_the_packed_rows_real_share_at_that_seq_len(tmp_path: Path) -> None:
    lengths = np.random.default_rng(2).integers(1, 400, 3000)
    offsets = np.concatenate(([0], np.cumsum(lengths))).tolist()
    write_layout(tmp_path / "f.h5", offsets=offsets, lengths=lengths.tolist(), values=offsets[-1])
    reports = {}
    for pack in (None, 256, 1024):
        out = io.StringIO()
        assert run_inspect(tmp_path / "f.h5", batch_size=4, verify=False, out=out, pack=pack) == 0
        reports[pack] = out.getvalue()
    assert "packing efficiency" not in reports[None]
    for pack in (256, 1024):
        planned = fastload.PackedBatchSampler(lengths, seq_len=pack, rows=4).efficiency()
        longer = int((lengths > pack).sum())
        assert f"packing efficiency at seq_len {pack:,}, 4 rows a batch" in reports[pack]
        split = f"  ({longer:,} samples longer than {pack:,} split)" if longer else ""
        assert f"  packed batches          {planned:7.1%}{split}\n" in reports[pack]
    # The two row lengths plan differently: the figure follows --pack.
    assert reports[256].splitlines()[-2] != reports[1024].splitlines()[-2]


def test_pack_below_one_token_is_a_usage_error(tmp_path: Path) -> None:
    write_layout(tmp_path / "f.h5", offsets=[0, 2, 4], lengths=[2, 2], values=4)
    with pytest.raises(UsageError, match="--pack must be >= 1"):
        run_inspect(tmp_path / "f.h5", batch_size=4, verify=False, out=io.StringIO(), pack=0)
