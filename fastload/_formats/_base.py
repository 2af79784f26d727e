"""What both readers share: global indices over shards, per-process file handles, pickling as
paths and options, and the map-style interface built on ``read_batch``.

A subclass describes its files once, at construction in the parent process (fields, samples per
shard), and knows how to open one shard file in the current process (:meth:`_open_shard`). Which
file that is, and what opening it takes, is the dataset's shard source's to say
(``fastload._shards``: local files, or remote shards through the node's cache). Nothing opened
is ever pickled or shared across a fork: the first read in a new process, detected by a change
of ``os.getpid()``, opens its own handles.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import numpy.typing as npt
from torch.utils.data import Dataset

from fastload._formats._block_cache import BlockCache
from fastload._formats._columns import (
    concat_columns,
    empty_column,
    group_positions,
    inverse_permutation,
    permute_column,
    split_column,
)
from fastload._formats._hints import advise_samples
from fastload._formats._process import (
    ChecksMapped,
    MapsRaggedField,
    ProcessState,
    ReadsShardInPlace,
    ShardReader,
    offers,
)
from fastload._formats._validate import normalize_index, normalize_indices
from fastload._shards import (
    CachedShards,
    LocalShards,
    RemoteSource,
    ShardFile,
    ShardPrefetcher,
    ShardSource,
)
from fastload._types import Column, ColumnarBatch, Field, Spans, StorageCounts
from fastload.errors import DataFileNotFoundError, DataFormatError, StorageError

# State that belongs to one process and is dropped when pickling.
_PER_PROCESS = ("_process", "_lengths")


class ShardedDataset(Dataset[dict[str, Any]], abc.ABC):
    """Base class of the readers (see :class:`fastload.HDF5Dataset` for the contract).

    ``files`` name the shards (paths, or the URLs of ``remote``'s shards); reads of local
    shards go to ``read_paths`` (default: ``files``), named in messages by ``names`` (default:
    ``files``)."""

    #: Exceptions of the underlying library that a read may raise for a damaged file; they are
    #: re-raised as :class:`DataFormatError` naming the file, the field and the samples.
    _read_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    def __init__(
        self,
        files: Sequence[str | Path],
        fields: dict[str, Field],
        shard_sizes: Sequence[int],
        length_field: str | None,
        cache_bytes: int,
        *,
        read_paths: Sequence[str] | None = None,
        names: Sequence[str] | None = None,
        remote: RemoteSource | None = None,
    ) -> None:
        self._files = [str(f) for f in files]
        self._fields = dict(fields)
        self._shard_starts = np.concatenate([[0], np.cumsum(shard_sizes, dtype=np.int64)])
        self._num_samples = int(self._shard_starts[-1])
        self._length_field = length_field
        self._cache_bytes = cache_bytes
        self._process: ProcessState | None = None
        self._lengths: npt.NDArray[np.int64] | None = None
        self._shards: ShardSource
        if remote is None:
            self._shards = LocalShards(read_paths or self._files, names or self._files)
        else:
            self._shards = CachedShards(
                remote,
                reader=type(self).__name__,
                fields=self._fields,
                length_field=length_field,
                options=self._opening_options(),
            )

    # ---- what subclasses provide -------------------------------------------------------------

    @abc.abstractmethod
    def _open_shard(self, shard: int, file: ShardFile, cache: BlockCache[Any]) -> ShardReader:
        """Open shard ``shard``'s ``file`` in this process (see :class:`ShardFile`: a file the
        dataset described at construction, or one to describe now and check against its
        index); ``cache`` is this process's block cache."""

    def _opening_options(self) -> object:
        """What else than the fields decides how a remote shard is checked when opened (a
        subclass's options): part of what a check recorded in the cache is valid for."""
        return None

    def _shard_name(self, shard: int) -> str:
        """How messages name shard ``shard``."""
        return self._shards.name(shard)

    # ---- the public contract -----------------------------------------------------------------

    def __len__(self) -> int:
        return self._num_samples

    @property
    def fields(self) -> dict[str, Field]:
        """The fields read, in a stable order: the order asked for with ``fields=``, else the
        order of the first file."""
        return dict(self._fields)

    @property
    def length_field(self) -> str | None:
        """The ragged field whose lengths :attr:`lengths` holds (``None`` if there is none)."""
        return self._length_field

    @property
    def files(self) -> list[str]:
        """The shard files, in the order their samples are numbered."""
        return list(self._files)

    @property
    def read_files(self) -> list[str]:
        """The local files that reads go to, one per shard: :attr:`files`, except that a
        Parquet file read through its decoded copy is that copy. Empty for a remote dataset
        (its shards are in the shard cache, downloaded as they are needed)."""
        return self._shards.read_files()

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """int64 ``[N]``: the number of elements of each sample of :attr:`length_field`.

        Computed from index data only (offsets, ``/lengths``, vlen descriptors, Arrow list
        offsets), never from the payload except for Parquet read without its decoded copy
        (Parquet stores no offsets); cached for the life of the process and read-only. A dataset without a ragged field has nothing
        whose length varies: every sample counts as length 1, so length grouping changes
        nothing and a token budget counts samples.
        """
        if self._lengths is None:
            indexed = self._shards.indexed_lengths()  # a remote dataset's: never from the shards
            if indexed is not None:
                self._cache_lengths(indexed)
        if self._lengths is None:
            if self._length_field is None:
                self._cache_lengths(np.ones(self._num_samples, np.int64))
            else:
                field = self._length_field
                parts = [self._shard(s).lengths(field) for s in range(len(self._files))]
                self._cache_lengths(np.concatenate(parts) if parts else np.empty(0, np.int64))
        assert self._lengths is not None
        return self._lengths

    def _cache_lengths(self, lengths: npt.NDArray[np.int64]) -> None:
        """Keep ``lengths`` for :attr:`lengths` (a subclass may have them from validating)."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        lengths.flags.writeable = False
        self._lengths = lengths

    def read_batch(self, indices: npt.ArrayLike) -> ColumnarBatch:
        """Read the samples ``indices`` (a list or an integer array; any order, duplicates and
        negative indices allowed) as one columnar batch, in the order of ``indices``:
        :class:`~fastload._types.Ragged` per ragged field, a stacked array ``[B, *shape]`` per
        fixed field, a list of ``str``/``bytes`` per object field. Every array is new and
        writable. Raises ``IndexError`` for an index out of range, and
        :class:`DataFormatError` naming the file, the field and the samples for a damaged
        file."""
        return cast(ColumnarBatch, self._read_rows(indices, in_place=False))

    def read_batch_in_place(self, indices: npt.ArrayLike) -> dict[str, Column | Spans]:
        """:meth:`read_batch` for the fast path's padding (``fastload._protocols``): when every
        sample lies in one shard, a memory-mapped ragged field comes back as
        :class:`~fastload._types.Spans` over the map instead of a concatenated copy (the
        padding gathers from the map straight into the batch slot). Anything else is read as
        by :meth:`read_batch`."""
        return self._read_rows(indices, in_place=True)

    @property
    def reads_in_place(self) -> bool:
        """Whether :meth:`read_batch_in_place` reads what :meth:`read_batch` reads: not where a
        subclass, or an instance, overrides ``read_batch`` alone (that one must be called)."""
        if "read_batch" in vars(self):
            return False
        mro = type(self).__mro__
        in_place = next(i for i, cls in enumerate(mro) if "read_batch_in_place" in vars(cls))
        read = next(i for i, cls in enumerate(mro) if "read_batch" in vars(cls))
        return in_place <= read

    #: ``read_batch`` of the same indices gives the same bytes in any process
    #: (``fastload._protocols``). Each reader class declares it in its own body; a subclass
    #: that does not (it may read otherwise) has it false.
    process_independent_reads = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "process_independent_reads" not in vars(cls):
            cls.process_independent_reads = False

    def _read_rows(self, indices: npt.ArrayLike, *, in_place: bool) -> dict[str, Column | Spans]:
        rows = normalize_indices(indices, self._num_samples)
        if rows.size == 0:
            return {name: empty_column(field) for name, field in self._fields.items()}
        if len(self._files) == 1:
            return {name: self._read(0, name, rows, rows, in_place=in_place) for name in self._fields}
        shard = np.searchsorted(self._shard_starts, rows, side="right") - 1
        if shard[0] == shard[-1] and (shard == shard[0]).all():
            s = int(shard[0])
            local = rows - self._shard_starts[s]
            return {name: self._read(s, name, local, rows, in_place=in_place) for name in self._fields}
        return dict(self._read_across_shards(rows, shard))

    @property
    def shard_sizes(self) -> list[int]:
        """Samples per shard, in the order their samples are numbered (for a shard-window
        shuffle: ``shuffle_shards=``)."""
        return np.diff(self._shard_starts).tolist()

    # ---- where the shards live (``fastload._protocols``: RemoteReader, PrefetchesShards, ...) --

    @property
    def remote(self) -> bool:
        """Whether the shards come from object storage (``s3://``, ``gs://``, ``https://``)."""
        return self._shards.remote

    def storage_counts(self) -> StorageCounts | None:
        """For a remote dataset, what this process's reads of its shards cost so far (time
        blocked on downloads, bytes downloaded, cache hits and misses); ``None`` for local
        files. The engine reports it per batch (``fastload._protocols``)."""
        return self._shards.storage_counts()

    def shard_cache_plan(self) -> tuple[str, int | None, int] | None:
        """For a remote dataset, ``(folder, cache_limit, dataset_bytes)``: where its shards are
        cached, the cache's byte bound (``None``: none) and the bytes of all its shards; ``None``
        for local files (``fastload doctor`` checks the folder's owner and free space)."""
        return self._shards.cache_plan()

    def cache_window_warning(self, shuffle_shards: int) -> str | None:
        """Why a shard window of ``shuffle_shards`` shards will starve the prefetcher in this
        dataset's bounded cache (the window being read fills it, so nothing can come ahead:
        ``benchmarks/README.md``, bench_remote), or ``None`` when it leaves room."""
        return self._shards.cache_window_warning(shuffle_shards)

    def prefetch(
        self,
        batches: Iterator[npt.NDArray[np.int64]],
        consumed: Callable[[], int],
        *,
        concurrency: int = 4,
    ) -> ShardPrefetcher | None:
        """For a remote dataset, start bringing the shards of ``batches`` (the epoch's next
        batches, in order) to the local disk ahead of the consumer, whose progress
        ``consumed()`` gives (``fastload._shards._prefetch``); ``None`` for local files. The
        loader calls this with its sampler's plan; call ``close()`` on the result when the
        epoch ends. ``concurrency`` downloads run at once."""
        return cast("ShardPrefetcher | None", self._shards.prefetch(batches, consumed, concurrency=concurrency))

    def mapped_ragged(self) -> tuple[str, np.ndarray, np.ndarray] | None:
        """For one-call builds (``fastload._protocols``): ``(field, values, offsets)`` when the
        dataset is one file with one field, ragged, whose values and int64 offsets lie in a
        memory map in native byte order (sample ``i`` is ``values[offsets[i]:offsets[i +
        1]]``), else ``None``. Opens the file in this process."""
        if len(self._files) != 1 or len(self._fields) != 1:
            return None
        (name, field), = self._fields.items()
        if field.kind != "ragged":
            return None
        shard = self._shard(0)
        found = cast(MapsRaggedField, shard).mapped_ragged(name) if offers(shard, MapsRaggedField) else None
        return None if found is None else (name, *found)

    def check_mapped(self) -> None:
        """Raise :class:`DataFormatError` naming the file, the size it had when this process
        mapped it and its size now, when a file this process reads through a memory map has
        shrunk since (a read of the map past its new end would kill the process with SIGBUS
        instead). One ``fstat`` per shard open in this process; every read checks the shards it
        reads, and a one-call build (``fastload._protocols``) calls this first."""
        process = self._process
        if process is None or process.pid != os.getpid():
            return
        for reader in process.readers:
            if offers(reader, ChecksMapped):
                cast(ChecksMapped, reader).check_mapped()

    def willneed(self, indices: npt.ArrayLike) -> int:
        """Tell the kernel that the samples ``indices`` (any order, duplicates and negative
        indices allowed) will be read soon: ``posix_fadvise(WILLNEED)`` on the byte ranges
        holding their payload, widened to pages and merged where they touch, so that a cold
        disk reads them while the step runs. Returns the bytes advised (0: nothing known to
        advise). The call returns once the reads are queued; it does not wait for them.

        Advised: memory-mapped fields (the fastload HDF5 layout and contiguous HDF5 arrays,
        numeric fields of uncompressed Arrow IPC). Not advised (they count 0): HDF5 shards
        with a chunked, compressed, variable-length or string field (no shard-wide placement
        is known for them), fields Arrow reads itself (strings, bools, nullable fields,
        compressed files), and remote datasets (their shards are downloaded, not hinted).
        At most :data:`~fastload._formats._readahead.MAX_ADVISED_RANGES` merged ranges per
        call, those of the earliest ``indices`` first.

        Costs a few numpy operations and one system call per merged range. May be called in
        any process, the main one included, from any thread: it opens a shard only where
        opening changes no read (a memory map, never an HDF5 file), and reads only index data
        (offsets) to find the ranges. Raises ``IndexError`` for an index out of range, and
        what a read raises for a shard that cannot be opened."""
        return advise_samples(self, indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as ``{field: value}``: an array per ragged field, an array or numpy
        scalar per fixed field, a ``str``/``bytes`` per object field."""
        row = normalize_index(index, self._num_samples)
        batch = self.read_batch(np.array([row], np.int64))
        return {name: split_column(column)[0] for name, column in batch.items()}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The samples ``indices`` as a list of dicts, read in one vectorized pass (torch's
        DataLoader calls this for a whole batch)."""
        batch = self.read_batch(indices)
        columns = {name: split_column(column) for name, column in batch.items()}
        count = len(next(iter(columns.values()))) if columns else 0
        return [{name: values[i] for name, values in columns.items()} for i in range(count)]

    def close(self) -> None:
        """Close this process's file handles; idempotent, and the next read reopens them."""
        if self._process is not None and self._process.pid == os.getpid():
            self._process.close()
        self._process = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in _PER_PROCESS:
            state[key] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}: {f.kind} {f.dtype}{list(f.shape)}" for f in self._fields.values()
        )
        return (
            f"{type(self).__name__}({self._describe_files()}, {self._num_samples} samples,"
            f" fields {{{fields}}})"
        )

    # ---- internals -----------------------------------------------------------------------------

    def _describe_files(self) -> str:
        if len(self._files) == 1:
            return self._files[0]
        return f"{len(self._files)} shards {self._files[0]} .. {self._files[-1]}"

    def _process_state(self) -> ProcessState:
        process = self._process
        if process is None or process.pid != os.getpid():
            if process is not None:
                # A forked child must not read through handles inherited from its parent (HDF5
                # would serve the child's own open of the same file from that shared state);
                # closing them here releases only the child's copies.
                process.close()
            process = self._process = ProcessState(len(self._files), self._cache_bytes)
        return process

    def _reader_for_hints(self, shard: int) -> ShardReader | None:
        """The reader whose ``byte_ranges`` locate shard ``shard``'s samples for
        :meth:`willneed`: the one this process has open, else ``None``. A subclass opens one
        where opening changes no read."""
        process = self._process
        if process is None or process.pid != os.getpid():
            return None
        return process.readers[shard]

    def _shard(self, shard: int) -> ShardReader:
        """Shard ``shard``'s reader in this process, opened if it is not open."""
        process = self._process_state()
        reader = process.readers[shard]
        return reader if reader is not None else self._open(shard, process)

    def _reader_for_read(self, shard: int) -> ShardReader:
        """:meth:`_shard` for a read, which the shard source counts (a remote one: as a cache
        hit when the shard is open)."""
        process = self._process_state()
        reader = process.readers[shard]
        if reader is None:
            return self._open(shard, process)
        self._shards.read_again(shard, process)
        return reader

    def _open(self, shard: int, process: ProcessState) -> ShardReader:
        with process.lock:
            reader = process.readers[shard]
            if reader is None:
                reader = process.readers[shard] = self._shards.open(
                    shard, process, lambda file: self._open_shard(shard, file, process.cache)
                )
        return reader

    def _read(
        self,
        shard: int,
        name: str,
        local: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        *,
        in_place: bool = False,
    ) -> Column:
        def read(reader: ShardReader) -> Column:
            if offers(reader, ChecksMapped):
                cast(ChecksMapped, reader).check_mapped()
            if in_place and offers(reader, ReadsShardInPlace):
                return cast(Column, cast(ReadsShardInPlace, reader).read_in_place(name, local))
            return reader.read(name, local)

        try:
            return read(self._reader_for_read(shard))
        except (DataFormatError, StorageError):
            raise  # already names the file (or URL), the field and the sample
        except FileNotFoundError as exc:
            raise DataFileNotFoundError(
                f"{self._shard_name(shard)}: field {name!r}: a file is gone since the dataset"
                f" was created ({exc})",
                exc.filename or self._files[shard],
            ) from exc
        except self._read_errors as exc:
            shown = ", ".join(str(r) for r in rows[:8].tolist()) + (" ..." if len(rows) > 8 else "")
            raise DataFormatError(
                f"{self._shard_name(shard)}: field {name!r}: reading samples [{shown}] failed:"
                f" {type(exc).__name__}: {exc}"
            ) from exc

    def _read_across_shards(
        self, rows: npt.NDArray[np.int64], shard: npt.NDArray[np.intp]
    ) -> ColumnarBatch:
        order, groups = group_positions(shard)
        parts: dict[str, list[Column]] = {name: [] for name in self._fields}
        for group in groups:
            s = int(shard[group[0]])
            group_rows = rows[group]
            local = group_rows - self._shard_starts[s]
            for name in self._fields:
                parts[name].append(self._read(s, name, local, group_rows))
        inverse = inverse_permutation(order)
        return {name: permute_column(concat_columns(p), inverse) for name, p in parts.items()}
