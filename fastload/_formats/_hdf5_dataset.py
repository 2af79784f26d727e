"""``HDF5Dataset``: the fastload layout, h5py variable-length data, plain arrays and strings."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from fastload._formats._base import ShardedDataset, ShardReader
from fastload._formats._block_cache import BlockCache
from fastload._formats._discover_remote import derive_index
from fastload._formats._fields import check_same_fields, pick_length_field, requested_names
from fastload._formats._hdf5_layout import (
    H5Contents,
    H5Field,
    common_num_samples,
    scan,
    select,
)
from fastload._formats._hdf5_shard import (
    H5_ERRORS,
    H5Shard,
    MappedShard,
    ShardPlacement,
    damaged_h5,
    file_identity,
    open_h5,
)
from fastload._formats._hdf5_validate import validate_shard
from fastload._formats._paths import PathArg, files_in_directory, resolve_paths
from fastload._formats._validate import check_positive_int
from fastload._remote import is_remote
from fastload._shards import RemoteSource, ShardFile, local_only, remote_fields
from fastload._types import Field
from fastload.errors import DataFormatError

_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
DEFAULT_CACHE_BYTES = 64 << 20


class HDF5Dataset(ShardedDataset):
    """A map-style dataset over one or more HDF5 files, read a whole batch at a time.

    ``path`` is a file, a directory (its ``*.h5``/``*.hdf5`` files, sorted), a glob (matches
    sorted), or a list of those (in the given order); several files are one dataset whose
    sample indices run through the files in order. A dataset of 0 samples is valid.

    Layouts read (see ``_hdf5_layout`` for discovery):

    * the fastload layout: ``<field>/values`` and ``<field>/offsets`` (int64 ``[N+1]``), with an
      optional root ``/lengths`` index (int64 ``[N]``) of the file's primary ragged field:
      the one its ``field`` attribute names, else whichever ragged field it equals;
    * h5py variable-length datasets (``h5py.vlen_dtype``) of numbers: ragged fields;
    * plain ``[N, ...]`` numeric datasets: fixed fields;
    * strings, variable or fixed length: object fields, ``str`` for UTF-8 data and ``bytes``
      for ASCII-tagged data (what h5py writes for ``bytes``).

    ``fields`` picks fields by name (nested groups as ``"a/b"``), default all. ``length_field``
    is the ragged field behind :attr:`lengths`: by default the field ``/lengths`` describes,
    else the first ragged field; with no ragged field at all, every sample has length 1.
    ``cache_bytes`` bounds each process's cache of decoded chunks (the newest chunk is always
    kept) and, separately, each variable-length field's table of parsed heap collections.

    Speed: a contiguous, uncompressed dataset is a zero-copy memory map at its file offset, so a
    batch is one numpy gather with no HDF5 call. Chunked or compressed datasets are read in
    whole chunks (consecutive missing chunks in one call) through the cache. Variable-length
    data is gathered from HDF5's global heap through the memory map as well (``_hdf5_heap``),
    falling back to HDF5 itself for layouts that code does not know. The fastload layout,
    contiguous and uncompressed (``fastload convert``), is the fastest.

    Validation at construction, reading no payload: the files open as HDF5; the fields exist
    and have supported dtypes; all fields (and the ``num_samples`` attribute) agree on N;
    offsets have N+1 entries, start at 0, never decrease and end at ``len(values)``;
    ``/lengths`` agrees with its field. Errors are :class:`~fastload.errors.DataFormatError`
    (:class:`~fastload.errors.FieldNotFoundError` for an unknown field) naming the file, the
    field and the sample.

    Pickling carries the paths, the options and the small description found at construction,
    never a handle; each process opens the files on its first read (a change of pid after
    ``fork`` is detected), read-only and without HDF5 file locking, which fails on many network
    file systems. HDF5 refuses to open a file twice in one process with different locking
    flags, so open a file this dataset has open with ``h5py.File(path, "r", locking=False)``.
    """

    # UnicodeDecodeError: a string dataset tagged UTF-8 holding other bytes.
    _read_errors: ClassVar[tuple[type[BaseException], ...]] = (*H5_ERRORS, UnicodeDecodeError)
    #: Every read is a function of the files and options alone (``fastload._protocols``).
    process_independent_reads = True

    def __init__(
        self,
        path: PathArg,
        *,
        fields: Sequence[str] | None = None,
        length_field: str | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        cache_bytes = check_positive_int("cache_bytes", cache_bytes, minimum=0)
        names = requested_names(fields)
        requested = None if names is None else [n.strip("/") for n in names]
        self._requested = requested
        if isinstance(path, str) and is_remote(path):
            source = RemoteSource(
                path,
                storage_options=storage_options,
                cache_dir=cache_dir,
                cache_limit=cache_limit,
                derive=derive_index,
            )
            chosen = None if length_field is None else length_field.strip("/")
            described, chosen = remote_fields(source, "hdf5", requested, chosen)
            sizes = [s.samples for s in source.index.shards]
            super().__init__(source.urls, described, sizes, chosen, cache_bytes, remote=source)
            self._shard_specs: list[dict[str, H5Field] | None] = [None] * len(source.urls)
            self._placements: list[ShardPlacement | None] = [None] * len(source.urls)
            return
        local_only("HDF5Dataset", storage_options=storage_options, cache_limit=cache_limit)
        files = [
            str(f)
            for f in resolve_paths(
                path, expand_directory=lambda d: files_in_directory(d, _SUFFIXES)
            )
        ]
        contents, shard_specs, sizes = _describe_shards(files, requested)
        described = _described(shard_specs[0])
        chosen = None if length_field is None else length_field.strip("/")
        if chosen is not None:
            pick_length_field(described, chosen, files[0])  # fail before the long checks
        length_parts: list[npt.NDArray[np.int64]] = []
        placements: list[ShardPlacement | None] = []
        for shard, (file, found) in enumerate(zip(files, contents, strict=True)):
            with damaged_h5(file):
                indexed, checked, placement = validate_shard(file, shard, found, shard_specs[shard])
            placements.append(placement)
            if shard == 0 and chosen is None:
                # The field /lengths describes is the file's primary one; else the first ragged.
                default = indexed if indexed in described else None
                chosen = pick_length_field(described, default, file)
            if chosen is not None:
                length_parts.append(checked[chosen])
        super().__init__(files, described, sizes, chosen, cache_bytes)
        self._shard_specs = list(shard_specs)
        self._placements = placements
        if chosen is not None:
            # Computed while validating: ``lengths`` costs nothing more in this process.
            self._cache_lengths(np.concatenate(length_parts))

    def _open_shard(self, shard: int, file: ShardFile, cache: BlockCache[Any]) -> H5Shard | MappedShard:
        if not file.described:
            return self._open_new_shard(shard, file, cache)
        path, placement = file.path, self._placements[shard]
        specs = self._shard_specs[shard]
        assert specs is not None  # a local dataset describes every shard at construction
        if placement is not None and _unchanged(path, placement):
            # Every field lies in the map where this dataset found it: no HDF5 at all.
            return MappedShard(path, specs, placement)
        with damaged_h5(path):
            reader = H5Shard(path, shard, specs, cache)
            reader.release_unused_file()
        return reader

    def _reader_for_hints(self, shard: int) -> ShardReader | None:
        """The shard open in this process, else, when its placement is known and the file
        unchanged, the shard opened as a :class:`MappedShard` (a memory map: no HDF5 state that
        a later read or a forked worker would inherit); else ``None``."""
        reader = super()._reader_for_hints(shard)
        if reader is not None:
            return reader
        placement = self._placements[shard]
        if placement is not None and _unchanged(self._files[shard], placement):
            return self._shard(shard)
        return None

    def _open_new_shard(self, shard: int, file: ShardFile, cache: BlockCache[Any]) -> H5Shard | MappedShard:
        """A shard first seen now (a remote one, in the local cache), described and validated
        as a local file is at construction; it must hold what its index says."""
        path = file.path
        contents, specs, sizes = _describe_shards([path], self._requested)
        file.check_holds(_described(specs[0]), sizes[0], self._fields)
        with damaged_h5(path):
            _, _, placement = validate_shard(path, shard, contents[0], specs[0])
            if placement is not None:
                return MappedShard(path, specs[0], placement)
            reader = H5Shard(path, shard, specs[0], cache)
            reader.release_unused_file()
        return reader


def _unchanged(path: str, placement: ShardPlacement) -> bool:
    try:
        return file_identity(path) == placement.identity
    except OSError:
        return False  # gone: opening it says so


def _described(specs: dict[str, H5Field]) -> dict[str, Field]:
    return {name: spec.field for name, spec in specs.items()}


def _describe_shards(
    files: list[str], requested: list[str] | None
) -> tuple[list[H5Contents], list[dict[str, H5Field]], list[int]]:
    """Scan every file: what it holds, the fields to read from it, its sample count."""
    contents: list[H5Contents] = []
    shard_specs: list[dict[str, H5Field]] = []
    sizes: list[int] = []
    for file in files:
        with open_h5(file) as handle, damaged_h5(file):
            found = scan(handle, file)
        selected = select(found, requested, file)
        if not selected:
            raise DataFormatError(f"{file}: holds no dataset that could be a field")
        if shard_specs:
            check_same_fields(file, _described(selected), files[0], _described(shard_specs[0]))
        sizes.append(common_num_samples(selected, found, file))
        # Shards usually share one description; keep one object so pickling stores it once.
        same = next((s for s in shard_specs if s == selected), None)
        shard_specs.append(same if same is not None else selected)
        contents.append(found)
    return contents, shard_specs, sizes
