"""``fastload convert --engine ray`` as users run it: a command-line job SIGKILLed mid-conversion
publishes nothing and a rerun completes it; an ``s3://`` output holds the local conversion's
objects. Both on the session's local Ray instance."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_remote_cli import objects  # tests/remote is on the path (conftest.py)

from fastload._apps._convert._convert import convert
from fastload._apps._convert._convert_options import ConvertOptions
from fastload._remote import INDEX_NAME
from fastload.cli import main

pytest.importorskip("ray.data")

#: Ray's own deprecation notices about its internal settings are not ours to act on.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

REPO = Path(__file__).resolve().parents[2]

#: A tokenizer that is slow while the file ``slow`` lies beside it (and then says it has
#: started, in ``started``), so that the job is surely mid-way when it is killed, and fast for
#: the runs that check the result.
SLOW_TOKENIZER = """\
import time
from pathlib import Path

SLOW = Path(__file__).with_name("slow")


def tok(text):
    if SLOW.exists():
        SLOW.with_name("started").touch()
        time.sleep(0.003)
    return [len(word) for word in text.split()]
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def test_a_job_killed_mid_conversion_publishes_nothing_and_a_rerun_completes_it(
    ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the callable tokenizer is imported from the folder it runs in
    (tmp_path / "slowtok.py").write_text(SLOW_TOKENIZER)
    (tmp_path / "slow").touch()
    lines = [" ".join(["word"] * (i % 17 + 1)) for i in range(4000)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "ray").mkdir()
    options = ["--tokenizer", "slowtok:tok", "--shard-size", "500"]
    command = [sys.executable, "-m", "fastload.cli", "convert", "in.txt", "-o", "ray/out.h5", *options]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    job = subprocess.Popen(
        [*command, "--engine", "ray", "--ray-address", ray_cluster, "--quiet"],
        env=env,
        stderr=subprocess.PIPE,
    )
    temp = tmp_path / "ray" / f".out.h5.fastload-tmp-{job.pid}"
    assert not (tmp_path / "started").exists()
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():  # a Ray task is tokenizing: the job is mid-way
        assert job.poll() is None, job.stderr.read() if job.stderr else ""
        assert time.monotonic() < deadline, "the job never started tokenizing"
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    assert job.stderr is not None
    job.stderr.close()
    assert _files(tmp_path / "ray") == {}  # no shard, no index: nothing of the run is published
    (tmp_path / "slow").unlink()
    rerun = ConvertOptions(
        inputs=("in.txt",), output=tmp_path / "ray/out.h5", tokenizer="slowtok:tok", shard_size=500
    )
    report = convert(ConvertOptions(**{**rerun.__dict__, "engine": "ray"}))
    assert report.removed_temps == (temp,)  # the killed run's temporary folder
    convert(ConvertOptions(**{**rerun.__dict__, "output": tmp_path / "local.h5"}))
    local = {p.name: p.read_bytes() for p in tmp_path.glob("local-*.h5")}
    assert local and {n.replace("local-", "out-"): b for n, b in local.items()} == {
        n: b for n, b in _files(tmp_path / "ray").items() if n != INDEX_NAME
    }
    assert len(json.loads((tmp_path / "ray" / INDEX_NAME).read_text())["shards"]) == 8


def test_an_s3_output_holds_the_local_conversions_objects(
    ray_cluster: str, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    rows = [{"text": f"row {i} " + "x" * (i * 7 % 23), "label": i % 5} for i in range(300)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [str(tmp_path / "rows.jsonl"), "--label-field", "label", "--shard-size", "64", "--quiet"]
    assert main(["convert", *common, "-o", str(tmp_path / "corpus.h5")]) == 0
    endpoint = f"endpoint_override={s3_server.endpoint}"
    url = f"s3://{bucket}/corpus/"
    assert main(["convert", *common, "-o", url, "--storage-option", endpoint, "--engine", "ray"]) == 0
    stored = objects(s3_server, f"{bucket}/corpus")
    local = {p.name: p.read_bytes() for p in tmp_path.glob("corpus-*.h5")}
    assert sorted(stored) == sorted([*local, INDEX_NAME]) and len(local) == 5
    assert {n: stored[n] for n in local} == local
    uploads = [r.path.rsplit("/", 1)[-1] for r in s3_server.requests() if r.method == "PUT"]
    assert uploads[-1] == INDEX_NAME  # the index last
