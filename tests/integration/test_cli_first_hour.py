"""What a new user meets in their first hour with the ``fastload`` command, run as they run it
(``python -m fastload ...`` in a subprocess): ``inspect`` into a closed pipe, on a folder and on
every format the readers take; ``demo``'s numbers and argument errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from fastload.cli import main as fastload_main

FASTLOAD = [sys.executable, "-m", "fastload"]


def run(*argv: str, timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FASTLOAD, *argv], capture_output=True, text=True, timeout=timeout, check=False, **kwargs  # type: ignore[call-overload]
    )


def write_text(path: Path, lines: int) -> Path:
    path.write_text("".join(f"{i:06d} " + "word " * (i % 17 + 1) + "\n" for i in range(lines)))
    return path


def converted(tmp_path: Path, lines: int = 300, *extra: str) -> Path:
    source = write_text(tmp_path / "corpus.txt", lines)
    out = tmp_path / "out" / "corpus.h5"
    out.parent.mkdir()
    assert fastload_main(["convert", str(source), "-o", str(out), "--quiet", *extra]) == 0
    return out


def test_inspect_into_a_closed_pipe_ends_quietly_as_coreutils_do(tmp_path: Path) -> None:
    data = converted(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -2` that has already exited: every write fails with EPIPE
    try:
        done = subprocess.run(
            [*FASTLOAD, "inspect", str(data)], stdout=write_end, stderr=subprocess.PIPE,
            text=True, timeout=120, check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE


def test_inspect_a_folder_of_shards_checks_each_and_reports_them_together(tmp_path: Path) -> None:
    data = converted(tmp_path, 300, "--shard-size", "100")
    done = run("inspect", str(data.parent), "--verify")
    assert done.returncode == 0, done.stderr
    assert "HDF5Dataset, 300 samples in 3 file(s)" in done.stdout
    assert "lengths of input_ids: min" in done.stdout and "padding efficiency" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: OK (every sample read)")


def _table(samples: int = 200) -> pa.Table:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(1, 50, samples)]
    return pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32())), "label": np.arange(samples)})


def _write(path: Path, kind: str) -> None:
    table = _table()
    if kind == "parquet":
        pq.write_table(table, path)
    elif kind == "feather":
        feather.write_feather(table, path)
    elif kind == "ipc file":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=64)


@pytest.mark.parametrize(
    ("kind", "name"),
    [("parquet", "corpus.parquet"), ("feather", "corpus.feather"), ("ipc file", "corpus.arrow"),
     ("ipc stream", "stream.arrow")],
)
def test_inspect_takes_every_arrow_format_the_reader_takes(tmp_path: Path, kind: str, name: str) -> None:
    _write(tmp_path / name, kind)
    # Parquet is decoded into the cache once: a cache of the test's own.
    done = run("inspect", str(tmp_path / name), "--batch-size", "8",
               env={**os.environ, "FASTLOAD_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert "ArrowDataset, 200 samples in 1 file(s)" in done.stdout
    assert "input_ids" in done.stdout and "label" in done.stdout and "h5py" not in done.stdout
    assert "lengths of input_ids: min 1" in done.stdout and "length-grouped batches" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: OK (opened by its reader; --verify reads every sample)")


def test_inspect_a_file_no_reader_takes_names_the_formats_it_takes(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    done = run("inspect", str(tmp_path / "notes.txt"))
    assert done.returncode == 2
    assert "unknown file type .txt" in done.stderr and ".parquet" in done.stderr
    assert len(done.stderr.splitlines()) == 1
    done = run("inspect", str(tmp_path / "missing"))
    assert done.returncode == 2 and "missing: no such file or directory" in done.stderr


def test_demo_prints_one_stall_figure_under_one_name(tmp_path: Path) -> None:
    done = run("demo", "--samples", "1000", "--steps", "30", "--batch-size", "16", "--workers", "1",
               "--dir", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    header = next(line for line in out.splitlines() if line.startswith("loader "))
    assert header.split()[:3] == ["loader", "samples/s", "stall"]
    row = next(line for line in out.splitlines() if line.startswith("fastload.DataLoader"))
    stats = next(line for line in out.splitlines() if line.startswith("loader.stats():"))
    table_stall = row.split()[2] + " %"
    stats_stall = next(p.strip() for p in stats.split("|") if p.strip().startswith("stall "))
    assert stats_stall == f"stall {table_stall}"
    table_speed = row.split()[1]
    assert f"| {table_speed} samples/s |" in stats


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--samples", "0"], "argument --samples: must be >= 1; got 0"),
     (["--workers", "-1"], "argument --workers: must be >= 0; got -1"),
     (["--steps", "ten"], "argument --steps: expected an integer >= 1; got 'ten'")],
)
def test_demo_rejects_impossible_sizes_with_a_usage_error(argv: list[str], message: str) -> None:
    done = run("demo", *argv)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[0].startswith("usage: fastload demo")
    assert done.stderr.rstrip().endswith(f"fastload demo: error: {message}")


def _bench_corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 120, 600)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    import h5py

    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = len(lengths)
        f.create_dataset("tokens/values", data=rng.integers(0, 30_000, int(offsets[-1]), dtype=np.uint16))
        f.create_dataset("tokens/offsets", data=offsets.astype(np.int64))
        f.create_dataset("lengths", data=lengths.astype(np.int64))
    return path


def _one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def test_bench_keeps_its_default_workers_within_the_cores_and_torchs_warning_out_of_the_table(
    tmp_path: Path,
) -> None:
    data = _bench_corpus(tmp_path / "corpus.h5")
    common = ["bench", str(data), "--step-ms", "1", "--batches", "3", "--prefetch", "2", "--batch-size", "8"]
    done = subprocess.run(
        [*FASTLOAD, *common, "--out", str(tmp_path / "a")], capture_output=True, text=True,
        timeout=300, check=False, preexec_fn=_one_core,
    )
    assert done.returncode == 0, done.stderr
    assert "workers: 0,1 (the default list, up to the 1 cores)" in done.stdout
    assert "This DataLoader will create" not in done.stdout + done.stderr
    import json

    assert json.loads((tmp_path / "a" / "results.json").read_text())["options"]["workers"] == [0, 1]

    done = subprocess.run(
        [*FASTLOAD, *common, "--workers", "0,2"], capture_output=True, text=True,
        timeout=300, check=False, preexec_fn=_one_core,
    )
    assert done.returncode == 0, done.stderr
    assert "This DataLoader will create" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    note = "num_workers=2 exceeds the 1 cores this process may use: torch's warning"
    assert sum(note in line for line in lines) == 1
    assert [line.split()[:2] for line in lines if line.startswith(("fastload  ", "torch  "))] == [
        ["fastload", "0"], ["torch", "0"], ["fastload", "2"], ["torch", "2"],
    ]


def test_bench_pack_names_its_throughput_rows_per_second(tmp_path: Path) -> None:
    data = _bench_corpus(tmp_path / "corpus.h5")
    done = run("bench", str(data), "--smoke", "--pack", "256", "--batch-size", "4", "--workers", "0")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if line.startswith("loader "))
    assert "rows/s" in header.split() and "samples/s" not in header
    assert "rows/s: packed rows of 256 tokens per second, not samples" in done.stdout
    advice = done.stdout.split("recommendation:")[1]
    assert "rows/s" in advice and "samples/s" not in advice


def test_convert_says_empty_lines_apart_from_samples_shorter_than_min_length(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello there\n\nab\nanother line\n\n\n")
    done = run("convert", str(tmp_path / "a.txt"), "-o", str(tmp_path / "a.h5"), "--min-length", "3")
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "dropped 3 empty samples (blank lines or no tokens; --min-length 0 keeps them)" in said
    assert "dropped 1 samples shorter than --min-length" in said
    done = run("convert", str(tmp_path / "a.txt"), "-o", str(tmp_path / "b.h5"))
    assert done.returncode == 0, done.stderr
    assert "shorter than --min-length" not in done.stdout + done.stderr


def test_bench_device_cuda_without_cuda_advises_the_option_the_user_types(tmp_path: Path) -> None:
    data = _bench_corpus(tmp_path / "corpus.h5")
    done = run("bench", str(data), "--smoke", "--device", "cuda",
               env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "--device cpu" in done.stderr and "device=None" not in done.stderr


def test_a_pack_length_over_the_token_budget_is_named_pack_length() -> None:
    import fastload

    class Docs:
        lengths = np.full(20, 10)

        def __len__(self) -> int:
            return 20

        def __getitem__(self, index: int) -> dict[str, np.ndarray]:
            return {"input_ids": np.arange(10)}

    with pytest.raises(ValueError, match=r"max_tokens=32 is less than pack_length=64") as caught:
        fastload.DataLoader(Docs(), pack_length=64, max_tokens=32)
    assert "seq_len" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigterm_during_convert_cleans_up_as_ctrl_c_does(tmp_path: Path, workers: str) -> None:
    import psutil

    (tmp_path / "big.txt").write_text(
        "".join(f"{i:08d} " + "abcdefghij" * (i % 12 + 1) + "\n" for i in range(400_000))
    )
    (tmp_path / "small.txt").write_text("previous\n")
    assert fastload_main(["convert", str(tmp_path / "small.txt"), "-o", str(tmp_path / "out.h5"), "--quiet"]) == 0
    previous = (tmp_path / "out.h5").read_bytes()
    process = subprocess.Popen(
        [*FASTLOAD, "convert", "big.txt", "-o", "out.h5", "--overwrite", "--quiet", "--workers", workers,
         "--tokenizer", "whitespace"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    temp = tmp_path / f".out.h5.fastload-tmp-{process.pid}"
    while not (temp.is_dir() and any(temp.iterdir())):  # mid-conversion: the spool is begun
        assert process.poll() is None, f"the converter ended before SIGTERM: {process.communicate()}"
        time.sleep(0.001)
    started = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip() == "fastload convert: terminated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "out.h5", "small.txt"]
    assert (tmp_path / "out.h5").read_bytes() == previous
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, f"workers left running: {[p.pid for p in alive]}"


def test_without_a_terminal_convert_and_bench_report_progress_on_stderr(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("".join(f"{i:07d} " + "words " * (i % 9 + 1) + "\n" for i in range(200_000)))
    # Every advance prints a line here; by default one every 5 s.
    env = {**os.environ, "_FASTLOAD_PROGRESS_EVERY_S": "0"}
    done = run("convert", str(tmp_path / "big.txt"), "-o", str(tmp_path / "big.h5"), env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("converting: ")]
    assert len(lines) >= 2, done.stderr
    assert " MB of " in lines[-1] and "records/s" in lines[-1]
    done = run("convert", str(tmp_path / "big.txt"), "-o", str(tmp_path / "q.h5"), "--quiet", env=env)
    assert done.returncode == 0 and done.stderr == ""

    data = _bench_corpus(tmp_path / "corpus.h5")
    done = run("bench", str(data), "--smoke", "--workers", "0")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "fastload bench: run 1 of 2: fastload, num_workers=0, 1 ms step",
        "fastload bench: run 2 of 2: torch, num_workers=0, 1 ms step",
    ]


def test_inspect_a_plain_hdf5_file_describes_it_as_hdf5dataset_reads_it(tmp_path: Path) -> None:
    import h5py

    with h5py.File(tmp_path / "features.h5", "w") as f:
        f["x"] = np.zeros((50, 4), np.float32)
        f["y"] = np.arange(50)
    done = run("inspect", str(tmp_path / "features.h5"), "--verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "HDF5Dataset, 50 samples in 1 file(s)" in done.stdout
    assert [line.split()[:3] for line in done.stdout.splitlines() if line.startswith("  ")] == [
        ["x", "fixed", "float32"], ["y", "fixed", "int64"],
    ]
    assert done.stdout.rstrip().endswith("verdict: OK (every sample read)")
