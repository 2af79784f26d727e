"""Remote Arrow/Parquet datasets without ``fastload-index.json``, on the real moto server behind
the logging proxy: planned from one listing per node and the shards' footers and length columns
(ranged GETs, never a whole shard), the same samples and batches as with an index, one warning
that an index starts faster, and clear errors for folders that cannot be planned so."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _servers import Faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import write_token_file

import fastload
from fastload._formats._discover_remote import TAIL_BYTES
from fastload._formats._indexing import build_index, write_index
from fastload._remote import INDEX_NAME, open_store
from fastload._shards import _remote_source
from fastload.errors import DataFileNotFoundError, DataFormatError

SHARDS, ROWS = 3, 300


def table(seed: int) -> pa.Table:
    """Token ids (the ragged length field), a text column several times their size, labels."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 30000, int(n)).astype(np.int32) for n in rng.integers(1, 60, ROWS)]
    text = [rng.bytes(int(n)).hex() for n in rng.integers(800, 1600, ROWS)]
    return pa.table({"ids": pa.array(ids, pa.list_(pa.int32())), "text": text, "label": np.arange(ROWS) + seed * ROWS})


@pytest.fixture(scope="module", params=["ipc", "parquet"])
def shards(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three shards (Arrow IPC files of 3 record batches, or Parquet of 3 row groups) and their
    index, on local disk."""
    folder = tmp_path_factory.mktemp(request.param)
    for shard in range(SHARDS):
        data = table(shard)
        if request.param == "parquet":
            pq.write_table(data, folder / f"part-{shard}.parquet", row_group_size=ROWS // 3)
        else:
            with pa.OSFile(str(folder / f"part-{shard}.arrow"), "wb") as sink, pa.ipc.new_file(sink, data.schema) as out:
                for batch in data.to_batches(max_chunksize=ROWS // 3):
                    out.write_batch(batch)
    write_index(folder, build_index(folder))
    return folder


def listings(server: Any) -> int:
    return sum(1 for r in server.requests() if r.method == "GET" and "list-type" in r.query)


def shard_bytes_fetched(server: Any, folder: Path, url: str) -> tuple[int, int]:
    """Bytes the GETs of the shards under ``url`` asked for (a GET without a range: the whole
    shard), and the number of GETs from a shard's first byte (downloads: planning reads
    footers, from the end)."""
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != INDEX_NAME}
    prefix = "/" + url.removeprefix("s3://")
    fetched = from_start = 0
    for r in server.requests():
        name = r.path.rsplit("/", 1)[-1]
        if r.method != "GET" or name not in sizes or not r.path.startswith(prefix):
            continue
        first, last = (r.range or f"bytes=0-{sizes[name] - 1}").removeprefix("bytes=").split("-")
        fetched += int(last) - int(first) + 1
        from_start += first == "0"
    return fetched, from_start


def owned(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def same_batches(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_planned_from_footers_and_length_column_with_the_indexed_samples(
    s3_server: Any, bucket: str, shards: Path, tmp_path: Path
) -> None:
    indexed_url = s3_server.upload(shards, bucket, "indexed")
    bare_url = s3_server.upload(shards, bucket, "bare", leave_out=INDEX_NAME)
    total = sum(p.stat().st_size for p in shards.iterdir() if p.name != INDEX_NAME)
    indexed = fastload.ArrowDataset(indexed_url, storage_options=s3_server.options, cache_dir=tmp_path / "a")
    s3_server.proxy.reset()
    with pytest.warns(UserWarning, match=rf"{bare_url}{INDEX_NAME} not found: listed {SHARDS} shards .* in [\d.]+ s; an index starts faster .* `fastload index {bare_url}`"):
        bare = fastload.ArrowDataset(bare_url, storage_options=s3_server.options, cache_dir=tmp_path / "b")
    fetched, downloads = shard_bytes_fetched(s3_server, shards, bare_url)
    assert listings(s3_server) == 1 and downloads == 0
    heads = [r.path.rsplit("/", 1)[-1] for r in s3_server.requests() if r.method == "HEAD" and "/bare/" in r.path]
    assert sorted(heads) == sorted([INDEX_NAME, *(p.name for p in shards.iterdir() if p.name != INDEX_NAME)])  # one open each
    # Beyond each shard's tail (its footer): Parquet reads the ids column's chunks, an IPC file
    # the ids offsets and each batch's metadata; neither reads the text.
    assert fetched - SHARDS * TAIL_BYTES < total * (0.1 if shards.name.startswith("parquet") else 0.01), (fetched, total)
    assert (len(bare), bare.fields, bare.length_field) == (len(indexed), indexed.fields, "ids")
    assert np.array_equal(bare.lengths, indexed.lengths) and len(bare) == SHARDS * ROWS
    assert all(s.sha256 is None and s.version for s in bare._shards.source.index.shards)
    rows = np.random.default_rng(0).permutation(len(bare))[:50]
    got, expected = bare.read_batch(rows), indexed.read_batch(rows)
    assert np.array_equal(got["ids"].values, expected["ids"].values) and got["text"] == expected["text"]
    assert np.array_equal(got["label"], expected["label"])


def test_one_listing_per_node_for_two_loaders_with_two_workers(
    s3_server: Any, bucket: str, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    indexed_url = s3_server.upload(shards, bucket, "indexed")
    bare_url = s3_server.upload(shards, bucket, "bare", leave_out=INDEX_NAME)
    node = tmp_path / "node-cache"
    s3_server.proxy.reset()
    runs, planning = [], []
    with pytest.warns(UserWarning, match=r"not found: listed") as caught:
        for rank in range(2):  # two loaders standing for two ranks on one node, 2 workers each
            before = len(s3_server.requests())
            bare = fastload.ArrowDataset(bare_url, fields=["ids", "label"], storage_options=s3_server.options, cache_dir=node)
            planning.append(s3_server.requests()[before:])
            sampler = fastload.LengthGroupedBatchSampler(bare.lengths, max_tokens=1024, num_replicas=2, rank=rank, seed=3)
            runs.append([owned(b) for b in fastload.DataLoader(bare, batch_sampler=sampler, num_workers=2)])
    assert len(caught) == 1 and caught[0].filename == __file__  # once per process and dataset, at its creation
    assert sum(1 for r in planning[0] if r.method == "GET" and "list-type" in r.query) == 1
    assert planning[1] == []  # the second loader planned from the node's cache of the derived index
    assert listings(s3_server) == 1 and shard_bytes_fetched(s3_server, shards, bare_url)[1] == SHARDS  # one download each
    monkeypatch.setattr(_remote_source, "_warned", set())  # as in another process of the node
    s3_server.proxy.reset()
    with pytest.warns(UserWarning, match=rf"planned from this node's cached copy of the index derived from {SHARDS} shards"):
        fastload.ArrowDataset(bare_url, storage_options=s3_server.options, cache_dir=node)
    assert s3_server.requests() == []
    indexed = fastload.ArrowDataset(indexed_url, fields=["ids", "label"], storage_options=s3_server.options, cache_dir=tmp_path / "i")
    for rank in range(2):
        sampler = fastload.LengthGroupedBatchSampler(indexed.lengths, max_tokens=1024, num_replicas=2, rank=rank, seed=3)
        assert same_batches(runs[rank], [owned(b) for b in fastload.DataLoader(indexed, batch_sampler=sampler)])


def test_folders_that_cannot_be_planned_are_refused_naming_the_url(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    options = {"storage_options": s3_server.options, "cache_dir": tmp_path}
    with pytest.raises(DataFileNotFoundError, match=rf"s3://{bucket}/empty/: holds no {INDEX_NAME} and no object"):
        fastload.ArrowDataset(f"s3://{bucket}/empty/", **options)
    sink = pa.BufferOutputStream()
    pq.write_table(table(0), sink)
    s3_server.put(f"{bucket}/mixed/a.h5", b"\x89HDF\r\n\x1a\n")
    s3_server.put(f"{bucket}/mixed/b.parquet", sink.getvalue().to_pybytes())
    with pytest.raises(DataFileNotFoundError, match=r"mixed/: holds both HDF5 \(a\.h5\) and Arrow/Parquet \(b\.parquet\)"):
        fastload.ArrowDataset(f"s3://{bucket}/mixed/", **options)
    stream = pa.BufferOutputStream()
    with pa.ipc.new_stream(stream, table(0).schema) as out:
        out.write_table(table(0))
    s3_server.put(f"{bucket}/stream/data-0.arrow", stream.getvalue().to_pybytes())
    with pytest.raises(DataFormatError, match=rf"stream/data-0\.arrow: ends with neither .* `fastload index s3://{bucket}/stream/`"):
        fastload.ArrowDataset(f"s3://{bucket}/stream/", **options)
    s3_server.put(f"{bucket}/h5/a.h5", b"\x89HDF\r\n\x1a\n")
    with pytest.raises(DataFormatError, match=r"h5/a\.h5: cannot be read as HDF5; it is truncated or damaged"):
        fastload.HDF5Dataset(f"s3://{bucket}/h5/", **options)
    with h5py.File(tmp_path / "vlen.h5", "w") as f:
        f.create_dataset("ids", data=[np.arange(3), np.arange(5)], dtype=h5py.vlen_dtype(np.int64))
    s3_server.put(f"{bucket}/vlen/a.h5", (tmp_path / "vlen.h5").read_bytes())
    with pytest.raises(DataFileNotFoundError, match=rf"vlen/a\.h5: ragged field 'ids' is a variable-length dataset.* `fastload index s3://{bucket}/vlen/`"):
        fastload.HDF5Dataset(f"s3://{bucket}/vlen/", **options)


def test_an_http_folder_without_index_names_fastload_index(http_server: Any, tmp_path: Path) -> None:
    (http_server.root / "bare").mkdir()
    with pytest.raises(DataFileNotFoundError, match=r"bare/fastload-index\.json: no index beside the shards; write one with `fastload index`.* cannot be listed"):
        fastload.HDF5Dataset(f"{http_server.endpoint}/bare/", cache_dir=tmp_path)


def test_an_ipc_layout_left_to_pyarrow_plans_the_same_lengths(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    """A struct with null rows around the ragged field: its offsets are not trusted, so pyarrow
    reads the field (values too); lengths as the local reader's, a null row as empty."""
    folder = tmp_path / "nested"
    folder.mkdir()
    rows = pa.array([{"ids": [1, 2]}, None, {"ids": [3]}, {"ids": []}] * 50, pa.struct([("ids", pa.list_(pa.int64()))]))
    data = pa.table({"s": rows, "label": np.arange(200)})
    with pa.OSFile(str(folder / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, data.schema) as out:
        out.write_table(data)
    url = s3_server.upload(folder, bucket, "nested", leave_out=INDEX_NAME)
    with pytest.warns(UserWarning, match=r"not found: listed 1 shards"):
        bare = fastload.ArrowDataset(url, null_fill=0, storage_options=s3_server.options, cache_dir=tmp_path / "c")
    local = fastload.ArrowDataset(folder / "a.arrow", null_fill=0, cache_dir=False)
    assert bare.length_field == "s/ids" and np.array_equal(bare.lengths, local.lengths)
    assert bare.read_batch([0, 1])["s/ids"].lengths.tolist() == [2, 0]


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_ranges_reader_opens_the_object_once(s3_server: Any, bucket: str, http_server: Any, kind: str) -> None:
    data = bytes(range(256)) * 40
    if kind == "s3":
        s3_server.put(f"{bucket}/x.bin", data)
        store, server = open_store(f"s3://{bucket}", s3_server.options), s3_server
    else:
        (http_server.root / "x.bin").write_bytes(data)
        store, server = open_store(f"{http_server.endpoint}/"), http_server
    server.proxy.reset()
    with store.ranges("x.bin") as read_at:
        assert read_at(1000, 10) == data[1000:1010] and read_at(10230, 10) == data[10230:]
        if kind == "s3":
            with pytest.raises(ValueError, match="outside the object's 10240 bytes"):
                read_at(10230, 11)
    log = server.requests()
    assert [r.range for r in log if r.method == "GET"] == ["bytes=1000-1009", "bytes=10230-10239"]
    assert [r.method for r in log].count("HEAD") == (1 if kind == "s3" else 0)


def test_hdf5_shards_planned_from_their_metadata_and_offsets(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    folder = tmp_path / "h5"
    folder.mkdir()
    for shard in range(2):
        write_token_file(folder / f"part-{shard}.h5", 300, 4000, seed=shard, label=True)
    write_index(folder, build_index(folder))
    indexed = fastload.HDF5Dataset(s3_server.upload(folder, bucket, "indexed"), storage_options=s3_server.options, cache_dir=tmp_path / "a")
    bare_url = s3_server.upload(folder, bucket, "bare", leave_out=INDEX_NAME)
    total = sum(p.stat().st_size for p in folder.glob("*.h5"))
    s3_server.proxy.reset()
    with pytest.warns(UserWarning, match=r"not found: listed 2 shards"):
        bare = fastload.HDF5Dataset(bare_url, storage_options=s3_server.options, cache_dir=tmp_path / "b")
    fetched, _ = shard_bytes_fetched(s3_server, folder, bare_url)
    gets = [r for r in s3_server.requests() if r.method == "GET" and "/bare" in r.path]
    from_start = {(r.path, r.range) for r in gets if r.path.endswith(".h5") and (r.range or "bytes=0-").startswith("bytes=0-")}
    # From byte 0 each shard gives the superblock's block, not the whole shard. (A read retried
    # after a reply dropped on a loaded host asks for the same range again: still one read.)
    assert len(from_start) == 2 and all(rng is not None for _, rng in from_start), from_start
    assert len({(r.path, r.range) for r in gets}) <= 1 + 2 * 3, gets
    assert fetched < total / 3, (fetched, total)  # metadata and offsets, not the token values
    assert (len(bare), bare.fields, bare.length_field) == (len(indexed), indexed.fields, "tokens")
    assert np.array_equal(bare.lengths, indexed.lengths)
    got, expected = bare.read_batch([0, 299, 301]), indexed.read_batch([0, 299, 301])
    assert np.array_equal(got["tokens"].values, expected["tokens"].values) and np.array_equal(got["label"], expected["label"])


def test_planning_under_injected_faults_gives_the_same_index(faulty_s3: Any, bucket: str, shards: Path, tmp_path: Path) -> None:
    url = faulty_s3.upload(shards, bucket, "bare", leave_out=INDEX_NAME)
    with pytest.warns(UserWarning, match=r"not found: listed"):
        clean = fastload.ArrowDataset(url, storage_options=faulty_s3.options, cache_dir=tmp_path / "a")
    faulty_s3.set_faults(Faults(error_rate=0.1, drop_rate=0.1, seed=7))
    faulty = fastload.ArrowDataset(url, storage_options=faulty_s3.options, cache_dir=tmp_path / "b")  # warned once already
    assert any(r.fault for r in faulty_s3.requests())
    assert faulty.fields == clean.fields and np.array_equal(faulty.lengths, clean.lengths)
    assert faulty._shards.source.index.shards == clean._shards.source.index.shards
