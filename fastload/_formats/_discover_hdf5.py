"""The fields, length field and lengths of one remote HDF5 shard in the fastload layout, read by
h5py through ranged reads of aligned blocks: the metadata (superblock, object headers, B-trees;
usually at the start of the file and beside each dataset) and the ``offsets`` dataset of each
ragged field plus ``/lengths`` where several ragged fields could be the one it describes;
never a ``values`` dataset or another field's data.

A ragged field stored as a variable-length dataset has no offsets to read (its lengths are in
the heap, with its values): such a shard is refused with an error naming ``fastload index``.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import h5py
import numpy as np
import numpy.typing as npt

from fastload._formats._hdf5_layout import LENGTHS_INDEX, common_num_samples, scan, select
from fastload._formats._validate import lengths_from_offsets
from fastload._types import Field
from fastload.errors import DataFileNotFoundError, DataFormatError, FastloadError

#: h5py reads metadata a few hundred bytes at a time; reads go to the store in aligned blocks
#: of this size, each fetched once (neighbouring missing blocks in one request).
BLOCK_BYTES = 64 << 10


class RangedFile(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes whose bytes come from ``read_at(offset,
    length)`` (a remote object's ranged reads); a subclass says how it reads."""

    def __init__(self, read_at: Callable[[int, int], bytes], size: int) -> None:
        super().__init__()
        self._read_at, self._size = read_at, size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position


class BlockFile(RangedFile):
    """A read-only file of ``size`` bytes over ``read_at(offset, length)``, fetched in aligned
    blocks of :data:`BLOCK_BYTES` kept for the file's life (a shard's metadata and offsets:
    small). For one thread."""

    def __init__(self, read_at: Callable[[int, int], bytes], size: int) -> None:
        super().__init__(read_at, size)
        self._blocks: dict[int, bytes] = {}
        self.failure: BaseException | None = None  # the store's error: h5py reports its own

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        start = min(self._position, self._size)
        end = min(start + len(buffer), self._size)
        if end <= start:
            return 0
        first, last = start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        missing = [b for b in range(first, last + 1) if b not in self._blocks]
        while missing:  # one request per run of neighbouring missing blocks
            run = 1
            while run < len(missing) and missing[run] == missing[0] + run:
                run += 1
            offset = missing[0] * BLOCK_BYTES
            try:
                data = self._read_at(offset, min(run * BLOCK_BYTES, self._size - offset))
            except BaseException as exc:
                self.failure = exc
                raise
            for i in range(run):
                self._blocks[missing[i]] = data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]
            missing = missing[run:]
        joined = b"".join(self._blocks[b] for b in range(first, last + 1))
        skip = start - first * BLOCK_BYTES
        memoryview(buffer)[: end - start] = joined[skip : skip + end - start]
        self._position = end
        return end - start


def describe_hdf5(
    url: str, read_at: Callable[[int, int], bytes], size: int, remedy: str
) -> tuple[dict[str, Field], str | None, npt.NDArray[np.int64]]:
    """What the HDF5 shard at ``url`` holds (see the module text): all its fields, the default
    length field (the one ``/lengths`` describes, else the first ragged one) and its lengths.
    ``remedy`` ends the error for a shard whose lengths cannot be read so."""
    remote = BlockFile(read_at, size)
    try:
        with h5py.File(remote, "r") as file:
            contents = scan(file, url)
            fields = select(contents, None, url)
            if not fields:
                raise DataFormatError(f"{url}: holds no dataset that could be a field")
            samples = common_num_samples(fields, contents, url)
            ragged = [name for name, spec in fields.items() if spec.field.kind == "ragged"]
            lengths: dict[str, npt.NDArray[np.int64]] = {}
            for name in ragged:
                spec = fields[name]
                if spec.storage != "offsets":
                    raise DataFileNotFoundError(
                        f"{url}: ragged field {name!r} is a variable-length dataset, whose lengths "
                        f"are read only with its values; {remedy}",
                        url,
                    )
                group = file[spec.path]
                where = f"{url}: field {name!r} ({spec.path}/offsets)"
                lengths[name] = lengths_from_offsets(np.asarray(group["offsets"][...]), group["values"].shape[0], where=where)
            chosen = contents.lengths_index_field if contents.lengths_index_field in lengths else None
            if chosen is None and contents.has_lengths_index and len(ragged) > 1:
                stored = np.asarray(file[LENGTHS_INDEX][...], dtype=np.int64)
                chosen = next((n for n in ragged if np.array_equal(lengths[n], stored)), None)
            chosen = chosen if chosen is not None else next(iter(ragged), None)
    except OSError as exc:
        if remote.failure is not None:
            raise remote.failure from None
        if isinstance(exc, FastloadError):
            raise
        raise DataFormatError(f"{url}: cannot be read as HDF5; it is truncated or damaged ({exc})") from exc
    described = {name: spec.field for name, spec in fields.items()}
    return described, chosen, lengths[chosen] if chosen is not None else np.ones(samples, np.int64)


__all__ = ["BLOCK_BYTES", "BlockFile", "RangedFile", "describe_hdf5"]
