"""The storage client layer against a real S3-compatible server (moto, on 127.0.0.1) and a
real HTTP file server, each behind a proxy that logs every request and injects faults."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from _servers import Faults, download
from conftest import HttpServer, S3Server

from fastload._remote import ObjectInfo, RetryPolicy, is_remote, open_store
from fastload._remote._store import GCS_ALIASES, S3_ALIASES, pyarrow_options
from fastload.errors import StorageError, StorageNotFoundError, StoragePermissionError

MB = 1_000_000
# Short waits, so faulty tests stay quick; still far more than enough attempts.
QUICK = RetryPolicy(total_s=30.0, base_s=0.005, cap_s=0.05)


def _payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


# -- URLs and options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "remote"),
    [("s3://b/k", True), ("gs://b/k", True), ("gcs://b", True), ("https://h/x", True), ("HTTP://h", True),
     ("/data/x.h5", False), ("file:///x", False), ("data/s3://x", False), ("C:/x", False)],
)  # fmt: skip
def test_is_remote_tells_urls_from_local_paths(path: str, remote: bool) -> None:
    assert is_remote(path) is remote


def test_an_unknown_option_names_itself_the_likely_one_and_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'endpoint_overide'.*did you mean 'endpoint_override'.*valid options: access_key"):
        open_store("s3://bucket/x", {"endpoint_overide": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match=r"'aws_access_key_id' is not an option for gs://bucket/x; valid options: access_token"):
        open_store("gs://bucket/x", {"aws_access_key_id": "x"})
    with pytest.raises(ValueError, match=r"'timeout'.*headers, timeout_s"):
        open_store("https://example.invalid/x", {"timeout": 3})
    with pytest.raises(ValueError, match=r"/local/path: not a URL; open_store reads s3://"):
        open_store("/local/path")


def test_a_gcs_url_opens_a_gcs_store_without_network() -> None:
    store = open_store("gs://bucket/corpus", {"anonymous": True})
    assert store.url == "gs://bucket/corpus" and store.join("a/b.h5") == "gs://bucket/corpus/a/b.h5"
    with pytest.raises(ValueError, match="'region'"):
        open_store("gs://bucket/corpus", {"region": "us"})


def test_retry_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="total_s"):
        RetryPolicy(total_s=0)
    with pytest.raises(ValueError, match="cannot exceed the cap"):
        RetryPolicy(base_s=2.0, cap_s=1.0)


# -- S3: what works ------------------------------------------------------------------------------


def test_list_is_one_request_recursive_sorted_and_relative(s3_server: S3Server, bucket: str) -> None:
    for key, size in [("corpus/b.bin", 5), ("corpus/a.bin", 3), ("corpus/sub/c.bin", 7), ("other/d.bin", 1)]:
        s3_server.put(f"{bucket}/{key}", b"x" * size)
    store = open_store(f"s3://{bucket}/corpus", s3_server.options)
    listed = store.list()
    assert [(o.name, o.size) for o in listed] == [("a.bin", 3), ("b.bin", 5), ("sub/c.bin", 7)]
    assert all(o.version for o in listed)
    assert [(r.method, "list-type=2" in r.query) for r in s3_server.requests()] == [("GET", True)]
    assert store.stats().requests == 1
    assert open_store(f"s3://{bucket}/nothing-here", s3_server.options).list() == []


def test_info_and_read_of_an_object(s3_server: S3Server, bucket: str) -> None:
    data = _payload(3000)
    s3_server.put(f"{bucket}/corpus/x.bin", data)
    store = open_store(f"s3://{bucket}/corpus/", s3_server.options)
    info = store.info("x.bin")
    assert info.name == "x.bin" and info.size == 3000 and info.version
    assert store.read("x.bin") == data
    assert store.join("x.bin") == f"s3://{bucket}/corpus/x.bin"
    single = open_store(f"s3://{bucket}/corpus/x.bin", s3_server.options)
    assert single.info("") == ObjectInfo("", 3000, info.version)
    # info: HEAD; read: HEAD + one GET of the whole object (not pyarrow's 256 KiB stream reads)
    assert [r.method for r in s3_server.requests()] == ["HEAD", "HEAD", "GET", "HEAD"]
    assert store.stats().requests == 3 and store.stats().bytes == 3000


def test_read_range_is_one_ranged_get_of_exact_bytes(s3_server: S3Server, bucket: str) -> None:
    data = _payload(10_000)
    s3_server.put(f"{bucket}/x.bin", data)
    store = open_store(f"s3://{bucket}", s3_server.options)
    assert store.read_range("x.bin", 1234, 100) == data[1234:1334]
    assert store.read_range("x.bin", 9990, 10) == data[9990:]
    gets = [r.range for r in s3_server.requests() if r.method == "GET"]
    assert gets == ["bytes=1234-1333", "bytes=9990-9999"]
    with pytest.raises(ValueError, match="outside the object's 10000 bytes"):
        store.read_range("x.bin", 9990, 11)


def test_download_of_20mb_in_8mb_parts_is_three_range_gets(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    data = _payload(20 * MB)
    s3_server.put(f"{bucket}/big.bin", data)
    store = open_store(f"s3://{bucket}", s3_server.options)
    seen: list[int] = []
    got = download(store, "big.bin", tmp_path / "big", 20 * MB, part_bytes=8 << 20, on_bytes=seen.append)
    assert got == data
    log = s3_server.requests()
    assert sorted(r.range for r in log if r.method == "GET") == [
        "bytes=0-8388607", "bytes=16777216-19999999", "bytes=8388608-16777215"
    ]  # fmt: skip
    assert [r.method for r in log].count("HEAD") == 1 and len(log) == 4
    assert sorted(seen) == [20 * MB - 2 * (8 << 20), 8 << 20, 8 << 20]
    assert store.stats() == (4, 20 * MB, 0)


def test_download_resumes_from_an_offset_and_fetches_only_the_rest(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    data = _payload(3 * MB, seed=1)
    s3_server.put(f"{bucket}/x.bin", data)
    partial = tmp_path / "x.part"
    partial.write_bytes(data[: 2 * MB])  # what an interrupted download left
    store = open_store(f"s3://{bucket}", s3_server.options)
    assert download(store, "x.bin", partial, 3 * MB, start=2 * MB, part_bytes=400_000, parallel=3) == data
    ranges = sorted(r.range for r in s3_server.requests() if r.method == "GET")
    assert ranges == ["bytes=2000000-2399999", "bytes=2400000-2799999", "bytes=2800000-2999999"]
    assert store.stats().bytes == 1 * MB


def test_download_refuses_an_object_whose_size_changed(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    s3_server.put(f"{bucket}/x.bin", b"x" * 100)
    store = open_store(f"s3://{bucket}", s3_server.options)
    with pytest.raises(StorageError, match="holds 100 bytes, not the 101 expected"):
        download(store, "x.bin", tmp_path / "x", 101)


def test_write_is_one_put_and_upload_round_trips(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    store = open_store(f"s3://{bucket}/corpus", s3_server.options)
    store.write("index.json", b'{"shards": []}')
    assert [(r.method, r.path) for r in s3_server.requests()] == [("PUT", f"/{bucket}/corpus/index.json")]
    local = tmp_path / "shard.bin"
    local.write_bytes(_payload(2 * MB))
    store.upload("shards/0.bin", str(local))
    assert store.read("index.json") == b'{"shards": []}'
    assert store.read("shards/0.bin") == local.read_bytes()
    assert store.stats().requests == len(s3_server.requests())


def test_delete_removes_one_object_and_counts_what_pyarrow_sends(s3_server: S3Server, bucket: str) -> None:
    s3_server.put(f"{bucket}/corpus/a.bin", b"a")
    s3_server.put(f"{bucket}/corpus/b.bin", b"b")
    store = open_store(f"s3://{bucket}/corpus", s3_server.options)
    store.delete("a.bin")
    assert [i.name for i in store.list()] == ["b.bin"]  # pyarrow's folder marker is no object
    log = s3_server.requests()
    assert [(r.method, r.path) for r in log[:3]] == [
        ("HEAD", f"/{bucket}/corpus/a.bin"), ("DELETE", f"/{bucket}/corpus/a.bin"), ("PUT", f"/{bucket}/corpus/"),
    ]  # fmt: skip
    assert store.stats().requests == len(log)
    with pytest.raises(StorageNotFoundError, match=rf"s3://{bucket}/corpus/a.bin"):
        store.delete("a.bin")


def test_aws_endpoint_url_from_the_environment_is_honoured(s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s3_server.put(f"{bucket}/x.bin", b"abc")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert open_store(f"s3://{bucket}").read("x.bin") == b"abc"
    assert len(s3_server.requests()) == 2


@pytest.mark.parametrize(
    "aliases",
    [
        {"endpoint_url": "ENDPOINT", "key": "KEY", "secret": "SECRET", "region_name": "us-east-1"},
        {"endpoint_url": "ENDPOINT", "aws_access_key_id": "KEY", "aws_secret_access_key": "SECRET", "token": None},
        {"client_kwargs": {"endpoint_url": "ENDPOINT", "region_name": "us-east-1", "aws_access_key_id": "KEY"},
         "secret_key": "SECRET"},
    ],
)  # fmt: skip
def test_boto3_and_s3fs_option_names_reach_the_store(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch, aliases: dict[str, object]
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # the keys must come from the aliases
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    values = {"ENDPOINT": s3_server.endpoint, "KEY": s3_server.credentials.access_key, "SECRET": s3_server.credentials.secret_key}

    def fill(options: dict[str, object]) -> dict[str, object]:
        return {k: fill(v) if isinstance(v, dict) else values.get(v, v) for k, v in options.items()}  # type: ignore[arg-type]

    options = {k: v for k, v in fill(aliases).items() if v is not None}
    s3_server.put(f"{bucket}/x.bin", b"abc")
    assert open_store(f"s3://{bucket}", options).read("x.bin") == b"abc"
    assert [r.method for r in s3_server.requests()] == ["HEAD", "GET"]  # through the endpoint given
    with pytest.raises(StoragePermissionError):
        open_store(f"s3://{bucket}", {**options, **({"secret": "wrong"} if "secret" in options else {"aws_secret_access_key": "wrong", "secret_key": "wrong"})}, retry=QUICK).read("x.bin")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"endpoint_override": "http://127.0.0.1:1", "endpoint_url": "http://127.0.0.1:2"}, ("endpoint_override=", "endpoint_url=")),
        ({"key": "a", "aws_access_key_id": "b"}, ("key='a'", "aws_access_key_id='b'")),
        ({"secret_key": "a", "client_kwargs": {"aws_secret_access_key": "b"}}, ("secret_key='a'", "client_kwargs['aws_secret_access_key']='b'")),
        ({"scheme": "https", "endpoint_url": "http://127.0.0.1:1"}, ("scheme='https'", "the scheme of endpoint_url='http'")),
    ],
)  # fmt: skip
def test_two_spellings_of_one_option_with_different_values_are_refused(options: dict[str, object], named: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="set the same option") as caught:
        open_store("s3://bucket/x", options)
    assert all(n in str(caught.value) for n in named)


def test_two_spellings_with_one_value_and_unknown_client_kwargs() -> None:
    open_store("s3://bucket/x", {"endpoint_override": "http://127.0.0.1:1", "endpoint_url": "http://127.0.0.1:1/", "key": "a", "access_key": "a", "secret": "b"})
    assert pyarrow_options("s3://b", {"use_ssl": False, "endpoint_url": "127.0.0.1:9", "anon": True}, S3_ALIASES) == {
        "scheme": "http", "endpoint_override": "127.0.0.1:9", "anonymous": True
    }
    gcs = {"endpoint_url": "http://127.0.0.1:9", "project": "p", "anonymous": True}  # gcsfs's names
    assert pyarrow_options("gs://b", gcs, GCS_ALIASES) == {"endpoint_override": "127.0.0.1:9", "scheme": "http", "project_id": "p", "anonymous": True}
    assert open_store("gs://b/x", gcs).url == "gs://b/x"
    with pytest.raises(ValueError, match=r"use_ssl=.https.*the scheme of endpoint_url='http'"):
        pyarrow_options("s3://b", {"use_ssl": True, "endpoint_url": "http://127.0.0.1:9"}, S3_ALIASES)
    with pytest.raises(ValueError, match=r"client_kwargs 'verify' .* has no pyarrow equivalent; client_kwargs may hold endpoint_url"):
        open_store("s3://bucket/x", {"client_kwargs": {"verify": False}})


# -- S3: permanent errors fail at once ----------------------------------------------------------


def _fails_fast(exc_type: type[BaseException], url: str, call, s3_server: S3Server) -> BaseException:  # type: ignore[no-untyped-def]
    began = time.monotonic()
    with pytest.raises(exc_type) as caught:
        call()
    assert time.monotonic() - began < 2.0  # not after the 30 s retry budget
    assert caught.value.filename == url and url in str(caught.value)  # type: ignore[attr-defined]
    assert all(r.fault is None for r in s3_server.requests())
    return caught.value


def test_a_missing_key_raises_not_found_at_once(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    store = open_store(f"s3://{bucket}/corpus", s3_server.options, retry=QUICK)
    url = f"s3://{bucket}/corpus/nope.bin"
    exc = _fails_fast(StorageNotFoundError, url, lambda: store.read("nope.bin"), s3_server)
    assert isinstance(exc, FileNotFoundError)
    _fails_fast(StorageNotFoundError, url, lambda: store.info("nope.bin"), s3_server)
    _fails_fast(StorageNotFoundError, url, lambda: download(store, "nope.bin", tmp_path / "n", 10), s3_server)
    assert store.stats().retries == 0
    # read: HEAD; info: HEAD and a listing (a folder of that name?); download: HEAD
    assert [r.method for r in s3_server.requests()] == ["HEAD", "HEAD", "GET", "HEAD"]


def test_a_missing_bucket_raises_not_found_at_once(s3_server: S3Server) -> None:
    store = open_store("s3://no-such-bucket/corpus", s3_server.options, retry=QUICK)
    exc = _fails_fast(StorageNotFoundError, "s3://no-such-bucket/corpus", store.list, s3_server)
    assert "NO_SUCH_BUCKET" in str(exc)
    _fails_fast(StorageNotFoundError, "s3://no-such-bucket/corpus/i.json", lambda: store.write("i.json", b"{}"), s3_server)
    assert len(s3_server.requests()) == 2


@pytest.mark.parametrize("wrong", ["access_key", "secret_key"])
def test_wrong_credentials_raise_permission_error_at_once(s3_server: S3Server, bucket: str, wrong: str) -> None:
    s3_server.put(f"{bucket}/x.bin", b"abc")
    good = {"access_key": s3_server.credentials.access_key, "secret_key": s3_server.credentials.secret_key}
    options = {**s3_server.options, **good, wrong: "AKIAWRONGWRONGWRONG1"}
    store = open_store(f"s3://{bucket}", options, retry=QUICK)
    exc = _fails_fast(StoragePermissionError, f"s3://{bucket}/x.bin", lambda: store.read("x.bin"), s3_server)
    assert isinstance(exc, PermissionError) and "ACCESS_DENIED" in str(exc)
    exc = _fails_fast(StoragePermissionError, f"s3://{bucket}", store.list, s3_server)
    assert ("INVALID_ACCESS_KEY_ID" if wrong == "access_key" else "SIGNATURE_DOES_NOT_MATCH") in str(exc)
    _fails_fast(StoragePermissionError, f"s3://{bucket}/y", lambda: store.write("y", b"1"), s3_server)
    assert [r.status for r in s3_server.requests()] == [403, 403, 403]


# -- S3: transient errors are retried ------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.05, 0.20])
def test_downloads_survive_injected_errors_and_dropped_connections(faulty_s3: S3Server, bucket: str, tmp_path: Path, rate: float) -> None:
    data = _payload(6 * MB, seed=2)
    faulty_s3.put(f"{bucket}/corpus/x.bin", data)
    faulty_s3.put(f"{bucket}/corpus/y.bin", data[:1000])
    faulty_s3.set_faults(Faults(error_rate=rate, drop_rate=rate, seed=7))
    state = random.getstate()
    store = open_store(f"s3://{bucket}/corpus", faulty_s3.options, retry=QUICK)
    written = [f"w{attempt}" for attempt in range(3)]
    for attempt in range(3):
        assert download(store, "x.bin", tmp_path / f"x{attempt}", 6 * MB, part_bytes=256 << 10, parallel=4) == data
        assert [o.name for o in store.list()] == [*written[:attempt], "x.bin", "y.bin"]
        assert store.info("y.bin").size == 1000
        assert store.read("y.bin") == data[:1000]
        assert store.read_range("x.bin", 77, 5000) == data[77:5077]
        store.write(written[attempt], b"w")
    log = faulty_s3.requests()
    statuses = {r.status for r in log if r.fault == "status"}
    assert statuses == {500, 503, 429}
    assert any(r.fault == "drop" for r in log)
    stats = store.stats()
    # Every fault was retried, but a PUT's reply cut after its "200 OK" line: the object was
    # stored and the client, rightly, took it as done.
    noticed = [r for r in log if r.fault == "status" or (r.fault == "drop" and r.method != "PUT")]
    assert stats.retries == len(noticed) > 0
    assert stats.requests == len(log)
    assert random.getstate() == state  # the jitter never draws from the shared generator


def test_faults_on_every_request_fail_after_the_retry_budget(faulty_s3: S3Server, bucket: str, tmp_path: Path) -> None:
    faulty_s3.put(f"{bucket}/x.bin", b"x" * 1000)
    faulty_s3.set_faults(Faults(error_rate=0.5, drop_rate=0.5))
    store = open_store(f"s3://{bucket}", faulty_s3.options, retry=RetryPolicy(total_s=1.0, base_s=0.02, cap_s=0.1))
    for call in (lambda: store.read("x.bin"), lambda: download(store, "x.bin", tmp_path / "x", 1000, part_bytes=100)):
        began = time.monotonic()
        with pytest.raises(StorageError, match=r"still failing after \d+ attempts.*total_s=1") as caught:
            call()
        assert 0.8 <= time.monotonic() - began < 3.0
        assert type(caught.value) is StorageError and caught.value.filename == f"s3://{bucket}/x.bin"
    assert store.stats().retries > 10


# -- HTTP(S) -------------------------------------------------------------------------------------


def test_http_info_read_range_and_parallel_download(http_server: HttpServer, tmp_path: Path) -> None:
    data = _payload(3 * MB, seed=3)
    (http_server.root / "shards").mkdir()
    (http_server.root / "shards" / "a b.bin").write_bytes(data)
    store = open_store(f"{http_server.endpoint}/shards/")
    info = store.info("a b.bin")
    assert info.size == 3 * MB and info.version.startswith('"')
    assert store.read_range("a b.bin", 10, 20) == data[10:30]
    assert store.read("a b.bin") == data
    assert download(store, "a b.bin", tmp_path / "a", 3 * MB, part_bytes=1 * MB) == data
    log = http_server.requests()
    assert [r.method for r in log] == ["HEAD", "GET", "GET", "GET", "GET", "GET"]
    assert sorted(r.range for r in log[3:]) == ["bytes=0-999999", "bytes=1000000-1999999", "bytes=2000000-2999999"]
    assert log[0].path == "/shards/a%20b.bin" and store.stats().requests == 6


def test_http_errors_and_its_missing_capabilities(http_server: HttpServer) -> None:
    store = open_store(http_server.endpoint, retry=QUICK)
    with pytest.raises(StorageNotFoundError) as caught:
        store.read("missing.bin")
    assert caught.value.filename == f"{http_server.endpoint}/missing.bin"
    assert not store.can_list and not store.can_write
    with pytest.raises(StorageError, match="cannot be listed"):
        store.list()
    with pytest.raises(StorageError, match="read-only"):
        store.write("x", b"")
    with pytest.raises(StorageError, match="read-only"):
        store.delete("x")
    assert len(http_server.requests()) == 1


def test_http_downloads_survive_faults(http_server: HttpServer, tmp_path: Path) -> None:
    data = _payload(2 * MB, seed=4)
    (http_server.root / "x.bin").write_bytes(data)
    http_server.proxy.set_faults(Faults(error_rate=0.2, drop_rate=0.2, seed=3))
    store = open_store(http_server.endpoint, retry=QUICK)
    assert download(store, "x.bin", tmp_path / "x", 2 * MB, part_bytes=100_000) == data
    assert store.read("x.bin") == data
    assert store.info("x.bin").size == 2 * MB
    log = http_server.requests()
    assert store.stats().retries == sum(r.fault is not None for r in log) > 0
