"""``fastload convert -o s3://...`` and ``fastload index s3://...`` against the real moto server
behind the logging fault proxy: the uploaded dataset reads back as the local conversion does,
the index is the last object written, a failed upload publishes no index, and errors name the
URL."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
from _servers import Faults

import fastload
from fastload._remote import INDEX_NAME
from fastload.cli import main

SHARD_SIZE = 64
ROWS = [{"text": f"row {i} " + "x" * (i * 7 % 23), "label": i % 5} for i in range(300)]
SHARDS = [f"corpus-{i:05d}.h5" for i in range(-(-len(ROWS) // SHARD_SIZE))]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("input") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def local(rows_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same input converted to local disk: the folder of shards and index to compare with."""
    folder = tmp_path_factory.mktemp("local")
    args = [str(rows_file), "-o", str(folder / "corpus.h5"), "--label-field", "label", "--quiet"]
    assert main(["convert", *args, "--shard-size", str(SHARD_SIZE)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [*SHARDS, INDEX_NAME]
    return folder


def convert_to(rows_file: Path, url: str, server: Any, *more: str) -> int:
    endpoint = f"endpoint_override={server.endpoint}"  # the environment names no endpoint
    args = [str(rows_file), "-o", url, "--label-field", "label", "--storage-option", endpoint]
    return main(["convert", *args, "--shard-size", str(SHARD_SIZE), *more])


def objects(server: Any, folder: str) -> dict[str, bytes]:
    """Every object under ``folder`` (``bucket/prefix``), read straight from the server."""
    fs = server.filesystem()
    found = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    return {
        f.path[len(folder) + 1 :]: fs.open_input_file(f.path).readall()
        for f in found
        if f.type == pafs.FileType.File
    }


def puts(server: Any) -> list[str]:
    """Names of the objects PUT successfully, in the order the server answered."""
    return [r.path.rsplit("/", 1)[-1] for r in server.requests() if r.method == "PUT" and r.status == 200]


def assert_same_samples(remote: fastload.HDF5Dataset, local: Path) -> None:
    expected = fastload.HDF5Dataset(sorted(local.glob("*.h5")))
    assert len(remote) == len(expected) == len(ROWS)
    assert remote.fields == expected.fields and np.array_equal(remote.lengths, expected.lengths)
    every = np.arange(len(ROWS))
    got, want = remote.read_batch(every), expected.read_batch(every)
    assert np.array_equal(got["input_ids"].values, want["input_ids"].values)
    assert np.array_equal(got["input_ids"].lengths, want["input_ids"].lengths)
    assert got["label"].tolist() == [r["label"] for r in ROWS]


def test_convert_to_s3_uploads_the_local_conversion_and_the_index_last(
    s3_server: Any, bucket: str, rows_file: Path, local: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{bucket}/corpus/"
    assert convert_to(rows_file, url, s3_server) == 0
    stored = objects(s3_server, f"{bucket}/corpus")
    # The same bytes as the local conversion, index included (its paths are relative).
    assert stored == {p.name: p.read_bytes() for p in local.iterdir()}
    log = s3_server.requests()
    # One listing (is there an output already?), one PUT per shard, then the index's PUT.
    assert [r.method for r in log] == ["GET"] + ["PUT"] * (len(SHARDS) + 1)
    assert sorted(puts(s3_server)[:-1]) == SHARDS and puts(s3_server)[-1] == INDEX_NAME
    err = capsys.readouterr().err.splitlines()
    assert sorted(line.split()[1] for line in err[:-1]) == [url + name for name in SHARDS]
    assert err[-1] == f"uploaded {url}{INDEX_NAME} (the index, last)"
    remote = fastload.HDF5Dataset(url, storage_options=s3_server.options, cache_dir=tmp_path / "cache")
    assert_same_samples(remote, local)


def test_an_existing_output_needs_overwrite_which_drops_the_old_index_first(
    s3_server: Any, bucket: str, rows_file: Path, local: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{bucket}/corpus/"
    assert convert_to(rows_file, url, s3_server, "--quiet", "--shard-size", "32") == 0
    assert len(objects(s3_server, f"{bucket}/corpus")) == 10 + 1
    s3_server.proxy.reset()
    assert convert_to(rows_file, url, s3_server, "--quiet") == 2
    assert f"{url}corpus-00000.h5 exists (and 10 more); pass --overwrite" in capsys.readouterr().err
    assert [r.method for r in s3_server.requests()] == ["GET"]  # refused after the listing alone
    s3_server.proxy.reset()
    assert convert_to(rows_file, url, s3_server, "--quiet", "--overwrite") == 0
    # Not the PUTs of "corpus/": pyarrow's empty folder marker after each DELETE.
    log = [
        (r.method, r.path.rsplit("/", 1)[-1])
        for r in s3_server.requests()
        if r.method in ("PUT", "DELETE") and not r.path.endswith("/")
    ]
    # The old index goes before any shard it names is replaced; the new one after them all;
    # the shards only the old run wrote go last, once no index names them.
    assert log[0] == ("DELETE", INDEX_NAME)
    assert [name for method, name in log[1:] if method == "PUT"][-1] == INDEX_NAME
    deleted = [name for method, name in log[1:] if method == "DELETE"]
    assert deleted == [f"corpus-{i:05d}.h5" for i in range(len(SHARDS), 10)]
    assert log.index(("PUT", INDEX_NAME)) < log.index(("DELETE", deleted[0]))
    assert objects(s3_server, f"{bucket}/corpus") == {p.name: p.read_bytes() for p in local.iterdir()}


def test_a_failure_mid_upload_publishes_no_index_and_leaves_no_local_copy(
    faulty_s3: Any, bucket: str, rows_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the local copy goes
    # 403 AccessDenied is permanent: the first one ends the run. Seed 0 lets the listing and
    # two shard PUTs through, then refuses the third shard PUT.
    faulty_s3.set_faults(Faults(error_rate=0.3, error_statuses=(403,), seed=0))
    url = f"s3://{bucket}/corpus/"
    assert convert_to(rows_file, url, faulty_s3, "--quiet") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastload convert: error: {url}corpus-0000") and "access refused" in err
    refused = [r for r in faulty_s3.requests() if r.fault]
    assert refused and refused[0].method == "PUT"
    assert puts(faulty_s3), "no shard went up before the failure: not a failure mid-upload"
    stored = objects(faulty_s3, f"{bucket}/corpus")
    assert INDEX_NAME not in stored and set(stored) < set(SHARDS)
    assert list(tmp_path.iterdir()) == []


def test_index_of_shards_uploaded_without_one_equals_the_local_index(
    s3_server: Any, bucket: str, local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in SHARDS:
        s3_server.put(f"{bucket}/other-tool/{name}", (local / name).read_bytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)  # the standard variable, no option
    url = f"s3://{bucket}/other-tool"
    assert main(["index", url]) == 0
    out, err = capsys.readouterr()
    assert (
        out.strip() == f"{url}/{INDEX_NAME}: {len(SHARDS)} hdf5 shards, {len(ROWS)} samples, "
        f"{sum((local / n).stat().st_size for n in SHARDS):,} bytes, {2 + 2 * len(SHARDS)} requests"
    )
    assert len(err.splitlines()) == len(SHARDS) and err.startswith(f"read {url}/{SHARDS[0]}: 64 samples")
    assert objects(s3_server, f"{bucket}/other-tool")[INDEX_NAME] == (local / INDEX_NAME).read_bytes()
    log = s3_server.requests()
    # One listing; per shard the HEAD of its open and one GET (each smaller than a part); one PUT.
    assert [r.method for r in log] == ["GET"] + ["HEAD", "GET"] * len(SHARDS) + ["PUT"]
    assert [r.path.rsplit("/", 1)[-1] for r in log[1:-1:2]] == SHARDS
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    remote = fastload.HDF5Dataset(url + "/", storage_options=s3_server.options, cache_dir=tmp_path)
    assert_same_samples(remote, local)


def test_errors_name_the_url(
    s3_server: Any, bucket: str, rows_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    option = ["--storage-option", f"endpoint_override={s3_server.endpoint}"]
    assert main(["index", f"s3://{bucket}/nothing/", *option]) == 2
    assert f"s3://{bucket}/nothing/: holds no object, so not an HDF5" in capsys.readouterr().err
    s3_server.put(f"{bucket}/notes/readme.txt", b"not a shard")
    assert main(["index", f"s3://{bucket}/notes/", *option]) == 2
    assert f"s3://{bucket}/notes/: holds 1 objects, none of them an HDF5" in capsys.readouterr().err
    missing = f"s3://{bucket}-missing/corpus/"
    assert convert_to(rows_file, missing, s3_server) == 2
    assert f"error: {missing}: not found" in capsys.readouterr().err
    assert main(["index", missing, "--storage-option", "endpoint_overide=x"]) == 2
    assert "'endpoint_overide' is not an option for" in capsys.readouterr().err
    assert main(["index", f"s3://{bucket}/notes/", "--storage-option", "nonsense"]) == 2
    assert "--storage-option expects KEY=VALUE, got 'nonsense'" in capsys.readouterr().err
    assert main(["convert", str(rows_file), "-o", "x.h5", "--storage-option", "region=x"]) == 2
    assert "--storage-option applies to an s3:// or gs:// output, not x.h5" in capsys.readouterr().err
