"""The converter as users run it: both command lines, real processes, SIGKILL mid-write, exit
codes and one-line errors, bounded memory, and the file read back by fastload's reader."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import psutil
import pytest

import fastload
from fastload.cli import main as fastload_main

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "convert_to_hdf5.py"
FASTLOAD = [sys.executable, "-m", "fastload.cli"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_corpus(path: Path, lines: int, width: int = 80) -> Path:
    """``lines`` lines of varied length, deterministic."""
    rows = (f"{i:08d} " + "abcdefghij" * ((i * 7919) % width // 10 + 1) for i in range(lines))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.slow
def test_the_script_and_fastload_convert_write_the_same_bytes_for_any_worker_count(
    tmp_path: Path,
) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", 3000)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    common = ["corpus.txt", "--max-length", "40", "--shard-size", "1000", "--quiet"]
    subprocess.run(
        [*FASTLOAD, "convert", *common, "-o", "a/out.h5"], cwd=tmp_path, check=True, timeout=120
    )
    subprocess.run(
        [sys.executable, str(SCRIPT), *common, "-o", "b/out.h5", "--workers", "3"],
        cwd=tmp_path,
        check=True,
        timeout=120,
    )
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["fastload-index.json", "out-00000.h5", "out-00001.h5", "out-00002.h5"]
    assert all(digest(tmp_path / "a" / n) == digest(tmp_path / "b" / n) for n in names)
    assert corpus.stat().st_size > 0


def test_a_user_error_in_a_real_process_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n\n{"text": oops}\n')
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "a.jsonl", "-o", "a.h5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "convert_to_hdf5.py: error: a.jsonl:3: malformed JSON: Expecting value (column 10) "
        "(--on-error skip skips such records)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.txt", "-o", "x.h5"], "input not found: missing.txt"),
        (["a.txt", "-o", "x.h5", "--max-length", "0"], "--max-length must be >= 1, got 0"),
        (
            ["a.txt", "-o", "x.h5", "--compression", "zip"],
            "--compression must be none, lzf, gzip or gzip:0..9",
        ),
        (["a.txt", "-o", "a.txt/x.h5"], "output folder is not a folder"),
        (["a.txt", "-o", "nowhere/x.h5"], "output folder does not exist"),
        (["a.txt", "-o", "old.h5"], "old.h5 exists; pass --overwrite to replace it"),
        (["a.txt", "-o", "x.h5", "--tokenizer", "nomodule:fn"], "cannot import 'nomodule'"),
        (["a.txt", "-o", "x.h5", "--offsets", "a=b"], "--offsets applies to .npy/.npz inputs only"),
    ],
)
def test_user_errors_print_one_line_and_return_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "old.h5").write_bytes(b"previous")
    assert fastload_main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastload convert: error: ") and message in err
    assert (tmp_path / "old.h5").read_bytes() == b"previous"


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into read-only folders; the check cannot fail as root"
)
def test_an_unwritable_output_folder_is_a_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert fastload_main(["convert", str(tmp_path / "a.txt"), "-o", str(locked / "x.h5")]) == 2
    assert "output folder is not writable" in capsys.readouterr().err


def test_inspect_reports_fields_lengths_padding_and_a_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_corpus(tmp_path / "c.txt", 500)
    assert (
        fastload_main(["convert", str(tmp_path / "c.txt"), "-o", str(tmp_path / "c.h5"), "--quiet"])
        == 0
    )
    assert fastload_main(["inspect", str(tmp_path / "c.h5"), "--batch-size", "16", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "500 samples" in out and "input_ids" in out and "uint8" in out and "contiguous" in out
    assert "lengths of input_ids: min 19  median" in out and "p90" in out and "p99" in out
    assert "padding efficiency at batch size 16" in out and "random batches" in out
    assert out.rstrip().endswith("verdict: OK (every offset, length and id checked)")


def test_inspect_pack_adds_the_packing_efficiency_at_that_seq_len(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_corpus(tmp_path / "c.txt", 500)
    fastload_main(["convert", str(tmp_path / "c.txt"), "-o", str(tmp_path / "c.h5"), "--quiet"])
    assert fastload_main(["inspect", str(tmp_path / "c.h5"), "--batch-size", "4"]) == 0
    assert "packing efficiency" not in capsys.readouterr().out
    assert fastload_main(["inspect", str(tmp_path / "c.h5"), "--batch-size", "4", "--pack", "512"]) == 0
    out = capsys.readouterr().out
    assert "padding efficiency at batch size 4" in out  # what it shows without --pack stays
    assert "packing efficiency at seq_len 512, 4 rows a batch" in out
    assert "packed batches" in out and out.rstrip().endswith("verdict: OK (structure checked; --verify checks every offset)")


def test_inspect_verify_finds_corrupted_offsets_and_lengths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_corpus(tmp_path / "c.txt", 50)
    fastload_main(["convert", str(tmp_path / "c.txt"), "-o", str(tmp_path / "c.h5"), "--quiet"])
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        f["input_ids/offsets"][10] = f["input_ids/offsets"][12]
    assert fastload_main(["inspect", str(tmp_path / "c.h5")]) == 0  # the cheap checks cannot see it
    assert fastload_main(["inspect", str(tmp_path / "c.h5"), "--verify"]) == 1
    assert "verdict: INVALID" in capsys.readouterr().out
    (tmp_path / "not.h5").write_text("plain text")
    assert fastload_main(["inspect", str(tmp_path / "not.h5")]) == 2


def children_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_when(
    tmp_path: Path, argv: list[str], ready: Callable[[Path], bool]
) -> tuple[int, list[psutil.Process]]:
    """Start the converter, SIGKILL it once ``ready(temp folder)`` holds; returns its pid and
    the processes it had started."""
    process = subprocess.Popen(
        [*FASTLOAD, "convert", *argv],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    stderr = process.stderr
    assert stderr is not None
    temp = tmp_path / f".out.h5.fastload-tmp-{process.pid}"
    deadline = time.monotonic() + 90
    while not (temp.is_dir() and ready(temp)):
        assert process.poll() is None, f"converter ended before the kill: {stderr.read()!r}"
        assert time.monotonic() < deadline, "the converter never reached the point to kill it at"
        time.sleep(0.001)
    started = children_of(process.pid)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    stderr.close()
    return process.pid, started


def writing_hdf5(temp: Path) -> bool:
    return any(p.suffix == ".h5" for p in temp.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("moment", "ready"),
    [
        ("while spooling", lambda temp: any(temp.iterdir())),
        ("while writing the HDF5 file", writing_hdf5),
    ],
)
def test_sigkill_mid_write_leaves_the_previous_file_and_a_temp_the_next_run_removes(
    tmp_path: Path, moment: str, ready: Callable[[Path], bool]
) -> None:
    write_corpus(tmp_path / "big.txt", 400_000, width=120)
    (tmp_path / "small.txt").write_text("previous\n")
    argv = ["big.txt", "-o", "out.h5", "--overwrite", "--quiet"]
    assert (
        fastload_main(
            ["convert", str(tmp_path / "small.txt"), "-o", str(tmp_path / "out.h5"), "--quiet"]
        )
        == 0
    )
    previous = digest(tmp_path / "out.h5")
    pid, _ = kill_when(tmp_path, argv, ready)
    leftovers = sorted(
        p.name for p in tmp_path.iterdir() if p.name not in ("big.txt", "small.txt", "out.h5")
    )
    assert leftovers == [f".out.h5.fastload-tmp-{pid}"], moment
    assert digest(tmp_path / "out.h5") == previous, f"killed {moment}, the destination changed"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert fastload_main(["convert", *argv]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "out.h5", "small.txt"]
    with h5py.File(tmp_path / "out.h5") as f:
        assert f.attrs["num_samples"] == 400_000


@pytest.mark.slow
def test_sigkill_with_workers_leaves_no_orphan_process(tmp_path: Path) -> None:
    write_corpus(tmp_path / "big.txt", 400_000, width=120)
    argv = ["big.txt", "-o", "out.h5", "--workers", "2", "--tokenizer", "whitespace", "--quiet"]
    _, started = kill_when(
        tmp_path, argv, lambda temp: len(children_of(int(temp.name.rsplit("-", 1)[1]))) >= 3
    )
    assert started, "the converter had started no worker processes"
    _gone, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, f"orphaned workers still running: {[p.pid for p in alive]}"
    assert not (tmp_path / "out.h5").exists()


CHILD = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from fastload._apps._convert._convert import convert
    from fastload._apps._convert._convert_options import ConvertOptions
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    convert(ConvertOptions(inputs=(sys.argv[1],), output=Path(sys.argv[2]), label_fields=("label",)))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)
    """
)


@pytest.mark.slow
def test_memory_stays_far_below_the_input_size(tmp_path: Path) -> None:
    line = (json.dumps({"text": "lorem ipsum dolor sit amet, " * 9, "label": 3}) + "\n").encode()
    size = 48_000_000
    (tmp_path / "big.jsonl").write_bytes(line * (size // len(line)))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "big.jsonl", "big.h5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    growth = int(done.stdout.split()[-1])
    assert growth < size / 3, (
        f"peak memory grew by {growth / 1e6:.0f} MB converting {size / 1e6:.0f} MB"
    )
    with h5py.File(tmp_path / "big.h5") as f:
        assert f.attrs["num_samples"] == size // len(line)


def test_round_trip_through_fastloads_reader_equals_the_source(tmp_path: Path) -> None:
    if not hasattr(fastload, "HDF5Dataset"):
        pytest.fail(
            "fastload.HDF5Dataset is not exported; the round trip through the reader cannot run"
        )
    rows = [{"text": f"row {i} " + "x" * (i % 17), "label": i % 5} for i in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        fastload_main(
            [
                "convert",
                str(tmp_path / "d.jsonl"),
                "-o",
                str(tmp_path / "d.h5"),
                "--label-field",
                "label",
                "--shard-size",
                "128",
                "--quiet",
            ]
        )
        == 0
    )
    dataset = fastload.HDF5Dataset(str(tmp_path / "d-*.h5"))
    assert len(dataset) == len(rows)
    batch = dataset.read_batch(np.arange(len(rows)))
    ids = batch["input_ids"]
    starts = np.concatenate(([0], np.cumsum(ids.lengths)))
    texts = [bytes(ids.values[a:b]).decode() for a, b in itertools.pairwise(starts)]
    assert texts == [r["text"] for r in rows]
    assert batch["label"].tolist() == [r["label"] for r in rows]
