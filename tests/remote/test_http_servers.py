"""HTTP(S) datasets against servers as they are: one that redirects to another origin (which must
never see the user's credentials), and the standard library's ``http.server``, which ignores
``Range`` and answers every GET with the whole file. Both run on 127.0.0.1, in threads; two
ports are two origins."""

from __future__ import annotations

import http.server
import os
import sys
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from _servers import FaultProxy, Faults, _RangeHandler, download

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _token_files import indexed_token_shards

import fastload
from fastload._remote import RetryPolicy, open_store
from fastload._remote import _http as http_store
from fastload.errors import StorageError

SECRETS = {"Authorization": "Bearer s3cret", "Cookie": "session=s3cret", "X-Api-Key": "s3cret"}
QUICK = RetryPolicy(total_s=10.0, base_s=0.005, cap_s=0.05)


class Seen(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]


class _Recording:
    """Records every request, answers a redirect where a prefix says so, else serves a file."""

    seen: list[Seen]
    redirects: dict[str, str]  # a path prefix -> the URL prefix it redirects to

    def _record(self: Any) -> bool:
        self.seen.append(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        for prefix, target in self.redirects.items():
            if self.path.startswith(prefix):
                self.send_response(302)
                self.send_header("Location", target + self.path[len(prefix):])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
        return False

    def do_GET(self) -> None:
        if not self._record():
            super().do_GET()  # type: ignore[misc]

    def do_HEAD(self) -> None:
        if not self._record():
            super().do_HEAD()  # type: ignore[misc]

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Plain(_Recording, http.server.SimpleHTTPRequestHandler):
    """The standard library's file handler: no Range support, every GET answers 200."""


class _Ranged(_Recording, _RangeHandler):
    """The tests' file handler that answers Range with 206."""


class Server:
    """Files under ``root`` on a free loopback port, served by ``http.server`` itself
    (``ranges=False``) or with Range support."""

    def __init__(self, root: Path, redirects: dict[str, str] | None = None, *, ranges: bool = False) -> None:
        self.seen: list[Seen] = []
        attributes = {"seen": self.seen, "redirects": redirects or {}}
        if ranges:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Ranged,), attributes))
            self._server.root = root.resolve()  # type: ignore[attr-defined]
        else:
            handler = type("Handler", (_Plain,), attributes)
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10.0)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Server, Server, Path]]:
    """``origin`` redirects ``/away/...`` to ``elsewhere``'s ``/data/...`` and ``/same/...`` to
    its own ``/data/...``; both serve ``root``."""
    root = tmp_path / "www"
    (root / "data").mkdir(parents=True)
    elsewhere = Server(root, ranges=True)
    origin = Server(root, {"/away/": f"{elsewhere.endpoint}/data/", "/same/": "/data/"}, ranges=True)
    try:
        yield origin, elsewhere, root
    finally:
        origin.close()
        elsewhere.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return indexed_token_shards(tmp_path_factory.mktemp("corpus"), 3, 80, 300, label=True)


def _every_request(store: Any, name: str, data: bytes, tmp_path: Path) -> None:
    assert store.info(name).size == len(data)
    assert store.read(name) == data
    assert store.read_range(name, 5, 10) == data[5:15]
    assert download(store, name, tmp_path / "x", len(data), part_bytes=1000) == data


def _carried_secrets(seen: list[Seen]) -> list[tuple[str, str]]:
    return [(s.path, k) for s in seen for k in SECRETS if k.lower() in s.headers]


def test_credentials_never_reach_another_origin_on_redirect(servers: tuple[Server, Server, Path], tmp_path: Path) -> None:
    origin, elsewhere, root = servers
    data = os.urandom(5000)
    (root / "data" / "x.bin").write_bytes(data)
    store = open_store(f"{origin.endpoint}/away/", {"headers": SECRETS}, retry=QUICK)
    _every_request(store, "x.bin", data, tmp_path)
    assert len(elsewhere.seen) >= 4 and not _carried_secrets(elsewhere.seen)
    assert all(set(SECRETS.values()).isdisjoint(s.headers.values()) for s in elsewhere.seen)
    assert origin.seen and all(s.headers["authorization"] == "Bearer s3cret" for s in origin.seen)


def test_credentials_follow_a_redirect_within_the_origin(servers: tuple[Server, Server, Path], tmp_path: Path) -> None:
    origin, elsewhere, root = servers
    data = os.urandom(3000)
    (root / "data" / "x.bin").write_bytes(data)
    store = open_store(f"{origin.endpoint}/same/", {"headers": SECRETS}, retry=QUICK)
    _every_request(store, "x.bin", data, tmp_path)
    redirected = [s for s in origin.seen if s.path.startswith("/data/")]
    assert len(redirected) >= 4 and not elsewhere.seen
    assert all(s.headers["authorization"] == "Bearer s3cret" and s.headers["x-api-key"] == "s3cret" for s in redirected)


def test_a_dataset_behind_a_redirect_loads_without_leaking_its_token(
    servers: tuple[Server, Server, Path], corpus: Path, tmp_path: Path
) -> None:
    origin, elsewhere, root = servers
    for path in corpus.iterdir():
        (root / "data" / path.name).write_bytes(path.read_bytes())
    remote = fastload.HDF5Dataset(f"{origin.endpoint}/away/", storage_options={"headers": SECRETS}, cache_dir=tmp_path)
    local = fastload.HDF5Dataset(sorted(corpus.glob("*.h5")))
    got = list(fastload.DataLoader(remote, max_tokens=4096, num_workers=1, seed=3))
    expected = list(fastload.DataLoader(local, max_tokens=4096, num_workers=0, seed=3))
    assert len(got) == len(expected) > 0
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, expected, strict=True) for k in b)
    assert {s.path for s in elsewhere.seen} >= {f"/data/part-{i:05d}.h5" for i in range(3)}
    assert not _carried_secrets(elsewhere.seen)


# -- a server that ignores Range ----------------------------------------------------------------


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    root = tmp_path / "www"
    root.mkdir()
    server = Server(root)
    try:
        yield server, root
    finally:
        server.close()


def test_http_server_without_range_support_serves_a_dataset(plain: tuple[Server, Path], corpus: Path, tmp_path: Path) -> None:
    server, root = plain
    (root / "corpus").mkdir()
    for path in corpus.iterdir():
        (root / "corpus" / path.name).write_bytes(path.read_bytes())
    remote = fastload.HDF5Dataset(f"{server.endpoint}/corpus/", cache_dir=tmp_path)
    local = fastload.HDF5Dataset(corpus)
    for workers in (0, 2):
        got = list(fastload.DataLoader(remote, max_tokens=4096, num_workers=workers, seed=1, shuffle=True))
        expected = list(fastload.DataLoader(local, max_tokens=4096, num_workers=0, seed=1, shuffle=True))
        assert len(got) == len(expected) > 0
        assert all(torch.equal(a[k], b[k]) for a, b in zip(got, expected, strict=True) for k in b)
    shard_gets = sorted(s.path for s in server.seen if s.method == "GET" and s.path.endswith(".h5"))
    assert shard_gets == [f"/corpus/part-{i:05d}.h5" for i in range(3)]  # each shard once, whole


def test_ranged_reads_and_downloads_from_a_server_without_range_support(
    plain: tuple[Server, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, root = plain
    data = os.urandom(300_000)
    (root / "x.bin").write_bytes(data)
    store = open_store(server.endpoint, retry=QUICK)
    assert store.read_range("x.bin", 70_000, 100) == data[70_000:70_100]
    with store.ranges("x.bin") as read_at:
        assert read_at(299_990, 10) == data[-10:]
    # a download resumed at an offset: one GET, its first bytes skipped, the rest written
    (tmp_path / "x").write_bytes(data[:123_456])
    assert download(store, "x.bin", tmp_path / "x", len(data), start=123_456, part_bytes=10_000) == data
    assert [s.method for s in server.seen].count("GET") == 3
    monkeypatch.setattr(http_store, "WHOLE_BODY_READ_LIMIT", 100_000)
    with pytest.raises(StorageError, match=r"ignores Range requests .* would download the first 200,010 bytes"):
        store.read_range("x.bin", 200_000, 10)


def test_a_whole_body_cut_short_is_continued_from_the_last_byte_written(plain: tuple[Server, Path], tmp_path: Path) -> None:
    server, root = plain
    data = os.urandom(2_000_000)
    (root / "x.bin").write_bytes(data)
    proxy = FaultProxy(server.endpoint, Faults(drop_rate=0.5, error_rate=0.2, seed=1))
    try:
        store = open_store(proxy.endpoint, retry=QUICK)
        written: list[int] = []
        got = download(store, "x.bin", tmp_path / "x", len(data), on_bytes=written.append)
        log = proxy.requests()
    finally:
        proxy.close()
    assert got == data
    assert sum(r.fault == "drop" for r in log) > 0 and store.stats().retries == sum(r.fault is not None for r in log)
    assert sum(written) == len(data)  # each byte written once: a retry skips what is in the file
