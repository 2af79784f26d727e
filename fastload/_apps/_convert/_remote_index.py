"""``fastload index s3://bucket/corpus/``: the index of shards already on object storage, written
by another tool.

Requests: one listing, one download per shard (a GET, or ranged GETs for a shard over 8 MiB),
one PUT of the index (below 10 MiB). Local disk: one shard at a time, each deleted once read.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from fastload._apps._convert._convert import human_bytes
from fastload._apps._convert._publish import open_folder
from fastload._formats._indexing import SHARD_SUFFIXES, describe_shard, sha256_of, shard_kind
from fastload._remote import (
    INDEX_NAME,
    DatasetIndex,
    ObjectInfo,
    ShardEntry,
    Store,
    fields_equal,
)
from fastload.errors import DataFileNotFoundError, DataFormatError


def shards_of(store: Store, listing: list[ObjectInfo]) -> tuple[str, list[ObjectInfo]]:
    """The format and the shards among ``listing``, sorted as :func:`shard_files` sorts a local
    folder (by path parts), so the same shards uploaded index alike; mixed formats or none are
    refused, naming the URL."""
    found = sorted((i for i in listing if i.name != INDEX_NAME), key=lambda i: PurePosixPath(i.name).parts)
    hdf5 = [i for i in found if shard_kind(i.name) == "hdf5"]
    arrow = [i for i in found if shard_kind(i.name) == "arrow"]
    if hdf5 and arrow:
        raise DataFileNotFoundError(
            f"{store.url}: holds both HDF5 ({hdf5[0].name}) and Arrow/Parquet ({arrow[0].name}) "
            "shards; one index describes shards of one format",
            store.url,
        )
    if not (hdf5 or arrow):
        what = f"{len(found)} objects, none of them" if found else "no object, so not"
        raise DataFileNotFoundError(
            f"{store.url}: holds {what} an HDF5 or Arrow/Parquet shard ({', '.join(SHARD_SUFFIXES)})",
            store.url,
        )
    return ("hdf5", hdf5) if hdf5 else ("arrow", arrow)


def index_store(store: Store, *, echo: Callable[[str], None]) -> DatasetIndex:
    """List ``store`` once, download and read each shard in turn, then write its index with one
    PUT; returns the index. Shards must agree on fields and length field, as one dataset's do."""
    kind, shards = shards_of(store, store.list())
    entries: list[ShardEntry] = []
    lengths: list[np.ndarray] = []
    first: tuple[str, dict[str, Any], str | None] | None = None
    with tempfile.TemporaryDirectory(prefix="fastload-index-") as scratch:
        for number, info in enumerate(shards, 1):
            local = Path(scratch) / PurePosixPath(info.name).name  # the suffix tells the reader the format
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                store.download(info.name, fd, size=info.size)
            finally:
                os.close(fd)
            try:
                fields, length_field, shard_lengths = describe_shard(local, kind)
                digest = sha256_of(local)
            finally:
                local.unlink()
            if first is None:
                first = (info.name, fields, length_field)
            elif not fields_equal(first[1], fields) or first[2] != length_field:
                raise DataFormatError(
                    f"{store.join(info.name)}: its fields {list(fields.values())} (length field "
                    f"{length_field!r}) differ from those of {first[0]}: {list(first[1].values())} "
                    f"(length field {first[2]!r}); one index describes shards of one layout"
                )
            entries.append(ShardEntry(info.name, int(shard_lengths.size), info.size, digest))
            lengths.append(shard_lengths)
            echo(f"read {store.join(info.name)}: {shard_lengths.size:,} samples, {human_bytes(info.size)} [{number}/{len(shards)}]")
    assert first is not None  # shards_of returns at least one shard
    index = DatasetIndex(kind, first[1], first[2], tuple(entries), np.concatenate(lengths))
    index.check(store.join(INDEX_NAME))
    store.write(INDEX_NAME, index.to_json())
    return index


def index_url(url: str, storage_options: Mapping[str, Any], *, echo: Callable[[str], None]) -> tuple[str, DatasetIndex, Store]:
    """:func:`index_store` of the folder ``url``; returns the index's URL, the index and the store."""
    store = open_folder(url, storage_options)
    index = index_store(store, echo=echo)
    return store.join(INDEX_NAME), index, store
