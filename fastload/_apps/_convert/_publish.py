"""``fastload convert -o s3://bucket/corpus/``: convert into a local temporary folder, then upload
the shards, and the index last.

Invariant: at any instant, killed by any signal, the URL holds no index that names a shard not
uploaded whole. S3 and GCS publish an object only once its upload completes, and the index is
uploaded only after every shard's upload returned; with ``--overwrite``, an earlier index is
deleted before the first shard is replaced (it would name shards whose bytes are changing) and
shards of an earlier, larger run are deleted only after the new index is in place. A run killed
half-way leaves shards without an index: a dataset refuses the folder or lists it, and the next
run with ``--overwrite`` replaces them.
"""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from fastload._apps._convert._convert import ConvertReport, convert, human_bytes
from fastload._apps._convert._convert_options import ConvertOptions
from fastload._formats._indexing import index_of, write_index
from fastload._remote import INDEX_NAME, Store, StoreStats, open_store
from fastload.errors import UsageError

#: Shards uploaded at once: enough to hide one request's latency behind others, few enough
#: that a failure stops the run after little wasted work.
UPLOAD_CONCURRENCY = 4

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` pairs as ``open_store``'s options: a value that looks
    like an integer, a decimal number or ``true``/``false`` becomes one; others stay strings."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not (sep and key.strip()):
            raise UsageError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        options[key.strip()] = _value(text)
    return options


def open_folder(url: str, storage_options: Mapping[str, Any]) -> Store:
    """The store of the folder ``url``; a bad URL or option is a :class:`UsageError`, which the
    commands print as one line."""
    try:
        return open_store(f"{url.rstrip('/')}/", storage_options)
    except ValueError as exc:
        raise UsageError(f"--storage-option: {exc}" if "storage_options" in str(exc) else str(exc)) from exc


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if _NUMBER.fullmatch(text):
        return float(text)
    return text


@dataclass(frozen=True)
class RemoteTarget:
    """Where ``-o URL`` puts its files: the folder's URL (ending in ``/``) and the file name the
    converter writes, its shards being ``STEM-00000.h5``..."""

    folder: str
    name: str

    @classmethod
    def parse(cls, url: str) -> RemoteTarget:
        """``s3://b/corpus/`` (a folder: files named after it, ``corpus-00000.h5``...) or
        ``s3://b/corpus/data.h5`` (a file name ending in ``.h5``: ``data-00000.h5``... in
        ``s3://b/corpus/``)."""
        parts = urllib.parse.urlsplit(url)
        if parts.query or parts.fragment:
            raise UsageError(f"-o {url}: an output URL takes no query or fragment")
        path = PurePosixPath(parts.path or "/")
        if not url.endswith("/") and path.suffix in (".h5", ".hdf5"):
            folder = f"{parts.scheme}://{parts.netloc}{str(path.parent).rstrip('/')}/"
            return cls(folder, path.name)
        stem = path.name or parts.netloc
        return cls(f"{url.rstrip('/')}/", f"{stem}.h5")


@dataclass
class UploadReport:
    """What an upload did: the objects written, in order (the index last), objects deleted,
    bytes uploaded, and the store's counters."""

    url: str
    uploaded: list[str]
    deleted: list[str]
    bytes: int
    seconds: float
    stats: StoreStats

    def summary(self) -> str:
        return (
            f"uploaded {len(self.uploaded)} objects ({human_bytes(self.bytes)}) to {self.url} in "
            f"{self.seconds:.2f} s, the index last: {self.stats.requests} requests, "
            f"{self.stats.retries} retries"
        )


def _existing(listing: Sequence[str], target: RemoteTarget, *, sharded: bool) -> list[str]:
    stem, suffix = PurePosixPath(target.name).stem, PurePosixPath(target.name).suffix
    shard = re.compile(rf"{re.escape(stem)}-(\d{{5,}}){re.escape(suffix)}")
    mine = [n for n in listing if (shard.fullmatch(n) if sharded else n == target.name)]
    vocab = f"{stem}.vocab.txt"
    return mine + [n for n in (vocab, INDEX_NAME) if n in listing]


def convert_to_store(
    options: ConvertOptions,
    url: str,
    storage_options: Mapping[str, Any],
    *,
    echo: Callable[[str], None],
) -> tuple[ConvertReport, UploadReport]:
    """Convert ``options.inputs`` (``options.output`` is ignored) into the folder ``url`` names;
    see the module text. The conversion report's ``outputs`` are local paths that no longer
    exist once this returns; the upload report names the objects. Fails before converting if the folder cannot be listed, or holds this
    output's files or an index and ``options.overwrite`` is False."""
    target = RemoteTarget.parse(url)
    store = open_folder(target.folder, storage_options)
    listing = [info.name for info in store.list()]  # one request: existence, overwrite and clean-up
    existing = _existing(listing, target, sharded=options.shard_size is not None)
    if existing and not options.overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise FileExistsError(f"{store.join(existing[0])} exists{more}; pass --overwrite to replace it")
    scratch = Path(tempfile.mkdtemp(prefix="fastload-convert-"))
    try:
        local = replace(options, output=scratch / target.name, overwrite=False)
        report = convert(local)
        files = [*([report.vocab_file] if report.vocab_file else []), *report.outputs]
        index = report.index_file
        if index is None:  # a single file: the converter writes no index for it
            index = write_index(scratch, index_of(scratch, "hdf5", list(report.outputs)))
        uploaded = _upload(store, files, index, delete_index_first=INDEX_NAME in existing, echo=echo)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    deleted = [name for name in existing if name not in uploaded.uploaded]
    for name in deleted:  # shards of an earlier, larger run: unreferenced now the index is in
        store.delete(name)
        echo(f"deleted {store.join(name)} (left by an earlier run)")
    uploaded.deleted = deleted
    uploaded.stats = store.stats()
    # The local files are gone; the upload report names what replaced them.
    return replace(report, vocab_file=None, index_file=None), uploaded


def _upload(
    store: Store,
    files: Sequence[Path],
    index: Path,
    *,
    delete_index_first: bool,
    echo: Callable[[str], None],
) -> UploadReport:
    started = time.monotonic()
    if delete_index_first:
        store.delete(INDEX_NAME)
        echo(f"deleted {store.join(INDEX_NAME)} before replacing the shards it names")
    done: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(UPLOAD_CONCURRENCY, thread_name_prefix="fastload-upload") as pool:
        pending = {pool.submit(store.upload, path.name, str(path)): path for path in files}
        try:
            for future in concurrent.futures.as_completed(pending):
                future.result()  # the first failure stops the run before the index goes up
                path = pending[future]
                done.append(path.name)
                echo(f"uploaded {store.join(path.name)} ({human_bytes(path.stat().st_size)}) [{len(done)}/{len(files)}]")
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    store.write(INDEX_NAME, index.read_bytes())  # one PUT below 10 MiB (about 8 M samples)
    echo(f"uploaded {store.join(INDEX_NAME)} (the index, last)")
    total = sum(p.stat().st_size for p in files) + index.stat().st_size
    return UploadReport(store.url, [*done, INDEX_NAME], [], total, time.monotonic() - started, store.stats())


def stderr_echo(quiet: bool) -> Callable[[str], None]:
    """Progress lines to stderr, or nowhere with ``--quiet``."""
    if quiet:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)
