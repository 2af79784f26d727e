"""``fastload bench`` as a user runs it: a real command in a subprocess on a real HDF5 file,
worker processes included; its table, its recommendation, its result files and its one-line
user errors."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from fastload._apps._bench._report import PLOT_HINT, table_header
from fastload.cli import main as fastload_main

FASTLOAD = [sys.executable, "-m", "fastload.cli"]


def write_corpus(path: Path, samples: int = 2_000, seed: int = 0) -> Path:
    """Token sequences with lognormal lengths, in the fastload layout."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(60), 0.7, samples), 2, 512).astype(np.int64)
    offsets = np.zeros(samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        f.create_dataset("tokens/values", data=rng.integers(0, 30_000, int(offsets[-1]), dtype=np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("lengths", data=lengths)
    return path


def test_smoke_run_prints_the_table_and_the_advice_and_keeps_the_results(tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "corpus.h5")
    done = subprocess.run(
        [*FASTLOAD, "bench", str(data), "--smoke", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith(f"fastload bench: {data}, 2,000 samples; 8 batches of 16 rows per run")
    header = out.index(table_header())
    table = [line.split() for line in out[header + 1 : header + 5]]
    assert [(r[0], r[1], r[2], r[3] + " " + r[4]) for r in table] == [
        ("fastload", "0", "-", "1 ms"), ("torch", "0", "-", "1 ms"),
        ("fastload", "1", "2", "1 ms"), ("torch", "1", "2", "1 ms"),
    ]
    advice = out[out.index("recommendation:") + 1]
    assert advice.startswith("  1 ms step: ")
    assert "use num_workers=" in advice or "no configuration kept the stall under 2 %" in advice

    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["options"]["workers"] == [0, 1] and saved["plan"]["batches"] == 8
    rows = saved["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["batches"] == 8 and r["samples"] == saved["plan"]["samples"]  # the same plan
        assert r["step_s"] >= 8 * 0.001  # eight 1 ms sleeps
        assert r["stall_fraction"] == pytest.approx(r["wait_s"] / (r["wait_s"] + r["step_s"]))
        assert r["pss_bytes"] > 0
    assert saved["recommendations"][0]["text"] == advice.strip()
    with (tmp_path / "out" / "results.csv").open() as handle:
        assert [r["loader"] for r in csv.DictReader(handle)] == ["fastload", "torch"] * 2
    if importlib.util.find_spec("matplotlib") is None:
        assert PLOT_HINT in out
        assert not (tmp_path / "out" / "stall.png").exists()
    else:
        assert (tmp_path / "out" / "stall.png").read_bytes()[:4] == b"\x89PNG"


def test_the_tiny_model_and_a_token_budget_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_corpus(tmp_path / "corpus.h5")
    code = fastload_main(
        ["bench", str(data), "--smoke", "--model", "tiny", "--max-tokens", "2048",
         "--workers", "0", "--batches", "4", "--device", "cpu"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "4 batches of up to 2,048 tokens per run" in out
    assert "tiny (cpu)" in out and "recommendation:" in out


def test_pack_benchmarks_packed_batches_and_reports_packing_efficiency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_corpus(tmp_path / "corpus.h5")
    code = fastload_main(
        ["bench", str(data), "--smoke", "--pack", "256", "--batch-size", "4", "--workers", "0,1",
         "--batches", "4", "--out", str(tmp_path / "out")]
    )
    out = capsys.readouterr().out
    assert code == 0
    summary = out.splitlines()[0]
    assert "4 batches of 4 packed rows of 256 tokens per run, packing efficiency" in summary
    assert "padding efficiency" not in summary
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["options"]["pack_length"] == 256
    plan = saved["plan"]
    assert plan["padding_efficiency"] is None and 0.9 < plan["packing_efficiency"] <= 1
    assert [(r["loader"], r["workers"]) for r in saved["rows"]] == [
        ("fastload", 0), ("torch", 0), ("fastload", 1), ("torch", 1),
    ]
    for r in saved["rows"]:
        assert r["samples"] == 16  # 4 batches of 4 rows, through both loaders
        assert r["padding_efficiency"] is None
        assert r["packing_efficiency"] == pytest.approx(plan["packing_efficiency"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.h5"], "missing.h5: no such file or directory"),
        (["corpus.h5", "--workers", "0,two"], "--workers: expected a comma-separated list of integers; got '0,two'"),
        (["corpus.h5", "--step-ms", "5", "--model", "tiny"], "--step-ms and --model are exclusive"),
        (["corpus.h5", "--device", "tpu"], "--device must be one of auto, cpu, cuda; got 'tpu'"),
        (["notes.txt"], "unknown file type .txt"),
        (["corpus.h5", "--pack", "0"], "--pack must be >= 1; got 0"),
    ],
)
def test_user_errors_exit_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], message: str,
) -> None:
    write_corpus(tmp_path / "corpus.h5", samples=20)
    (tmp_path / "notes.txt").write_text("hello\n")
    monkeypatch.chdir(tmp_path)
    code = fastload_main(["bench", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastload bench: error: ")
    assert message in lines[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="eviction and mincore are Linux's")
def test_cold_evicts_the_files_before_every_configuration_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastload._apps._bench import _cli
    from fastload._apps._bench._pagecache import resident_bytes

    data = write_corpus(tmp_path / "corpus.h5")
    evicted: list[int | None] = []
    original = _cli.evict_files

    def evict_and_check(paths: list[str]) -> int:
        left = original(paths)
        evicted.append(resident_bytes(paths))
        return left

    monkeypatch.setattr(_cli, "evict_files", evict_and_check)
    code = fastload_main(["bench", str(data), "--smoke", "--cold", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert "cold: the page cache is emptied of 1 file(s) before each run" in out
    assert evicted == [0, 0, 0, 0]  # before each of the 4 configurations, nothing left resident
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["options"]["cold"] is True
    assert [r["cold"] for r in saved["rows"]] == [True] * 4


def test_a_run_without_cold_leaves_the_page_cache_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_corpus(tmp_path / "corpus.h5")
    code = fastload_main(["bench", str(data), "--smoke", "--workers", "0", "--out", str(tmp_path / "out")])
    assert code == 0 and "cold:" not in capsys.readouterr().out
    assert [r["cold"] for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]] == [False, False]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["corpus.h5", "--smoke", "--storage-option", "endpoint_override=x"], "are for a remote DATA"),
        (["s3://bucket/corpus/", "--storage-option", "novalue"], "--storage-option: expected KEY=VALUE"),
        (["s3://bucket/corpus/", "--cold", "--storage-option", "endpoint_override=http://127.0.0.1:9"], "--cold evicts local files"),
    ],
)
def test_remote_options_misused_exit_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], message: str,
) -> None:
    write_corpus(tmp_path / "corpus.h5", samples=20)
    monkeypatch.chdir(tmp_path)
    assert fastload_main(["bench", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err
