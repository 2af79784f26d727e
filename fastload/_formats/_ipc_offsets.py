"""The per-row lengths of one list column of an Arrow IPC *file*, read through ranged reads of
its footer, each record batch's metadata and that column's offsets buffer (and its validity
bitmap when it holds nulls): never its values, nor another column.

pyarrow selects what it reads by field (``IpcReadOptions.included_fields``), which would fetch
the list's values too: for a corpus of token ids, nearly the whole file. So this module reads
the format's flatbuffers itself (``File.fbs``: the footer's record batch blocks; ``Message.fbs``:
each batch's field nodes and buffers), a few dozen bytes of each. Layouts it does not know
(view types, unions, dictionaries before the column, a null parent struct) make
:func:`ipc_list_lengths` return ``None``, and the caller reads the field through pyarrow.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from fastload._formats._arrow_schema import storage_type
from fastload.errors import DataFormatError

#: ``read_at(offset, length)`` returns exactly those bytes of the file.
ReadAt = Callable[[int, int], bytes]
_MAGIC = b"ARROW1"
_RECORD_BATCH = 3  # MessageHeader.RecordBatch
_CODECS = {0: "lz4", 1: "zstd"}  # CompressionType: LZ4_FRAME, ZSTD


class _Table:
    """One flatbuffer table in ``data`` at ``at``: scalars, sub-tables and vectors by field."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at
        self._vtable = at - _i32(data, at)
        self._vsize = _u16(data, self._vtable)

    def _slot(self, field: int) -> int:
        entry = 4 + 2 * field
        return _u16(self.data, self._vtable + entry) if entry < self._vsize else 0

    def scalar(self, field: int, fmt: str, default: int) -> int:
        slot = self._slot(field)
        return int(struct.unpack_from("<" + fmt, self.data, self.at + slot)[0]) if slot else default

    def table(self, field: int) -> _Table | None:
        slot = self._slot(field)
        if not slot:
            return None
        where = self.at + slot
        return _Table(self.data, where + _u32(self.data, where))

    def structs(self, field: int, fmt: str) -> list[tuple[int, ...]]:
        """A vector of structs, each unpacked by ``fmt`` (little-endian, no padding)."""
        slot = self._slot(field)
        if not slot:
            return []
        where = self.at + slot
        start = where + _u32(self.data, where)
        count, size = _u32(self.data, start), struct.calcsize("<" + fmt)
        return [struct.unpack_from("<" + fmt, self.data, start + 4 + i * size) for i in range(count)]


def _root(data: bytes) -> _Table:
    return _Table(data, _u32(data, 0))


def _u16(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<H", data, at)[0])


def _u32(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<I", data, at)[0])


def _i32(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<i", data, at)[0])


def record_batch_blocks(read_at: ReadAt, size: int, tail: bytes) -> list[tuple[int, int]]:
    """``(offset, metadata length)`` of each record batch, from the file's footer (``tail``
    is the file's end; the footer is read through ``read_at`` when longer)."""
    if size < 10 + 2 * len(_MAGIC) or not tail.endswith(_MAGIC):
        raise DataFormatError("not an Arrow IPC file: no ARROW1 footer")
    footer_length = _i32(tail, len(tail) - 10)
    start = size - 10 - footer_length
    if footer_length <= 0 or start < 8:
        raise DataFormatError(f"an Arrow IPC footer of {footer_length} bytes cannot be")
    footer = tail[len(tail) - 10 - footer_length : len(tail) - 10] if footer_length <= len(tail) - 10 else read_at(start, footer_length)
    # Block: offset (int64), metaDataLength (int32), 4 bytes of padding, bodyLength (int64).
    return [(offset, meta) for offset, meta, _, _ in _root(footer).structs(3, "qiiq")]


def _locate(schema: pa.Schema, path: tuple[str, ...]) -> tuple[int, int, list[int], pa.DataType] | None:
    """The field node and first buffer of the field at ``path`` (a depth-first count over the
    schema, as IPC lays them out), its ancestors' nodes, and its type; ``None`` when a type on
    the way has a layout this module does not count."""
    node = buffer = 0

    def walk(t: pa.DataType, here: tuple[str, ...], parents: list[int]) -> tuple[int, int, list[int], pa.DataType] | None:
        nonlocal node, buffer
        t = storage_type(t)
        if here == path:
            return node, buffer, parents, t
        mine = node
        node += 1
        if pa.types.is_struct(t):
            buffer += 1
            for i in range(t.num_fields):
                found = walk(t.field(i).type, (*here, t.field(i).name), [*parents, mine])
                if found is not None or node < 0:
                    return found
            return None
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            buffer += 1 if pa.types.is_fixed_size_list(t) else 2
            return walk(t.value_type, (*here, "\0item"), [*parents, mine])
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            buffer += 3
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_fixed_size_binary(t):
            buffer += 2
        else:
            node = -(1 << 30)  # unknown layout: stop counting
        return None

    for column in schema:
        found = walk(column.type, (column.name,), [])
        if found is not None or node < 0:
            return found
    return None


def _batches(read_at: ReadAt, size: int, tail: bytes) -> list[tuple[int, _Table]]:
    """Each record batch's body offset and its ``RecordBatch`` table."""
    found = []
    for offset, meta_length in record_batch_blocks(read_at, size, tail):
        metadata = read_at(offset, meta_length)
        start = 8 if metadata[:4] == b"\xff\xff\xff\xff" else 4
        message = _root(metadata[start:])
        batch = message.table(2)
        if message.scalar(1, "B", 0) != _RECORD_BATCH or batch is None:
            raise DataFormatError(f"the block at byte {offset} is not a record batch")
        found.append((offset + meta_length, batch))
    return found


def ipc_rows(read_at: ReadAt, size: int, tail: bytes) -> int:
    """The rows of the IPC file's record batches, from their metadata alone."""
    return sum(batch.scalar(0, "q", 0) for _, batch in _batches(read_at, size, tail))


def ipc_list_lengths(
    read_at: ReadAt, size: int, tail: bytes, schema: pa.Schema, path: tuple[str, ...]
) -> npt.NDArray[np.int64] | None:
    """The length of each row's list in the field at ``path`` (a null list: 0) across the
    record batches of the IPC file ``read_at`` reads (``size`` bytes, ending with ``tail``),
    or ``None`` where its layout is not one this module reads (see the module text)."""
    located = _locate(schema, path)
    if located is None:
        return None
    node, first_buffer, parents, kind = located
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return None
    offset_type = np.dtype("<i8") if pa.types.is_large_list(kind) else np.dtype("<i4")
    parts = []
    for body, batch in _batches(read_at, size, tail):
        nodes, buffers = batch.structs(1, "qq"), batch.structs(2, "qq")
        compression = batch.table(3)
        codec = None if compression is None else _CODECS.get(compression.scalar(0, "b", 0))
        if compression is not None and codec is None:
            return None
        if any(nodes[p][1] for p in parents):
            return None  # a null parent struct: its children's slots are not to be trusted
        rows, nulls = nodes[node]
        if rows == 0:
            continue
        offsets = np.frombuffer(_buffer(read_at, body, buffers[first_buffer + 1], codec), offset_type, count=rows + 1)
        lengths = np.diff(offsets.astype(np.int64))
        if nulls:
            bitmap = _buffer(read_at, body, buffers[first_buffer], codec)
            valid = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")[:rows].astype(bool)
            lengths[~valid] = 0
        parts.append(lengths)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _buffer(read_at: ReadAt, body: int, buffer: tuple[int, ...], codec: str | None) -> bytes:
    """One buffer of the record batch whose body starts at ``body``, decompressed (a compressed
    buffer starts with its plain length, -1 when it was stored plain)."""
    where, length = buffer
    data = read_at(body + where, length) if length else b""
    if codec is None or not data:
        return data
    plain = int(struct.unpack_from("<q", data, 0)[0])
    if plain == -1:
        return data[8:]
    return bytes(pa.decompress(data[8:], decompressed_size=plain, codec=codec, asbytes=True))


__all__ = ["ReadAt", "ipc_list_lengths", "ipc_rows", "record_batch_blocks"]
