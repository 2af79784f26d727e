"""The pieces of ``fastload bench`` that need no worker processes: option parsing, the batch
plan and its counts, the measuring loop, the recommendation, the table and the result files."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pytest
import torch

import fastload
from fastload._apps._bench._cli import options_from_args
from fastload._apps._bench._data import make_plan, open_dataset
from fastload._apps._bench._loop import (
    BenchOptions,
    BenchRow,
    configurations,
    make_collate,
    make_loader,
    measure,
)
from fastload._apps._bench._report import (
    PLOT_HINT,
    recommend,
    table_header,
    table_row,
    write_results,
)
from fastload._apps._bench._steps import SleepStep, TinyModelStep, model_field
from fastload._collate import PackedSource
from fastload.cli import build_parser
from fastload.errors import DataFormatError, UsageError

CPU = torch.device("cpu")


def write_h5(path: Path, samples: int = 300, *, ragged: bool = True, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        if ragged:
            lengths = rng.integers(1, 60, samples).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            f.create_dataset("tokens/values", data=rng.integers(0, 1000, int(offsets[-1]), dtype=np.int32))
            f.create_dataset("tokens/offsets", data=offsets)
            f.create_dataset("lengths", data=lengths)
        f.create_dataset("features", data=rng.normal(size=(samples, 3)).astype(np.float32))
    return path


def row(loader: str = "fastload", workers: int = 1, prefetch: int | None = 2, stall: float = 0.0,
        step: str = "10 ms", samples_per_s: float = 1000.0) -> BenchRow:
    return BenchRow(
        loader=loader, workers=workers, prefetch=prefetch if workers else None, step=step,
        batches=10, samples=100, samples_per_s=samples_per_s, wait_s=stall, step_s=1 - stall,
        stall_fraction=stall, p50_wait_ms=0.5, p99_wait_ms=1.5, first_batch_s=0.2,
        pss_bytes=300 * 2**20, padding_efficiency=0.9, diagnosis="",
    )


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "data.h5", *argv])


def test_each_worker_count_runs_fastload_at_every_prefetch_then_torch_at_the_first() -> None:
    runs = configurations(BenchOptions(workers=(0, 2), prefetch=(4, 8)))
    assert runs == [("fastload", 0, None), ("torch", 0, None), ("fastload", 2, 4),
                    ("fastload", 2, 8), ("torch", 2, 4)]


def test_smoke_shrinks_every_option_the_user_did_not_set() -> None:
    options, batch_size, max_tokens = options_from_args(parse("--smoke", "--workers", "3,1,1"))
    assert options.workers == (1, 3)  # sorted, duplicates dropped; explicit wins over --smoke
    assert (options.prefetch, options.step_ms, options.batches) == ((2,), (1.0,), 8)
    assert (batch_size, max_tokens) == (16, None)
    options, batch_size, max_tokens = options_from_args(parse("--max-tokens", "4096"))
    assert options == BenchOptions()
    assert (batch_size, max_tokens) == (None, 4096)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "1,x"], "--workers: expected a comma-separated list of integers; got '1,x'"),
        (["--workers", "1,,2"], "--workers: empty value in '1,,2'"),
        (["--workers", "-1"], "--workers: every value must be >= 0; got -1"),
        (["--prefetch", "0"], "--prefetch: every value must be >= 1; got 0"),
        (["--step-ms", "fast"], "--step-ms: expected a comma-separated list of numbers; got 'fast'"),
        (["--step-ms", "inf"], "--step-ms: every value must be finite"),
        (["--batches", "0"], "--batches must be >= 1; got 0"),
        (["--batch-size", "8,16"], "--batch-size: expected one integer; got '8,16'"),
        (["--model", "huge"], "--model must be 'tiny'; got 'huge'"),
        (["--model", "tiny", "--step-ms", "5"], "--step-ms and --model are exclusive"),
    ],
)
def test_bad_options_are_usage_errors_naming_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as error:
        options_from_args(parse(*argv))
    assert str(error.value).startswith(message)


def test_the_reader_is_chosen_by_extension(tmp_path: Path) -> None:
    h5 = write_h5(tmp_path / "d.h5")
    assert isinstance(open_dataset(str(h5)), fastload.HDF5Dataset)
    table = pa.table({"ids": pa.array([[1, 2], [3], [4, 5, 6]], type=pa.list_(pa.int32()))})
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    assert isinstance(open_dataset(str(tmp_path / "d.arrow")), fastload.ArrowDataset)
    (tmp_path / "d.csv").write_text("a\n1\n")
    with pytest.raises(UsageError, match=r"d\.csv: unknown file type \.csv; expected \.h5"):
        open_dataset(str(tmp_path / "d.csv"))
    with pytest.raises(DataFormatError, match="no such file"):
        open_dataset(str(tmp_path / "missing.h5"))


def test_plan_counts_are_what_both_loaders_deliver(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5")))
    plan = make_plan(dataset, batches=25, batch_size=None, max_tokens=400)  # > 1 epoch
    assert len(plan) == 25
    collate = fastload.PadCollate(primary=dataset.length_field)
    for loader in ("fastload", "torch"):
        batches = make_loader(loader, dataset, plan, collate, workers=0, prefetch=None, device=CPU)
        got = [(len(b["lengths"]), int(b["attention_mask"].sum()), b["attention_mask"].numel())
               for b in batches]
        assert got == [plan.counts(i) for i in range(len(plan))], loader
    assert all(padded <= 400 for _, _, padded in got)


def test_packed_plan_is_what_both_loaders_deliver_in_packed_rows(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5")))
    plan = make_plan(dataset, batches=40, batch_size=4, max_tokens=None, pack_length=64)  # > 1 epoch
    assert len(plan) == 40 and plan.pack_length == 64 and set(plan.rows) == {4}
    assert plan.padding_efficiency is None and plan.packing_efficiency == pytest.approx(
        sum(b.num_tokens for b in plan.batches) / (40 * 4 * 64)
    )
    assert plan.counts(0) == (4, plan.batches[0].num_tokens, 4 * 64)
    collate = make_collate(dataset, plan)
    source = PackedSource(dataset, seq_len=64, rows=4)
    expected = [collate(source.read_batch(b)) for b in plan.batches]
    for loader in ("fastload", "torch"):
        batches = list(make_loader(loader, dataset, plan, collate, workers=0, prefetch=None, device=CPU))
        assert len(batches) == 40, loader
        for got, want in zip(batches, expected, strict=True):
            assert got["tokens"].shape == (4, 64) and "cu_seqlens" in got, loader
            for name in ("tokens", "position_ids", "document_ids", "cu_seqlens"):
                assert torch.equal(got[name], want[name]), (loader, name)


def test_measure_reports_a_packed_plan_as_packing_efficiency(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5")))
    plan = make_plan(dataset, batches=3, batch_size=2, max_tokens=None, pack_length=128)
    batches = make_loader(
        "fastload", dataset, plan, make_collate(dataset, plan), workers=0, prefetch=None, device=CPU
    )
    name, field = model_field(dataset)
    stats, _ = measure(batches, plan, TinyModelStep(name, field, CPU), workers=0)
    assert stats.padding_efficiency is None
    assert stats.packing_efficiency == pytest.approx(plan.packing_efficiency)


@pytest.mark.parametrize(
    ("batch_size", "max_tokens", "ragged", "message"),
    [
        (3, 256, True, "makes batches of 4 rows, but --batch-size says 3"),
        (None, 32, True, "max_tokens=32 is less than seq_len=64"),
        (4, None, False, "--pack needs a ragged field"),
    ],
)
def test_bad_packing_options_are_usage_errors(
    tmp_path: Path, batch_size: int | None, max_tokens: int | None, ragged: bool, message: str
) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5", ragged=ragged)))
    with pytest.raises(UsageError, match=re.escape(message)):
        make_plan(dataset, batches=2, batch_size=batch_size, max_tokens=max_tokens, pack_length=64)


def test_a_dataset_without_ragged_fields_gets_shuffled_fixed_size_batches(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5", samples=50, ragged=False)))
    plan = make_plan(dataset, batches=7, batch_size=16, max_tokens=None)
    assert plan.rows == (16, 16, 16, 2, 16, 16, 16)
    assert sorted(i for b in plan.batches[:4] for i in b) == list(range(50))
    assert plan.counts(0) == (16, None, None) and plan.padding_efficiency is None
    with pytest.raises(UsageError, match="--max-tokens needs a ragged field"):
        make_plan(dataset, batches=7, batch_size=None, max_tokens=100)


def test_samples_over_the_token_budget_are_skipped_and_counted(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5")))
    plan = make_plan(dataset, batches=5, batch_size=None, max_tokens=30)
    assert plan.skipped == int((dataset.lengths > 30).sum()) > 0


def test_measure_times_every_batch_and_each_step_at_least_as_long_as_its_sleep(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5")))
    plan = make_plan(dataset, batches=6, batch_size=8, max_tokens=None)
    collate = fastload.PadCollate(primary=dataset.length_field)
    batches = make_loader("fastload", dataset, plan, collate, workers=0, prefetch=None, device=CPU)
    stats, _ = measure(batches, plan, SleepStep(5.0, CPU), workers=0)
    assert (stats.batches, stats.steady_batches, stats.samples) == (6, 5, sum(plan.rows))
    assert stats.step_s >= 6 * 0.005  # time.sleep never returns early
    assert stats.stall_fraction == pytest.approx(stats.wait_s / (stats.wait_s + stats.step_s))
    assert stats.padding_efficiency == pytest.approx(plan.padding_efficiency)


def test_a_loader_that_delivers_too_few_batches_is_an_error(tmp_path: Path) -> None:
    dataset = open_dataset(str(write_h5(tmp_path / "d.h5")))
    plan = make_plan(dataset, batches=4, batch_size=8, max_tokens=None)
    with pytest.raises(RuntimeError, match="yielded 2 batches; the plan has 4"):
        measure([{}, {}], plan, lambda batch: None, workers=0)


def test_the_tiny_model_trains_on_a_ragged_field_and_on_a_fixed_one(tmp_path: Path) -> None:
    for ragged in (True, False):
        dataset = open_dataset(str(write_h5(tmp_path / f"d{ragged}.h5", ragged=ragged)))
        name, field = model_field(dataset)
        assert name == ("tokens" if ragged else "features")
        step = TinyModelStep(name, field, CPU)
        batch = fastload.PadCollate(primary=dataset.length_field)(dataset.read_batch(np.arange(8)))
        step(batch)
        assert np.isfinite(step.loss)
        assert step.name == "tiny (cpu)"


def test_the_recommendation_is_the_fewest_workers_then_the_smallest_prefetch_under_2_percent() -> None:
    rows = [row(workers=0, stall=0.30), row(loader="torch", workers=0, stall=0.4),
            row(workers=2, prefetch=4, stall=0.001), row(workers=2, prefetch=2, stall=0.015),
            row(loader="torch", workers=2, stall=0.2, samples_per_s=500), row(workers=4, stall=0.0)]
    rec = recommend(rows, "10 ms", cores=8, max_workers_tried=4)
    assert rec.chosen is not None and (rec.chosen.workers, rec.chosen.prefetch) == (2, 2)
    assert rec.text == (
        "10 ms step: use num_workers=2, prefetch_factor=2 — stall 1.5 %, 1,000 samples/s, "
        "p99 wait 1.50 ms, first batch 0.20 s; torch's DataLoader with num_workers=2: stall "
        "20.0 %, 500 samples/s"
    )
    assert rec.as_dict()["num_workers"] == 2


def test_without_a_good_configuration_it_names_the_best_and_what_to_try() -> None:
    rows = [row(workers=1, stall=0.30), row(workers=2, stall=0.10)]
    more_cores = recommend(rows, "10 ms", cores=8, max_workers_tried=2)
    assert more_cores.chosen is None and more_cores.best.workers == 2
    assert "no configuration kept the stall under 2 %; the lowest, num_workers=2" in more_cores.text
    assert more_cores.text.endswith("Try --workers up to 8 (this machine's cores)")
    all_cores = recommend(rows, "10 ms", cores=2, max_workers_tried=2)
    assert "The loader cannot keep up with a 10 ms step on 2 cores" in all_cores.text
    assert all_cores.as_dict()["num_workers"] is None


def test_table_rows_line_up_with_the_header_and_show_unknowns_as_dashes() -> None:
    unknown = dataclasses.replace(row(workers=0), p99_wait_ms=None, first_batch_s=None, pss_bytes=None)
    header, line = table_header(), table_row(unknown)
    assert len(line) == len(header)
    assert line.split() == ["fastload", "0", "-", "10", "ms", "1,000", "0.0", "-", "-", "-"]


def test_results_are_written_as_json_and_csv(tmp_path: Path) -> None:
    rows = [row(), row(loader="torch")]
    rec = recommend(rows, "10 ms", cores=2, max_workers_tried=1)
    lines = write_results(tmp_path / "out", rows, [rec], {"data": "d.h5"})
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["data"] == "d.h5" and len(saved["rows"]) == 2
    assert saved["rows"][0] == rows[0].as_dict()
    assert saved["recommendations"][0]["num_workers"] == 1
    csv_lines = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == [f.name for f in dataclasses.fields(BenchRow)]
    assert len(csv_lines) == 3
    has_plot = importlib.util.find_spec("matplotlib") is not None
    assert (PLOT_HINT in lines) is not has_plot
    assert (tmp_path / "out" / "stall.png").exists() is has_plot


def test_the_plot_is_a_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [row(workers=w, prefetch=p, stall=0.1 / (w + 1)) for w in (0, 1, 2) for p in (2, 4)]
    rows += [row(loader="torch", workers=w, stall=0.3) for w in (0, 1, 2)]
    write_results(tmp_path, rows, [recommend(rows, "10 ms", cores=2, max_workers_tried=2)], {})
    assert (tmp_path / "stall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
