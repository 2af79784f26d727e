"""``ArrowDataset``: Arrow IPC files and streams (Hugging Face ``datasets`` files) and Parquet."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from fastload._formats._arrow_convert import NullFill
from fastload._formats._arrow_schema import ArrowField, select_fields
from fastload._formats._arrow_shard import ArrowShard, check_nulls
from fastload._formats._arrow_source import ARROW_ERRORS, Segments, open_segments
from fastload._formats._base import ShardedDataset, ShardReader
from fastload._formats._block_cache import BlockCache
from fastload._formats._discover_remote import derive_index
from fastload._formats._fields import check_same_fields, pick_length_field, requested_names
from fastload._formats._parquet_copy import copy_name, decoded_copy
from fastload._formats._paths import PathArg, files_in_directory, resolve_paths
from fastload._formats._sniff import sniff
from fastload._formats._validate import check_positive_int
from fastload._remote import is_remote
from fastload._shards import RemoteSource, ShardFile, local_only, remote_fields
from fastload._storage import cache_root
from fastload._types import Field
from fastload.errors import DataFileNotFoundError, DataFormatError

_SUFFIXES = (".arrow", ".feather", ".ipc", ".parquet")
DEFAULT_CACHE_BYTES = 64 << 20


def expand_directory(directory: Path) -> list[Path]:
    """A ``datasets`` ``save_to_disk`` folder (``state.json`` lists its ``data-*.arrow`` files),
    or else the folder's Arrow and Parquet files, sorted. ``datasets`` cache folders and
    ``DatasetDict`` folders hold several splits and are refused with a hint."""
    state = directory / "state.json"
    if state.is_file():
        try:
            listed = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataFormatError(
                f"{state}: expected a Hugging Face datasets state.json with a '_data_files' list"
                f" of {{'filename': ...}} ({type(exc).__name__}: {exc})"
            ) from exc
        files = [directory / name for name in listed]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DataFileNotFoundError(
                f"{state}: lists data files that do not exist: {', '.join(missing)}", missing[0]
            )
        return files
    if (directory / "dataset_info.json").is_file():
        # A datasets cache folder: every split, plus cached transforms, side by side.
        arrows = sorted(p.name for p in directory.glob("*.arrow"))
        raise DataFormatError(
            f"{directory}: looks like a Hugging Face datasets cache folder, which holds several"
            f" splits and cached transforms ({', '.join(arrows) or 'no .arrow files'}); point at"
            " the file(s) of one split, e.g. a glob such as '<folder>/*-train*.arrow'"
        )
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if (p / "state.json").is_file())
        raise DataFormatError(
            f"{directory}: is a DatasetDict folder; point at one split's folder:"
            f" {', '.join(str(directory / s) for s in splits) or '(none found)'}"
        )
    return files_in_directory(directory, _SUFFIXES)


class ArrowDataset(ShardedDataset):
    """A map-style dataset over Arrow IPC files and streams and Parquet files, read a whole
    batch at a time.

    ``path`` is a file, a glob (matches sorted), a directory, or a list of those (in the given
    order). A directory is a Hugging Face ``datasets`` ``save_to_disk`` folder (its
    ``state.json`` lists the ``data-*.arrow`` files) or any folder of ``*.arrow``,
    ``*.feather``, ``*.ipc`` and ``*.parquet`` files (sorted). The format of each file is taken
    from its signature: an Arrow IPC file, an Arrow IPC stream (what ``datasets`` writes, in
    its cache and in ``save_to_disk``), or Parquet.

    Columns (see ``_arrow_schema``): ``list``/``large_list`` are ragged, numbers, bools and
    ``fixed_size_list`` are fixed, strings and binary are object fields (``str``/``bytes``),
    struct children are fields named ``"column/child"``. ``fields`` picks fields by name, default
    all; ``length_field`` is the ragged field behind :attr:`lengths`, default the first (with no
    ragged field, every sample has length 1).

    ``null_fill``: nulls are an error (raised at construction for IPC, naming the sample)
    unless this is set. With a number here, a null number reads as that number, a null list as
    an empty sample, a null string as ``""`` (``b""`` for binary).

    Speed, fastest first:

    * uncompressed IPC files and streams are memory-mapped, and numeric fields without nulls
      are read by one numpy gather straight from the mapping across all record batches
      (zero-copy views of values and offsets);
    * bool, string and nullable fields of those files go through Arrow's ``take`` per record
      batch touched;
    * Parquet is decoded once, at construction in this process, into a *decoded copy*: an
      uncompressed IPC file of the columns read, in the local cache, then read as above (a
      shuffled epoch runs as fast as over IPC). The first construction pays the decode, about
      the time of reading the columns with pyarrow; later ones, in any process on this machine,
      reuse the copy while the file keeps its size and modification time (a changed file is
      decoded again, and its older copy deleted). Concurrent constructions decode once.
      ``cache_dir`` is the cache directory: default ``$FASTLOAD_CACHE``, else
      ``$XDG_CACHE_HOME/fastload``, else ``~/.cache/fastload`` (copies go to its ``parquet/``
      folder; delete it whenever no loader runs). A directory that cannot hold the copy raises
      :class:`~fastload.errors.CacheError`. ``cache_dir=False`` makes no copy and decodes
      whole row groups on demand instead, which is slow for random access;
    * compressed IPC (Feather's LZ4 default), and Parquet with ``cache_dir=False``, decode
      whole record batches or row groups (only the columns read) through a per-process cache
      of ``cache_bytes``.

    :attr:`files` lists the files as given, Parquet files included; messages about a Parquet
    file read through its copy name both. Pickling carries the paths, the options and the small
    description found at construction, never a handle or a mapping; each process maps the files
    (the copies, for Parquet: workers never decode) on its first read.
    """

    _read_errors: ClassVar[tuple[type[BaseException], ...]] = ARROW_ERRORS
    #: Every read is a function of the files and options alone (``fastload._protocols``).
    process_independent_reads = True

    def __init__(
        self,
        path: PathArg,
        *,
        fields: Sequence[str] | None = None,
        length_field: str | None = None,
        null_fill: NullFill | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        cache_bytes = check_positive_int("cache_bytes", cache_bytes, minimum=0)
        if cache_dir is not None and cache_dir is not False and not isinstance(
            cache_dir, (str, os.PathLike)
        ):
            raise TypeError(
                "cache_dir must be a directory, None (the default cache directory) or False (no"
                f" decoded copies of Parquet files); got {type(cache_dir).__name__} {cache_dir!r}"
            )
        if null_fill is not None and not isinstance(null_fill, (int, float, np.number)):
            raise TypeError(
                f"null_fill must be a number or None; got {type(null_fill).__name__} {null_fill!r}"
            )
        self._null_fill = null_fill
        requested = requested_names(fields)
        copies = None if cache_dir is False else cache_root(cache_dir) / "parquet"
        self._requested, self._copies = requested, copies
        if isinstance(path, str) and is_remote(path):
            source = RemoteSource(
                path,
                storage_options=storage_options,
                cache_dir=None if cache_dir is False else cache_dir,
                cache_limit=cache_limit,
                derive=derive_index,
            )
            fields_read, length_name = remote_fields(source, "arrow", requested, length_field)
            shard_sizes = [s.samples for s in source.index.shards]
            super().__init__(source.urls, fields_read, shard_sizes, length_name, cache_bytes, remote=source)
            self._specs: dict[str, ArrowField] = {}  # found in each shard as it is opened
            return
        local_only("ArrowDataset", storage_options=storage_options, cache_limit=cache_limit)
        files = resolve_paths(path, expand_directory=expand_directory)
        specs: dict[str, ArrowField] = {}
        sizes: list[int] = []
        read_paths: list[str] = []
        names: list[str] = []
        for file in files:
            segments = open_segments(str(file))
            read_path = shown = str(file)
            try:
                chosen = select_fields(str(file), segments.schema, requested)
                if not chosen:
                    raise DataFormatError(f"{file}: has no column that could be a field")
                if specs:
                    first = _described(specs)
                    check_same_fields(str(file), _described(chosen), str(files[0]), first)
                else:
                    specs = chosen
                if copies is not None and sniff(file) == "parquet":
                    copy, segments = _read_through_copy(file, segments, specs, copies)
                    read_path, shown = str(copy), copy_name(file, copy)
                read_paths.append(read_path)
                names.append(shown)
                check_nulls(segments, specs, null_fill, sum(sizes), shown)
                sizes.append(int(segments.rows.sum()))
            finally:
                segments.close()
        described = _described(specs)
        chosen_length_field = pick_length_field(described, length_field, str(files[0]))
        super().__init__(
            files, described, sizes, chosen_length_field, cache_bytes, read_paths=read_paths, names=names
        )
        self._specs = specs

    def _reader_for_hints(self, shard: int) -> ShardReader | None:
        """The shard, opened in this process if it is not yet: Arrow maps the file, which no
        read or forked worker depends on (a compressed file decodes each record batch once
        to count its rows, and then has nothing to advise)."""
        return self._shard(shard)

    def _open_shard(self, shard: int, file: ShardFile, cache: BlockCache[Any]) -> ArrowShard:
        if not file.described:
            return self._open_new_shard(shard, file, cache)
        first = int(self._shard_starts[shard])
        path, shown = file.path, file.name
        try:
            return ArrowShard(path, shard, first, self._specs, self._null_fill, cache, shown)
        except FileNotFoundError as exc:
            if path == self._files[shard]:
                raise
            raise DataFileNotFoundError(
                f"{shown}: the decoded copy is gone (the cache was cleared, or the Parquet file"
                " changed and a dataset created since replaced the copy); create the dataset"
                " again",
                path,
            ) from exc

    def _open_new_shard(self, shard: int, file: ShardFile, cache: BlockCache[Any]) -> ArrowShard:
        """A shard first seen now (a remote one, in the local cache), read as a local file is
        (a Parquet shard through its decoded copy); it must hold what its index says."""
        local = Path(file.path)
        url = file.name
        segments = open_segments(str(local))
        read_path, shown = str(local), url
        try:
            specs = select_fields(url, segments.schema, self._requested)
            specs = {name: specs[name] for name in self._fields if name in specs}
            file.check_holds(_described(specs), int(segments.rows.sum()), self._fields)
            if self._copies is not None and sniff(local) == "parquet":
                copy, segments = _read_through_copy(local, segments, specs, self._copies)
                read_path = str(copy)
            first = int(self._shard_starts[shard])
            checked = file.checked
            if not checked:
                check_nulls(segments, specs, self._null_fill, first, shown)
        finally:
            segments.close()
        return ArrowShard(read_path, shard, first, specs, self._null_fill, cache, shown, checked=checked)

    def _opening_options(self) -> object:
        return (self._null_fill, self._requested)


def _read_through_copy(
    file: Path, segments: Segments, specs: dict[str, ArrowField], directory: Path
) -> tuple[Path, Segments]:
    """Swap the Parquet ``segments`` of ``file`` for its decoded copy's (closing them)."""
    wanted = {spec.path[0] for spec in specs.values()}
    columns = [name for name in segments.schema.names if name in wanted]
    num_rows = int(segments.rows.sum())
    segments.close()
    return decoded_copy(file, columns, num_rows, directory)


def _described(specs: dict[str, ArrowField]) -> dict[str, Field]:
    return {name: spec.field for name, spec in specs.items()}
