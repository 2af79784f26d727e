"""A remote dataset's index derived from its shards, where no ``fastload-index.json`` is beside
them: one listing, then for each shard what tells its fields and the length field's lengths,
read by ranged GETs (one :meth:`Store.ranges` open per shard); never a whole shard.

What planning reads, per Arrow IPC or Parquet shard: its last :data:`TAIL_BYTES` (one ranged
GET: the footer, with the schema and row counts; a longer footer costs one more), then

* Parquet: the column chunks of the length field's column, one ranged GET per row group
  (a list's lengths are in its repetition levels, which are stored with its values, so the
  values of that one column are read; the other columns are not);
* Arrow IPC file: per record batch, its metadata and the length field's offsets buffer (and
  its validity bitmap if it has nulls), one ranged GET each (``_ipc_offsets``): neither its
  values nor another column. A layout that module does not read falls back to pyarrow, which
  reads the length field's buffers, values too (``included_fields``).
* HDF5 (``_discover_hdf5``): its metadata and each ragged field's ``offsets``, in aligned
  blocks of 64 KiB (a few requests for a shard in the fastload layout).

Arrow IPC *streams* have no footer (finding their batches means reading them whole), and HDF5
variable-length datasets keep their lengths with their values: both are refused with an error
that names ``fastload index``, as are HTTP(S) folders, which cannot be listed.

Checksums are unknown (``ShardEntry.sha256 is None``): the shard cache checks sizes only, and
keys shards by size and the store's version of the object, so a rewritten object is fetched
again. Shards are read by up to :data:`THREADS` threads, the store's requests being I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from fastload._formats._arrow_convert import list_lengths
from fastload._formats._arrow_schema import ArrowField, field_array, select_fields
from fastload._formats._discover_hdf5 import RangedFile, describe_hdf5
from fastload._formats._fields import check_same_fields, pick_length_field
from fastload._formats._ipc_offsets import ipc_list_lengths, ipc_rows
from fastload._remote import INDEX_NAME, DatasetIndex, ObjectInfo, ShardEntry, Store
from fastload._threads import own_thread
from fastload._types import Field
from fastload.errors import DataFileNotFoundError, DataFormatError, FastloadError

#: Bytes read from the end of each shard first: its footer, in one request for most shards.
TAIL_BYTES = 64 << 10
#: At most this many shards are described at once.
THREADS = 8
_HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")  # the readers' own (tested), which import this module: not imported
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".parquet")
_T = TypeVar("_T")


def select_shards(url: str, listing: Sequence[ObjectInfo]) -> tuple[str, list[ObjectInfo]]:
    """The format and the shards among ``listing`` (the objects under ``url``), sorted by path
    parts as a local folder's are; a folder of both formats, or of neither, is refused naming
    ``url``."""
    found = sorted((i for i in listing if i.name != INDEX_NAME), key=lambda i: PurePosixPath(i.name).parts)
    hdf5 = [i for i in found if i.name.endswith(_HDF5_SUFFIXES)]
    arrow = [i for i in found if i.name.endswith(_ARROW_SUFFIXES)]
    if hdf5 and arrow:
        raise DataFileNotFoundError(
            f"{url}: holds both HDF5 ({hdf5[0].name}) and Arrow/Parquet ({arrow[0].name}) "
            "shards and no index; one dataset is shards of one format: point at a folder or a "
            "glob of one of them",
            url,
        )
    if not (hdf5 or arrow):
        what = f"{len(found)} objects, none of them" if found else "no object, so not"
        raise DataFileNotFoundError(
            f"{url}: holds no {INDEX_NAME} and {what} an HDF5 or Arrow/Parquet shard "
            f"({', '.join(_HDF5_SUFFIXES + _ARROW_SUFFIXES)}); check the URL",
            url,
        )
    return ("hdf5", hdf5) if hdf5 else ("arrow", arrow)


def derive_index(store: Store, *, threads: int = THREADS) -> DatasetIndex:
    """The index of the shards under ``store`` (see the module text), from one listing and
    their footers and length columns, described by up to ``threads`` threads. Raises
    :class:`DataFileNotFoundError` naming the URL for a store that cannot be listed or a
    folder without shards or of mixed formats, and :class:`DataFormatError` (or its
    ``DataFileNotFoundError`` where only an index helps, naming ``fastload index``) naming the
    shard for one that cannot be read so or whose fields differ from the first shard's."""
    where = store.join(INDEX_NAME)
    if not store.can_list:
        raise _no_index(where, f"{store.url} cannot be listed (HTTP), so its shards are found from an index only")
    kind, shards = select_shards(store.url, store.list())
    described = bounded_map(lambda info: describe(store, info, kind), shards, threads)
    first_url = store.join(shards[0].name)
    fields, length_field = described[0][0], described[0][1]
    for info, (theirs, _, _) in zip(shards, described, strict=True):
        check_same_fields(store.join(info.name), theirs, first_url, fields)  # so the length field too
    entries = tuple(
        ShardEntry(info.name, int(lengths.size), info.size, None, info.version)
        for info, (_, _, lengths) in zip(shards, described, strict=True)
    )
    lengths = np.concatenate([d[2] for d in described])
    index = DatasetIndex(kind, fields, length_field, entries, lengths)
    index.check(where)
    return index


def _no_index(where: str, why: str) -> DataFileNotFoundError:
    return DataFileNotFoundError(
        f"{where}: no index beside the shards; write one with `fastload index` (or `fastload "
        f"convert -o URL`), which lists the shards and their lengths so that no process has to "
        f"list the bucket or open a shard to plan an epoch; {why}",
        where,
    )


def describe(store: Store, info: ObjectInfo, kind: str) -> tuple[dict[str, Field], str | None, npt.NDArray[np.int64]]:
    """The fields, length field and per-sample lengths of one shard of ``kind`` (``hdf5`` or
    ``arrow``), read through ranged requests (see the module text)."""
    url = store.join(info.name)
    if kind == "hdf5":
        with store.ranges(info.name) as read_at:
            return describe_hdf5(url, read_at, info.size, f"write an index with `fastload index {store.url}`")
    try:
        with store.ranges(info.name) as read_at:
            remote = RangeFile(read_at, info.size)
            if remote.tail.endswith(b"PAR1"):
                return _describe_parquet(url, remote)
            if remote.tail.endswith(b"ARROW1"):
                return _describe_ipc(url, remote)
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, FastloadError):  # the store's, or ours: they name the URL already
            raise
        raise DataFormatError(
            f"{url}: cannot be read as Arrow/Parquet; it is truncated or damaged "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    raise DataFormatError(
        f"{url}: ends with neither a Parquet nor an Arrow IPC file footer (an Arrow IPC stream, "
        "as Hugging Face datasets writes, has none: finding its batches means reading it whole); "
        f"write an index with `fastload index {store.url}`, which reads each shard once",
        url,
    )


def _describe_parquet(url: str, remote: RangeFile) -> tuple[dict[str, Field], str | None, npt.NDArray[np.int64]]:
    with pq.ParquetFile(pa.PythonFile(remote, mode="r")) as parquet:
        specs, length_field = _fields(url, parquet.schema_arrow)
        metadata = parquet.metadata
        if length_field is None:
            return _described(specs), None, np.ones(metadata.num_rows, np.int64)
        spec = specs[length_field]
        parts = [
            _lengths(field_array(_batch(parquet.read_row_group(i, columns=[spec.path[0]], use_threads=False)), spec.path), spec, url)
            for i in range(metadata.num_row_groups)
        ]
    return _described(specs), length_field, _joined(parts)


def _describe_ipc(url: str, remote: RangeFile) -> tuple[dict[str, Field], str | None, npt.NDArray[np.int64]]:
    schema = pa.ipc.open_file(pa.PythonFile(remote, mode="r")).schema
    specs, length_field = _fields(url, schema)
    if length_field is None:
        return _described(specs), None, np.ones(ipc_rows(remote.read_at, remote.size(), remote.tail), np.int64)
    lengths = ipc_list_lengths(remote.read_at, remote.size(), remote.tail, schema, specs[length_field].path)
    if lengths is not None:
        return _described(specs), length_field, lengths
    # A layout _ipc_offsets does not read: the length field's buffers, values too, by pyarrow.
    column = schema.get_field_index(specs[length_field].path[0])
    options = pa.ipc.IpcReadOptions(included_fields=[column], use_threads=False)
    reader = pa.ipc.open_file(pa.PythonFile(remote, mode="r"), options=options)
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    spec = specs[length_field]
    return _described(specs), length_field, _joined([_lengths(field_array(b, spec.path), spec, url) for b in batches])


def _fields(url: str, schema: pa.Schema) -> tuple[dict[str, ArrowField], str | None]:
    """All of the shard's fields, as ``fastload index`` describes them, and the default length
    field (the first ragged one)."""
    specs = select_fields(url, schema, None)
    if not specs:
        raise DataFormatError(f"{url}: has no column that could be a field")
    return specs, pick_length_field(_described(specs), None, url)


def _lengths(array: pa.Array, spec: ArrowField, url: str) -> npt.NDArray[np.int64]:
    # A null list counts as empty here; whether nulls may be read is the dataset's null_fill,
    # checked when a shard is opened to read.
    rows = np.arange(len(array), dtype=np.int64)
    return list_lengths(array, spec, 0, rows, url)


def _batch(table: pa.Table) -> pa.RecordBatch:
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def _joined(parts: list[npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _described(specs: dict[str, ArrowField]) -> dict[str, Field]:
    return {name: spec.field for name, spec in specs.items()}


class RangeFile(RangedFile):
    """A read-only file over one object of ``size`` bytes read by ``read_at`` (a
    :meth:`Store.ranges` reader): its last :data:`TAIL_BYTES` fetched at once (the footer),
    every other read one ranged GET of exactly the bytes asked for. ``fetched`` counts the
    bytes received. For one thread (pyarrow's ``PythonFile`` locks)."""

    def __init__(self, read_at: Callable[[int, int], bytes], size: int) -> None:
        super().__init__(read_at, size)
        self._tail_start = max(0, size - TAIL_BYTES)
        self.tail = read_at(self._tail_start, size - self._tail_start)
        self.fetched = len(self.tail)

    def size(self) -> int:
        return self._size

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        start = min(self._position, self._size)
        data = self.read_at(start, min(len(buffer), self._size - start))
        memoryview(buffer)[: len(data)] = data
        self._position = start + len(data)
        return len(data)

    def read_at(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``, from the tail when they lie in it."""
        if offset >= self._tail_start:
            return self.tail[offset - self._tail_start : offset - self._tail_start + length]
        data = self._read_at(offset, length)
        self.fetched += len(data)
        return data


def bounded_map(function: Callable[[ObjectInfo], _T], items: Sequence[ObjectInfo], threads: int) -> list[_T]:
    """``[function(i) for i in items]`` by up to ``threads`` threads (the caller's among them);
    after the first error no new item starts, and it is raised once the running ones finish
    (each is bounded by the store's retry policy)."""
    results: list[_T | None] = [None] * len(items)
    errors: list[BaseException] = []
    lock = threading.Lock()
    taken = 0

    def work() -> None:
        nonlocal taken
        while True:
            with lock:
                if errors or taken == len(items):
                    return
                mine, taken = taken, taken + 1
            try:
                results[mine] = function(items[mine])
            except BaseException as exc:  # re-raised in the caller's thread
                with lock:
                    errors.append(exc)
                return

    helpers = [own_thread(work, f"fastload-describe-{n}") for n in range(min(threads, len(items)) - 1)]
    for helper in helpers:
        helper.start()
    work()
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]
    return cast("list[_T]", results)


__all__ = [
    "TAIL_BYTES",
    "THREADS",
    "RangeFile",
    "bounded_map",
    "derive_index",
    "describe",
    "select_shards",
]  # fmt: skip
