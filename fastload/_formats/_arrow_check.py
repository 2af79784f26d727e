"""Structural checks of a decoded Arrow record batch before any of it is read.

pyarrow reads an IPC file's buffers as they are written: a list offset that points past its
values makes a read return the bytes that follow (another column's, or the next batch's) as
part of a sample, and the memory-mapped fast path gathers through the offsets with numpy, with
no check at all. So every record batch is checked once, when it is first decoded in a process:
the offsets of each variable-size array on a field's path are non-decreasing and inside their
values (vectorized, a few bytes per row, the offsets only), then pyarrow's cheap validation
(``validate()`` without ``full``: buffer sizes against lengths, never the payload).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from fastload._formats._arrow_schema import ArrowField, field_array, storage_array
from fastload.errors import DataFormatError


def check_batch(
    batch: pa.RecordBatch, fields: dict[str, ArrowField], first_sample: int, path: str
) -> None:
    """Raise :class:`DataFormatError` naming ``path``, the field and the first damaged sample
    (``first_sample`` is the dataset index of the batch's row 0) for a record batch whose
    offsets or buffers of one of ``fields`` do not fit together."""
    for name, spec in fields.items():
        array = field_array(batch, spec.path)
        where = f"{path}: field {name!r}"
        _check_offsets(storage_array(array), first_sample, where)
        try:
            array.validate()
        except pa.ArrowInvalid as exc:
            last = first_sample + len(array) - 1
            raise DataFormatError(
                f"{where}: the record batch of samples {first_sample}..{last} is damaged"
                f" ({exc}); the file was truncated or overwritten: write it again"
            ) from exc


def _check_offsets(array: pa.Array, first_sample: int, where: str) -> None:
    """The offsets of ``array`` (a list, string or binary array; other types pass) against its
    values: non-negative, non-decreasing, the last within the values."""
    t = array.type
    if pa.types.is_list(t) or pa.types.is_string(t) or pa.types.is_binary(t):
        dtype: np.dtype = np.dtype("<i4")
    elif pa.types.is_large_list(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        dtype = np.dtype("<i8")
    else:
        return
    if len(array) == 0:
        return
    buffers = array.buffers()
    needed = array.offset + len(array) + 1
    if buffers[1] is None or buffers[1].size < needed * dtype.itemsize:
        held = 0 if buffers[1] is None else buffers[1].size // dtype.itemsize
        raise DataFormatError(
            f"{where}: the record batch of samples {first_sample}..{first_sample + len(array) - 1}"
            f" has {held} offsets, expected {needed}; the file is damaged: write it again"
        )
    offsets = np.frombuffer(buffers[1], dtype, count=needed)[array.offset :]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        available, unit = len(array.values), "values"
    else:
        available, unit = 0 if buffers[2] is None else buffers[2].size, "bytes"
    if offsets[0] < 0:
        raise DataFormatError(
            f"{where}: sample {first_sample} starts at offset {int(offsets[0])}, expected an"
            " offset >= 0; the file is damaged: write it again"
        )
    decreasing = offsets[1:] < offsets[:-1]
    if decreasing.any():
        row = int(np.argmax(decreasing))
        raise DataFormatError(
            f"{where}: sample {first_sample + row} ends at offset {int(offsets[row + 1])},"
            f" before its start {int(offsets[row])}; offsets must be non-decreasing: the file"
            " is damaged, write it again"
        )
    if offsets[-1] > available:
        row = int(np.argmax(offsets[1:] > available))
        raise DataFormatError(
            f"{where}: sample {first_sample + row} ends at offset {int(offsets[row + 1])}, past"
            f" the {available} {unit} its record batch holds; the file is damaged: write it"
            " again"
        )
