"""Type stub of the native padding kernel (``_native.c``)."""

from typing import Any

def pad_rows(
    source: Any,
    source_type: int,
    starts: Any,
    kept: Any,
    out: Any,
    out_type: int,
    width: int,
    items: int,
    pad_int: int,
    pad_float: float,
    left: bool,
    mask: Any | None,
    mask_type: int,
    /,
) -> None: ...

def pack_rows(
    source: Any,
    source_type: int,
    items: int,
    starts: Any,
    lengths: Any,
    row_offsets: Any,
    out: Any,
    out_type: int,
    seq_len: int,
    pad_int: int,
    pad_float: float,
    labels: Any | None,
    label_pad: int,
    positions: Any | None,
    documents: Any | None,
    /,
) -> None: ...
