"""Parquet read through a decoded copy in the local cache.

Parquet has no random access below a row group: a shuffled batch touches a row group per
sample, and each must be decompressed and decoded whole (the block cache cannot hold a
dataset's worth of them). So each Parquet file is decoded once, with only the columns a dataset
reads, into an uncompressed Arrow IPC file (one record batch per row group), which is then
memory-mapped and read like any IPC file: numeric fields by one gather from the map.

The copy lives under ``<cache root>/parquet/``, named after the file's absolute path, size and
modification time and the columns (``_storage.derived_path``): a changed file gets a new copy,
and the copies of its earlier versions are deleted when the new one is published. Publication
is atomic and happens once per machine however many processes ask (``_storage.publish``); a
copy is read only while it is the very file published (its record says so), so one replaced or
planted since is decoded again, never served.
Memory stays bounded by one row group's decoded columns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fastload._formats._arrow_source import ARROW_ERRORS, Segments, open_segments
from fastload._storage import (
    SourceVersion,
    derived_path,
    other_versions,
    publish,
    remove,
)
from fastload.errors import DataFileNotFoundError, DataFormatError

# Part of every copy's name: a change to how copies are written must not reuse older ones.
_LAYOUT = 1
# How long a construction waits for another process decoding the same file (multi-GB files on
# a slow disk take minutes).
DECODE_WAIT_S = 3600.0


def copy_name(source: Path, copy: Path) -> str:
    """How messages name a Parquet file read through its copy."""
    return f"{source} (read from its decoded copy {copy})"


def decoded_copy(
    source: Path, columns: list[str], num_rows: int, directory: Path
) -> tuple[Path, Segments]:
    """The decoded copy of the Parquet file ``source`` with the top-level ``columns`` in
    ``directory``, decoded now unless it is there already, and opened: ``(path, segments)``.

    ``num_rows`` is the file's row count from its footer; a copy that cannot be opened or holds
    another count (damaged since it was written) is replaced once. Raises
    :class:`DataFileNotFoundError` if ``source`` is gone, :class:`DataFormatError` naming it if
    it cannot be decoded or changes while being decoded, and :class:`CacheError` if the
    directory cannot hold the copy.
    """
    try:
        version = SourceVersion.of(source)
    except FileNotFoundError as exc:
        raise DataFileNotFoundError(f"{source}: no such file or directory", source) from exc
    variant = json.dumps({"layout": _LAYOUT, "columns": columns})
    copy = derived_path(directory, version, variant, ".arrow")
    root = directory.parent  # the cache root: its folders are checked from there (_storage._safe)
    for attempt in range(2):
        if publish(copy, lambda t: _decode(source, version, columns, t), timeout_s=DECODE_WAIT_S, root=root):
            for older in other_versions(copy):
                remove(older, root=root)
        try:
            segments = open_segments(str(copy))
        except DataFormatError as exc:
            problem = str(exc)
        else:
            found = int(segments.rows.sum())
            if found == num_rows:
                return copy, segments
            segments.close()
            problem = f"{copy}: holds {found} rows, not {num_rows}"
        if attempt == 0:
            remove(copy, root=root)  # damaged after it was published: decode again
    raise DataFormatError(
        f"{copy_name(source, copy)}: the copy cannot be read after decoding it again"
        f" ({problem}); delete it, or pass cache_dir=False to read the Parquet file directly"
    )


def _decode(source: Path, version: SourceVersion, columns: list[str], target: Path) -> None:
    """Write the copy of ``source`` at ``target``; an ``OSError`` from writing propagates as
    such (it is the cache's), every failure to read ``source`` is a DataFormatError."""
    try:
        parquet = pq.ParquetFile(source, memory_map=True)
        full = parquet.schema_arrow
    except FileNotFoundError as exc:
        raise DataFileNotFoundError(f"{source}: no such file or directory", source) from exc
    except ARROW_ERRORS as exc:
        raise DataFormatError(
            f"{source}: cannot be read as a Parquet file; it is truncated or damaged"
            f" ({type(exc).__name__}: {exc})"
        ) from exc
    schema = pa.schema([full.field(c) for c in columns], metadata=full.metadata)
    try:
        with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for group in range(parquet.num_row_groups):
                writer.write_table(_row_group(parquet, group, columns, source))
    finally:
        parquet.close()
    if not _unchanged(source, version):
        raise DataFormatError(
            f"{source}: changed while it was being decoded into the cache; create the dataset"
            " again once the file is complete"
        )


def _unchanged(source: Path, version: SourceVersion) -> bool:
    try:
        return SourceVersion.of(source) == version
    except OSError:
        return False  # deleted or replaced meanwhile


def _row_group(parquet: pq.ParquetFile, group: int, columns: list[str], source: Path) -> pa.Table:
    try:
        return parquet.read_row_group(group, columns=columns, use_threads=True)
    except ARROW_ERRORS as exc:
        raise DataFormatError(
            f"{source}: row group {group} cannot be decoded; the file is damaged"
            f" ({type(exc).__name__}: {exc})"
        ) from exc
