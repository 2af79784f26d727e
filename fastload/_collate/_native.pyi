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
