"""A Parquet file is read through a decoded copy in the local cache: the same data as Arrow IPC,
decoded once per machine (also when two processes construct at once), decoded again when the
file changes, never read half-written (a kill -9 mid-decode leaves no copy), and an unusable
cache directory is a clear error."""

from __future__ import annotations

import errno
import os
import pickle
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _format_files import (
    Corpus,
    assert_same,
    batch_sample,
    corpus_table,
    fixed,
    make_corpus,
    ragged,
    random_indices,
    write_arrow_file,
    write_parquet,
)

import fastload
from fastload import ArrowDataset
from fastload._formats import _parquet_copy
from fastload.errors import CacheError, DataFormatError

REPO = Path(__file__).resolve().parents[3]


def _copies(cache: Path) -> list[Path]:
    """The published copies (no lock files, no temporaries)."""
    folder = cache / "parquet"
    return (
        sorted(p for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []
    )


def _temporaries(cache: Path) -> list[Path]:
    return sorted((cache / "parquet").glob(".*.tmp"))


def _fail_if_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("decoded again")

    monkeypatch.setattr(_parquet_copy, "_decode", refuse)


def test_read_batch_equals_the_same_data_as_arrow_ipc(corpus: Corpus, tmp_path: Path) -> None:
    table = corpus_table(corpus)
    parquet = ArrowDataset(
        write_parquet(tmp_path / "a.parquet", table, 8), cache_dir=tmp_path / "c"
    )
    ipc = ArrowDataset(write_arrow_file(tmp_path / "a.arrow", table, 5))
    assert parquet.fields == ipc.fields and len(parquet) == len(ipc)
    np.testing.assert_array_equal(parquet.lengths, ipc.lengths)
    indices = random_indices(len(corpus), 60, seed=7)
    got, expected = parquet.read_batch(indices), ipc.read_batch(indices)
    for name in ipc.fields:
        for position in range(len(indices)):
            assert_same(
                batch_sample(got, name, position),
                batch_sample(expected, name, position),
                f"{name}[{indices[position]}]",
            )
    assert parquet.files == [str(tmp_path / "a.parquet")]
    # White-box: the copy is memory-mapped, so numeric fields take the gather path.
    mapped = set(parquet._shard(0)._mapped)  # type: ignore[attr-defined]
    assert mapped == {n for n, f in parquet.fields.items() if f.kind != "object"}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_gives_the_same_batches_as_over_arrow_ipc(
    num_workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = make_corpus(300, seed=3)
    table = corpus_table(corpus)
    fields = ["tokens", "frames", "label", "emb"]
    parquet = ArrowDataset(
        write_parquet(tmp_path / "a.parquet", table, 32), fields=fields, cache_dir=tmp_path / "c"
    )
    ipc = ArrowDataset(write_arrow_file(tmp_path / "a.arrow", table, 50), fields=fields)
    _fail_if_decoding(monkeypatch)  # workers map the copy; nobody decodes again
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, len(corpus), 16).tolist() for _ in range(12)]

    def load(ds: ArrowDataset) -> list[dict[str, torch.Tensor]]:
        loader = fastload.DataLoader(
            ds, batch_sampler=batches, num_workers=num_workers, collate_fn=fastload.PadCollate()
        )
        return [{k: v.clone() for k, v in b.items()} for b in loader]

    got, expected = load(parquet), load(ipc)
    assert len(got) == len(expected) == len(batches)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_second_dataset_reuses_the_copy(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8)
    first = ArrowDataset(path, cache_dir=tmp_path / "c")
    (copy,) = _copies(tmp_path / "c")
    before = copy.stat()
    _fail_if_decoding(monkeypatch)
    second = ArrowDataset(path, cache_dir=tmp_path / "c")
    after = copy.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _copies(tmp_path / "c") == [copy]
    np.testing.assert_array_equal(
        second.read_batch([3, 1])["label"], first.read_batch([3, 1])["label"]
    )


def test_the_default_cache_is_fastload_cache_and_false_makes_no_copy(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "env"))
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8)
    ArrowDataset(path, fields=["label"])
    assert len(_copies(tmp_path / "env")) == 1
    uncached = ArrowDataset(path, fields=["tokens"], cache_dir=False)
    assert len(_copies(tmp_path / "env")) == 1
    assert ragged(uncached.read_batch([5])["tokens"]).lengths.tolist() == [len(corpus.tokens[5])]
    with pytest.raises(TypeError, match=r"cache_dir must be a directory, None .* or False"):
        ArrowDataset(path, cache_dir=True)  # type: ignore[arg-type]


def test_only_the_fields_read_are_decoded(corpus: Corpus, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8)
    ArrowDataset(path, fields=["emb", "tokens"], cache_dir=tmp_path / "c")
    (copy,) = _copies(tmp_path / "c")
    assert pa.ipc.open_file(copy).schema.names == ["tokens", "emb"]
    ArrowDataset(path, fields=["label"], cache_dir=tmp_path / "c")
    assert len(_copies(tmp_path / "c")) == 2  # another set of columns is another copy


def test_a_changed_file_is_decoded_again_and_its_old_copy_removed(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    write_parquet(path, corpus_table(make_corpus(40, seed=1)), 8)
    old = ArrowDataset(path, cache_dir=tmp_path / "c")
    (old_copy,) = _copies(tmp_path / "c")
    changed = make_corpus(45, seed=2, label_base=1000)
    write_parquet(path, corpus_table(changed), 8)
    stamp = old_copy.stat().st_mtime_ns + 10**9  # a new mtime even on a coarse clock
    os.utime(path, ns=(stamp, stamp))
    new = ArrowDataset(path, cache_dir=tmp_path / "c")
    assert len(new) == 45 and len(old) == 40
    assert fixed(new.read_batch([0, 44])["label"]).tolist() == [1000, 1044]
    (new_copy,) = _copies(tmp_path / "c")
    assert new_copy != old_copy


def test_pickles_carry_the_copy_path_and_clones_do_not_decode(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = ArrowDataset(
        write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8), cache_dir=tmp_path / "c"
    )
    (copy,) = _copies(tmp_path / "c")
    data = pickle.dumps(ds)
    assert len(data) < 3000 and str(copy).encode() in data
    _fail_if_decoding(monkeypatch)
    clone = pickle.loads(data)
    np.testing.assert_array_equal(clone.read_batch([7, 2])["emb"], ds.read_batch([7, 2])["emb"])


def test_a_leftover_temporary_is_not_used_and_is_removed(corpus: Corpus, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8)
    ArrowDataset(path, cache_dir=tmp_path / "first")
    (named,) = _copies(tmp_path / "first")  # copy names do not depend on the directory
    folder = tmp_path / "c" / "parquet"
    folder.mkdir(parents=True)
    leftover = folder / f".{named.name}.4242-0badf00d.tmp"
    leftover.write_bytes(named.read_bytes()[:300])  # what a killed decode leaves
    ds = ArrowDataset(path, cache_dir=tmp_path / "c")
    assert not leftover.exists() and _temporaries(tmp_path / "c") == []
    assert fixed(ds.read_batch([len(corpus) - 1])["label"]).tolist() == [len(corpus) - 1]


def _script(body: str) -> str:
    return textwrap.dedent(
        """
        import os, sys, time
        from pathlib import Path
        import numpy as np
        import fastload
        from fastload._formats import _parquet_copy
        """
    ) + textwrap.dedent(body)


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, timeout_s: float, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"child exited {proc.returncode}: {proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


CONSTRUCT = """
    parquet, cache, log, ready, go = sys.argv[1:]
    real = _parquet_copy._row_group

    def logged(*args):
        with open(log, "a") as out:
            out.write(f"{os.getpid()}\\n")
        time.sleep(0.02)  # widen the window in which the other process asks too
        return real(*args)

    _parquet_copy._row_group = logged
    Path(ready + str(os.getpid())).touch()
    while not Path(go).exists():
        time.sleep(0.005)
    ds = fastload.ArrowDataset(parquet, cache_dir=cache)
    batch = ds.read_batch(np.arange(len(ds)))
    print(int(batch["label"].sum()), int(batch["tokens"].values.astype(np.int64).sum()))
"""


def test_two_processes_constructing_at_once_decode_once_and_both_read_right(
    tmp_path: Path,
) -> None:
    corpus = make_corpus(400, seed=5)
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 20)
    log, go = tmp_path / "decoded.log", tmp_path / "go"
    procs = [
        _start(
            _script(CONSTRUCT),
            str(path),
            str(tmp_path / "c"),
            str(log),
            str(tmp_path / "ready-"),
            str(go),
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("ready-*"))) < 2:
        assert all(p.poll() is None for p in procs), [p.communicate()[1] for p in procs]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    go.touch()
    outputs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    expected = (
        f"{int(corpus.label.sum())} {sum(int(t.astype(np.int64).sum()) for t in corpus.tokens)}"
    )
    assert [out.strip() for out, _ in outputs] == [expected, expected]
    decoders = set(log.read_text().split())
    assert len(decoders) == 1, "both processes decoded"
    assert len(log.read_text().split()) == 20  # one pass over the 20 row groups
    assert len(_copies(tmp_path / "c")) == 1 and _temporaries(tmp_path / "c") == []


HANG_MID_DECODE = """
    parquet, cache, marker = sys.argv[1:]
    real = _parquet_copy._row_group
    done = []

    def hang_after_three(*args):
        if len(done) == 3:
            Path(marker).touch()
            time.sleep(600)
        done.append(1)
        return real(*args)

    _parquet_copy._row_group = hang_after_three
    fastload.ArrowDataset(parquet, cache_dir=cache)
"""


def test_a_kill_9_mid_decode_leaves_no_copy_and_the_next_construction_cleans_up(
    tmp_path: Path,
) -> None:
    corpus = make_corpus(2000, seed=6)
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 100)
    marker = tmp_path / "three-row-groups-written"
    proc = _start(_script(HANG_MID_DECODE), str(path), str(tmp_path / "c"), str(marker))
    try:
        _wait_for(marker, 90, [proc])
        (temporary,) = _temporaries(tmp_path / "c")
        assert temporary.stat().st_size > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert _copies(tmp_path / "c") == []  # nothing a reader could take for data
    ds = ArrowDataset(path, cache_dir=tmp_path / "c")
    assert _temporaries(tmp_path / "c") == [] and len(_copies(tmp_path / "c")) == 1
    assert fixed(ds.read_batch([1999, 0])["label"]).tolist() == [1999, 0]


def test_damaged_parquet_data_is_a_data_format_error_naming_the_file(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bad.parquet", corpus_table(make_corpus(200)), 50)
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    data[column.data_page_offset : column.data_page_offset + 32] = b"\xff" * 32  # page header
    path.write_bytes(bytes(data))
    with pytest.raises(DataFormatError, match=r"bad\.parquet: row group 2 cannot be decoded"):
        ArrowDataset(path, cache_dir=tmp_path / "c")
    assert _copies(tmp_path / "c") == [] and _temporaries(tmp_path / "c") == []


def test_a_cache_directory_that_cannot_be_created_names_it_and_the_remedy(
    corpus: Corpus, tmp_path: Path
) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8)
    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(CacheError, match=r"a_file/parquet: .*cache_dir=.*FASTLOAD_CACHE") as info:
        ArrowDataset(path, cache_dir=tmp_path / "a_file")
    assert isinstance(info.value, OSError) and info.value.filename == str(
        tmp_path / "a_file" / "parquet"
    )


def test_a_full_cache_disk_is_a_cache_error_and_leaves_no_copy(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(make_corpus(3000)), 300)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Writes past 64 KiB now fail as on a full disk (EFBIG instead of ENOSPC).
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, limits[1]))
    try:
        with pytest.raises(
            CacheError, match=r"cache directory .*/c/parquet: File too large; pass cache_dir="
        ) as info:
            ArrowDataset(path, cache_dir=tmp_path / "c")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.errno == errno.EFBIG
    assert _copies(tmp_path / "c") == [] and _temporaries(tmp_path / "c") == []
    assert len(ArrowDataset(path, cache_dir=tmp_path / "c")) == 3000  # once there is room


def test_a_file_changed_during_its_decode_is_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(make_corpus(100)), 20)
    real = _parquet_copy._row_group

    def touch_then_read(*args: object) -> pa.Table:
        stamp = path.stat().st_mtime_ns + 10**9
        os.utime(path, ns=(stamp, stamp))  # a writer still appending, say
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_parquet_copy, "_row_group", touch_then_read)
    with pytest.raises(DataFormatError, match=r"a\.parquet: changed while it was being decoded"):
        ArrowDataset(path, cache_dir=tmp_path / "c")
    assert _copies(tmp_path / "c") == [] and _temporaries(tmp_path / "c") == []


def test_a_copy_damaged_after_publication_is_decoded_again(corpus: Corpus, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 8)
    ArrowDataset(path, cache_dir=tmp_path / "c")
    (copy,) = _copies(tmp_path / "c")
    copy.write_bytes(copy.read_bytes()[: copy.stat().st_size // 2])
    ds = ArrowDataset(path, cache_dir=tmp_path / "c")
    assert fixed(ds.read_batch([len(corpus) - 1, 0])["label"]).tolist() == [len(corpus) - 1, 0]
    assert copy.stat().st_size > 0 and _copies(tmp_path / "c") == [copy]
