"""A file truncated while a loader reads it is an error naming the file and both sizes, never a
SIGBUS that kills the training process: with 0 workers, and with 2 workers that had the file
open before it was cut; the fastload HDF5 layout (one-call
builds, and in-place reads of several fields) and Arrow IPC. A worker killed by SIGBUS (a
user's dataset reading its own memory map) is a WorkerCrashedError.

Each case runs in a subprocess, so that a SIGBUS kills only that process and the test sees
its exit signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from _token_files import write_token_file

HERE = Path(__file__).parent
SAMPLES = 3000
KEEP_BYTES = 8192  # the truncated file keeps its first bytes: metadata, hardly any payload

_PRELUDE = """
import os, signal, sys, threading
sys.path.insert(0, {here!r})
import numpy as np
import torch
import fastload
from fastload.errors import DataFormatError, WorkerCrashedError

def truncate(path):
    os.truncate(path, {keep})

def report(exc):
    print("RAISED", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
"""

_ZERO_WORKERS = """
dataset = {dataset}
loader = fastload.DataLoader(dataset, batch_size=16, num_workers=0)
try:
    for i, batch in enumerate(loader):
        if i == 1:
            truncate({path!r})
    print("NO ERROR", flush=True)
except DataFormatError as exc:
    report(exc)
"""

_TWO_WORKERS = """
dataset = {dataset}
loader = fastload.DataLoader(dataset, batch_size=16, num_workers=2, persistent_workers=True)
for batch in loader:
    pass
try:
    truncate({path!r})  # both workers have the file open and mapped from the first epoch
    for batch in loader:
        pass
    print("NO ERROR", flush=True)
except DataFormatError as exc:
    report(exc)
finally:
    del loader
"""

_WORKER_SIGBUS = """
class Mapped(torch.utils.data.Dataset):
    # Sample 40 maps a whole file, which is truncated before the read: SIGBUS, in every
    # worker that tries it.
    def __init__(self, path):
        self.path = path
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if i != 40:
            return torch.tensor(i)
        with open(self.path, "wb") as f:
            f.write(bytes(1 << 20))
        data = np.memmap(self.path, np.uint8, mode="r")
        truncate(self.path)
        return torch.tensor(int(data[100_000]))

loader = fastload.DataLoader(Mapped({path!r}), batch_size=4, num_workers=2, timeout=60)
try:
    for batch in loader:
        pass
    print("NO ERROR", flush=True)
except WorkerCrashedError as exc:
    report(exc)
"""


def _run(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    program = tmp_path / "run.py"
    program.write_text(textwrap.dedent(script))
    return subprocess.run(
        [sys.executable, str(program)], capture_output=True, text=True, timeout=100,
        env={**os.environ, **env}, check=False,
    )  # fmt: skip


def _hdf5(tmp_path: Path) -> Path:
    return write_token_file(tmp_path / "tokens.h5", SAMPLES, 200, seed=4, label=True)


def _arrow(tmp_path: Path) -> Path:
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 200, SAMPLES)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(1, 999, offsets[-1]).astype(np.uint16)))
    table = pa.table({"tokens": ids, "label": np.arange(SAMPLES, dtype=np.int64)})
    path = tmp_path / "tokens.arrow"
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=500)
    return path


_CASES = {
    "hdf5-one-call": (_hdf5, "fastload.HDF5Dataset({path!r}, fields=['tokens'])"),
    "hdf5-in-place": (_hdf5, "fastload.HDF5Dataset({path!r}, fields=['tokens', 'label'])"),
    "arrow-ipc": (_arrow, "fastload.ArrowDataset({path!r})"),
}


def _expect_named_error(result: subprocess.CompletedProcess[str], path: Path) -> None:
    assert result.returncode == 0, (
        f"the process died (exit {result.returncode}"
        f"{', ' + signal.Signals(-result.returncode).name if result.returncode < 0 else ''}):"
        f" {result.stderr[-2000:]}"
    )
    assert "RAISED DataFormatError" in result.stdout, result.stdout + result.stderr[-2000:]
    size = path.stat().st_size
    assert f"{path}: the file has {size} bytes, but had" in result.stdout, result.stdout


@pytest.mark.parametrize("case", list(_CASES))
def test_a_file_truncated_during_an_epoch_is_an_error_with_no_workers(tmp_path: Path, case: str) -> None:
    make, dataset = _CASES[case]
    path = make(tmp_path)
    script = _PRELUDE + _ZERO_WORKERS
    result = _run(script.format(here=str(HERE), keep=KEEP_BYTES, path=str(path), dataset=dataset.format(path=str(path))), tmp_path)
    _expect_named_error(result, path)


@pytest.mark.parametrize("case", list(_CASES))
def test_a_file_truncated_under_two_workers_is_an_error(tmp_path: Path, case: str) -> None:
    make, dataset = _CASES[case]
    path = make(tmp_path)
    script = _PRELUDE + _TWO_WORKERS
    result = _run(script.format(here=str(HERE), keep=KEEP_BYTES, path=str(path), dataset=dataset.format(path=str(path))), tmp_path)
    _expect_named_error(result, path)


def test_a_worker_killed_by_sigbus_is_a_worker_crash(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    result = _run((_PRELUDE + _WORKER_SIGBUS).format(here=str(HERE), keep=KEEP_BYTES, path=str(path)), tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "RAISED WorkerCrashedError" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "SIGBUS" in result.stdout, result.stdout
