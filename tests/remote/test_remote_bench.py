"""``fastload bench`` on a remote DATA: an indexed folder on the S3-compatible test server, read
through the shard cache with the client options given on the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import indexed_token_shards

import fastload
from fastload.cli import main as fastload_main


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return indexed_token_shards(tmp_path_factory.mktemp("bench-corpus"), 2, 120, 200)


def test_bench_reads_a_remote_folder_through_the_cache_and_reports(
    s3_server: Any, bucket: str, small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3_server.upload(small_corpus, bucket)
    cache = tmp_path / "cache"
    code = fastload_main([
        "bench", url, "--smoke", "--storage-option", f"endpoint_override={s3_server.endpoint}",
        "--cache-dir", str(cache), "--cache-limit", "1GB", "--out", str(tmp_path / "out"),
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert url in out.splitlines()[0]
    assert "recommendation:" in out
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["samples"] == 240 and len(saved["rows"]) == 4
    assert all(r["batches"] == 8 and not r["cold"] for r in saved["rows"])
    # The shards came through the cache directory given.
    # (cached under the shard's name and its checksum)
    assert sorted(p.name.split(".")[0] for p in cache.rglob("*.h5")) == ["part-00000", "part-00001"]
    gets = [r for r in s3_server.requests() if r.method == "GET" and r.path.endswith(".h5")]
    assert gets  # downloaded from the server, not read from anywhere else


def test_a_remote_dataset_advises_nothing(s3_server: Any, bucket: str, small_corpus: Path, tmp_path: Path) -> None:
    """Remote shards are downloaded by the prefetcher, not hinted: willneed is 0."""
    url = s3_server.upload(small_corpus, bucket)
    dataset = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path / "cache")
    assert dataset.willneed(np.arange(50)) == 0
    assert dataset.read_files == []
    local = fastload.HDF5Dataset(sorted(small_corpus.glob("*.h5")))
    assert local.willneed(np.arange(50)) > 0
