"""How fast does ``fastload convert`` turn raw text into the fastload layout?

What it isolates: conversion throughput in MB of input per second, end to end (read, validate
UTF-8, split, tokenize, spool, write the contiguous HDF5 file with its offsets and ``/lengths``,
fsync, rename), in this process, against a plain-Python baseline that does the least a user
would: read the file line by line, turn each line into a uint8 array, and write them as an h5py
variable-length dataset (it neither validates UTF-8 nor fsyncs; the converter's fsyncs, which
crash safety needs, are part of its time). Inputs:

* **text lines** (bytes tokenization): the issue's goal is >= 5x the baseline;
* **JSON Lines** with a text field (bytes tokenization), against the same baseline plus
  ``json.loads`` per line, in this process and with ``--workers 2``.

And ``--engine ray`` (``test_ray_engine_against_the_local_converter``, ``--size full`` only:
starting Ray costs CI more than its 15 s budget): 40 MB of JSON Lines, bytes and whitespace
tokenization, through a local Ray instance of 1 and then 2 CPUs, against the local converter
(``--workers 0`` and ``2``) timed in the same interleaved rounds, each Ray output checked
byte-identical to the local one; and what starting and stopping the Ray instance costs, which
``--engine ray`` without ``--ray-address`` pays per run.

Line lengths are lognormal (median about 100 bytes). Every figure is the median of several
rounds, interleaved so that noise hits both sides alike; every output is checked to hold exactly
the baseline's samples.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_convert.py -s -p no:cacheprovider
--size full`` (``--size smoke``, the default, runs in seconds).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from fastload._apps._convert._convert import convert
from fastload._apps._convert._convert_options import ConvertOptions

SIZES = {"smoke": (8_000_000, 3), "full": (100_000_000, 3)}  # input bytes, rounds


def _lines(total_bytes: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["data", "loader", "batch", "token", "the", "of", "GPU", "wait", "never", "fast"]
    out, size = [], 0
    while size < total_bytes:
        length = int(np.clip(rng.lognormal(np.log(100), 0.8), 1, 4000))
        line = " ".join(words[i] for i in rng.integers(0, len(words), length // 5 + 1))[:length]
        out.append(line)
        size += len(line) + 1
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, bench_size: str) -> dict[str, Any]:
    total, rounds = SIZES[bench_size]
    folder = tmp_path_factory.mktemp("convert")
    lines = _lines(total)
    (folder / "lines.txt").write_text("".join(f"{line}\n" for line in lines))
    (folder / "lines.jsonl").write_text(
        "".join(json.dumps({"text": line}) + "\n" for line in lines)
    )
    return {"folder": folder, "rounds": rounds, "samples": len(lines)}


def baseline_txt(source: Path, out: Path) -> None:
    with source.open("rb") as f:
        rows = [np.frombuffer(line.rstrip(b"\n"), dtype=np.uint8) for line in f]
    _write_vlen(rows, out)


def baseline_jsonl(source: Path, out: Path) -> None:
    with source.open("rb") as f:
        rows = [
            np.frombuffer(json.loads(line)["text"].encode("utf-8"), dtype=np.uint8) for line in f
        ]
    _write_vlen(rows, out)


def _write_vlen(rows: list[np.ndarray], out: Path) -> None:
    column = np.empty(len(rows), dtype=object)
    column[:] = rows
    with h5py.File(out, "w") as f:
        f.create_dataset("text", data=column, dtype=h5py.vlen_dtype(np.uint8))


def fastload_convert(workers: int) -> Callable[[Path, Path], None]:
    def run(source: Path, out: Path) -> None:
        convert(
            ConvertOptions(
                inputs=(str(source),), output=out, overwrite=True, workers=workers, min_length=0
            )
        )

    return run


def _same_samples(converted: Path, baseline: Path) -> bool:
    with h5py.File(converted) as ours, h5py.File(baseline) as theirs:
        rows = theirs["text"][:]
        values = ours["input_ids/values"][:]
        lengths = ours["lengths"][:]
    return bool(
        np.array_equal(lengths, [r.shape[0] for r in rows])
        and np.array_equal(values, np.concatenate(rows))
    )


def _seconds(function: Callable[[Path, Path], None], source: Path, out: Path) -> float:
    start = time.perf_counter()
    function(source, out)
    return time.perf_counter() - start


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return (
            "| "
            + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([f"\n{title}", line(header), rule, *map(line, rows)])


@pytest.mark.timeout(3600)  # --size full converts 100 MB several times on a 2-core machine
def test_conversion_speed_against_plain_python(
    inputs: dict[str, Any], benchmark: Any, capsys: Any, bench_size: str
) -> None:
    folder: Path = inputs["folder"]
    cases = {
        "text lines: plain Python + h5py vlen": ("lines.txt", baseline_txt),
        "text lines: fastload convert": ("lines.txt", fastload_convert(0)),
        "JSON Lines: plain Python + json + h5py vlen": ("lines.jsonl", baseline_jsonl),
        "JSON Lines: fastload convert": ("lines.jsonl", fastload_convert(0)),
        "JSON Lines: fastload convert --workers 2": ("lines.jsonl", fastload_convert(2)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(inputs["rounds"]):
        for index, (name, (source, function)) in enumerate(cases.items()):
            seconds[name].append(_seconds(function, folder / source, folder / f"out-{index}.h5"))
    assert _same_samples(folder / "out-1.h5", folder / "out-0.h5")
    assert _same_samples(folder / "out-3.h5", folder / "out-2.h5")
    assert _same_samples(folder / "out-4.h5", folder / "out-2.h5")

    rates = {
        name: (folder / source).stat().st_size / 1e6 / float(np.median(seconds[name]))
        for name, (source, _) in cases.items()
    }
    baseline = {
        "text lines": rates["text lines: plain Python + h5py vlen"],
        "JSON Lines": rates["JSON Lines: plain Python + json + h5py vlen"],
    }
    rows = [
        [name, f"{rate:,.1f}", f"{rate / baseline[name.split(':')[0]]:.1f}x"]
        for name, rate in rates.items()
    ]
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"convert-{bench_size}.json").write_text(
        json.dumps({"mb_per_s": rates, "rounds": inputs["rounds"]}, indent=2)
    )
    with capsys.disabled():
        title = f"conversion MB/s of input ({bench_size}: {inputs['samples']:,} lines, median of {inputs['rounds']})"
        print(_table(title, ["conversion", "MB/s", "vs baseline"], rows))
    benchmark.extra_info.update({name: round(rate, 1) for name, rate in rates.items()})
    benchmark.pedantic(
        lambda: fastload_convert(0)(folder / "lines.txt", folder / "out-bench.h5"),
        rounds=1,
        iterations=1,
    )


#: Input bytes of the Ray comparison (``--size full``), and its rounds.
RAY_BYTES, RAY_ROUNDS = 40_000_000, 3


@pytest.mark.timeout(3600)
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")  # Ray's notes about its own settings
def test_ray_engine_against_the_local_converter(
    tmp_path: Path, capsys: Any, bench_size: str
) -> None:
    if bench_size != "full":
        pytest.skip("starting Ray costs CI more than its 15 s budget; run with --size full")
    ray = pytest.importorskip("ray")
    source = tmp_path / "lines.jsonl"
    source.write_text("".join(json.dumps({"text": line}) + "\n" for line in _lines(RAY_BYTES)))
    mb = source.stat().st_size / 1e6
    rows: list[list[str]] = []
    overhead: dict[str, float] = {}
    results: dict[str, float] = {}
    for cpus in (1, 2):
        started = time.perf_counter()
        ray.init(
            num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
        )
        overhead[f"start, {cpus} CPUs"] = time.perf_counter() - started
        for tokenizer in ("bytes", "whitespace"):
            runs = {
                "local": _converter(tokenizer, "local", 0),
                "local --workers 2": _converter(tokenizer, "local", 2),
                "ray": _converter(tokenizer, "ray", 0),
            }
            # One name in two folders: the vocabulary's file name is recorded in the shards.
            outs = {name: tmp_path / name.split()[0] / "out.h5" for name in runs}
            for out in outs.values():
                out.parent.mkdir(exist_ok=True)
            first = _seconds(runs["ray"], source, outs["ray"])  # Ray's workers start here
            seconds: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(RAY_ROUNDS):
                for name, run in runs.items():
                    seconds[name].append(_seconds(run, source, outs[name]))
            assert outs["ray"].read_bytes() == outs["local"].read_bytes()
            rate = {name: mb / float(np.median(times)) for name, times in seconds.items()}
            results |= {f"{tokenizer}, {name}, Ray {cpus} CPUs": r for name, r in rate.items()}
            rows.append(
                [
                    f"JSON Lines, {tokenizer}, Ray on {cpus} CPU{'s' if cpus > 1 else ''}",
                    f"{rate['local']:,.1f}",
                    f"{rate['local --workers 2']:,.1f}",
                    f"{rate['ray']:,.1f} ({rate['ray'] / rate['local']:.2f}x)",
                    f"{mb / first:,.1f}",
                ]
            )
        started = time.perf_counter()
        ray.shutdown()
        overhead[f"stop, {cpus} CPUs"] = time.perf_counter() - started
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "convert-ray.json").write_text(
        json.dumps({"mb_per_s": results, "overhead_s": overhead}, indent=2)
    )
    with capsys.disabled():
        header = ["input, tokenizer, engine", "local", "local --workers 2", "ray (vs local)", "ray, first run"]
        print(_table(f"conversion MB/s of {mb:.0f} MB input, median of {RAY_ROUNDS}", header, rows))
        print("Ray instance " + ", ".join(f"{k}: {v:.1f} s" for k, v in overhead.items()))


def _converter(tokenizer: str, engine: str, workers: int) -> Callable[[Path, Path], None]:
    def run(source: Path, out: Path) -> None:
        convert(
            ConvertOptions(
                inputs=(str(source),),
                output=out,
                overwrite=True,
                tokenizer=tokenizer,
                engine=engine,  # type: ignore[arg-type]
                workers=workers,
            )
        )

    return run
