"""``loader.stats()`` for a remote dataset, on the moto server behind the logging proxy: bytes
downloaded (by the prefetcher and by the reads), cache hits and misses, the time the reads
waited on downloads, and a diagnosis that names the storage when it is the bottleneck."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from _servers import Faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import indexed_token_shards

import fastload

SHARDS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four HDF5 shards of token sequences (two fields: tokens and a label) and their index."""
    return indexed_token_shards(tmp_path_factory.mktemp("corpus"), SHARDS, 150, 400, label=True)


def shard_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.h5"))


def remote(server: Any, corpus: Path, bucket: str, cache: Path) -> fastload.HDF5Dataset:
    for path in sorted(corpus.iterdir()):
        server.put(f"{bucket}/corpus/{path.name}", path.read_bytes())
    return fastload.HDF5Dataset(f"s3://{bucket}/corpus/", storage_options=server.options, cache_dir=cache)


def test_workers_report_downloads_and_epoch_two_downloads_nothing(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    loader = fastload.DataLoader(
        remote(s3_server, corpus, bucket, tmp_path), max_tokens=2048, num_workers=2, seed=1
    )
    for _ in range(2):
        for _batch in loader:
            pass
    first, second = loader.epoch_stats
    # Each shard once, whether the prefetcher or a worker that could not wait fetched it.
    assert first.downloaded_bytes == shard_bytes(corpus)
    assert first.cache_hits is not None and first.cache_misses is not None
    # Every batch reads two fields of at least one shard, each read a hit or a miss.
    assert first.cache_hits + first.cache_misses >= 2 * first.batches
    assert first.download_mb_per_s is not None and first.download_mb_per_s > 0
    assert second.downloaded_bytes == 0
    assert second.cache_misses == 0 and second.storage_wait_s == 0
    assert second.cache_hits is not None and second.cache_hits >= 2 * second.batches
    run = loader.stats()
    assert run.downloaded_bytes == shard_bytes(corpus)
    assert run.cache_hits == first.cache_hits + second.cache_hits
    assert "downloaded" in str(first)


def test_reads_in_the_training_process_wait_once_per_shard(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    # No plan to prefetch from (torch's sequential batches): each shard's first read downloads
    # it (a miss, counted with its wait); its other field and later batches hit.
    loader = fastload.DataLoader(remote(s3_server, corpus, bucket, tmp_path), batch_size=10)
    batches = sum(1 for _ in loader)
    stats = loader.stats()
    assert stats.downloaded_bytes == shard_bytes(corpus)
    assert stats.cache_misses == SHARDS
    assert stats.cache_hits == 2 * batches - SHARDS
    assert stats.storage_wait_s is not None and stats.storage_wait_s > 0
    assert stats.storage_wait_share is not None and 0 < stats.storage_wait_share <= 1


def test_a_slow_store_is_diagnosed_as_the_bottleneck(
    faulty_s3: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    dataset = remote(faulty_s3, corpus, bucket, tmp_path)
    faulty_s3.set_faults(Faults(latency_s=0.15))
    loader = fastload.DataLoader(dataset, batch_size=10)
    for _batch in loader:
        pass  # a step of no time: every wait is the loader's
    stats = loader.stats()
    assert stats.storage_wait_share is not None and stats.storage_wait_share > 0.5, stats
    assert stats.diagnosis.startswith("storage-bound"), stats.diagnosis
    assert "download_concurrency" in stats.diagnosis


def test_local_files_report_no_storage(corpus: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(sorted(corpus.glob("*.h5"))), batch_size=50)
    for _batch in loader:
        pass
    stats = loader.stats()
    assert stats.downloaded_bytes is None and stats.cache_hits is None
    assert stats.storage_wait_share is None


def test_download_concurrency_is_checked() -> None:
    with pytest.raises(ValueError, match="download_concurrency"):
        fastload.DataLoader(range(4), download_concurrency=0)


def _rows(samples: list[dict[str, Any]]) -> int:
    return len(samples)  # a collate of its own: the generic path (pickled replies)


def test_the_generic_path_reports_the_workers_reads_too(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    dataset = remote(s3_server, corpus, bucket, tmp_path)
    loader = fastload.DataLoader(dataset, batch_size=25, num_workers=2, collate_fn=_rows, timeout=60)
    rows = [n for n in loader]
    stats = loader.stats()
    assert sum(rows) == len(dataset)
    assert stats.downloaded_bytes == shard_bytes(corpus)
    # each batch reads both fields of one shard: every read counted, hit or miss
    assert stats.cache_hits is not None and stats.cache_misses is not None
    assert stats.cache_hits + stats.cache_misses == 2 * len(rows)


def test_a_shard_window_the_cache_cannot_hold_twice_warns(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    largest = max(p.stat().st_size for p in corpus.glob("*.h5"))
    for path in sorted(corpus.iterdir()):
        s3_server.put(f"{bucket}/corpus/{path.name}", path.read_bytes())
    dataset = fastload.HDF5Dataset(
        f"s3://{bucket}/corpus/", storage_options=s3_server.options, cache_dir=tmp_path,
        cache_limit=int(2.5 * largest),
    )
    with pytest.warns(UserWarning, match="shuffle_shards=2 with cache_limit") as caught:
        fastload.DataLoader(dataset, max_tokens=2048, shuffle_shards=2)
    assert caught[0].filename == __file__  # at the line that made the loader
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastload.DataLoader(dataset, max_tokens=2048, shuffle_shards=1)  # 2 shards fit


_LATE_CREDENTIALS = """
import json, multiprocessing, os, sys
import fastload

def noop():
    pass

if __name__ == "__main__":
    url, options, environment = json.loads(sys.argv[1])
    # The fork server starts first (another library's workers, say), before the credentials
    # are set: its children have its environment, not ours.
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=noop)
    p.start()
    p.join()
    os.environ.update(environment)
    dataset = fastload.HDF5Dataset(url, storage_options=options, cache_dir=sys.argv[2])
    loader = fastload.DataLoader(dataset, batch_size=50, num_workers=2, collate_fn=len, timeout=30)
    print(sum(loader))
"""


def test_workers_read_with_the_credentials_the_dataset_was_made_with(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    import json
    import os
    import subprocess

    remote(s3_server, corpus, bucket, tmp_path / "unused")
    script = tmp_path / "late.py"
    script.write_text(_LATE_CREDENTIALS)
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    clean["PYTHONPATH"] = str(Path(fastload.__file__).parents[1])
    argument = json.dumps([f"s3://{bucket}/corpus/", s3_server.options, aws])
    done = subprocess.run(
        [sys.executable, str(script), argument, str(tmp_path / "cache")],
        env=clean, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == SHARDS * 150
