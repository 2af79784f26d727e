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
    pos_size: int,
    /,
) -> None: ...

def gather_pack(
    values: Any,
    values_type: int,
    items: int,
    offsets: Any,
    plan: Any,
    out: Any,
    base: int,
    capacity: int,
    out_type: int,
    pad_int: int,
    pad_float: float,
    label_pad: int,
    seq_len: int,
    align: int,
    pos_size: int,
    labels: bool,
    /,
) -> tuple[int, int, int, int, int, int, int, int, int, int]: ...
