"""Vectorized padding of one ragged column into caller-provided arrays.

The **native** kernel (``_native.c``, built with the package; numpy kernels below stand in where
it is missing or a dtype is not one it knows) copies each row once, converting as it goes, pads
it and writes its mask in the same pass: it writes every output byte once and reads only the
real elements. On 64 random token-id rows of a 200 MB memory map (uint16 in, int64 ids and a
bool mask out, ~1,200 wide) it takes about 28 µs against 78 µs for the window kernel: 24 GB/s
of output, about what a ``memset`` of the same bytes reaches here.

Two numpy kernels, measured on 64 token-id rows (int32 in, int64 ids and int64 mask out) on the
development machine (benchmarks/bench_sampling.py has the current figures):

* **mask** — the row mask is gathered from a sliding window over a ``1…1 0…0`` staircase (one
  contiguous row copy per row, in C), then ``out.fill(pad)`` and ``out[mask] = values``: a few
  whole-array passes and no Python per row. About 2x faster than a per-row loop at 64 rows of
  200 tokens, 10x at 1,024 rows, and still ahead up to rows of ~24 KiB of output.
* **rows** — one slice copy per row for the values and the mask. Beyond ~24 KiB per row the
  Python cost per row vanishes behind the copies, and plain slice copies beat the boolean
  scatter.

``pad_into`` picks by the padded row size in bytes; both kernels write identical output.

With ``starts`` the rows are not back to back but lie anywhere in ``values`` (a reader's memory
map, see ``Spans``). Then a third kernel, **window**, gathers each row's ``width`` elements from
``values[start:]`` in one fancy index over a sliding-window view (one contiguous copy per row, in
C) and zeroes the padding with the mask in the narrower of the source and output dtypes before
one casting copy: no concatenated copy of the samples, no ``fill`` and no boolean scatter. It reads past each sample into its
neighbours, which the mask discards; rows whose window would leave ``values`` fall back to one
slice copy per row.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import numpy.typing as npt

_native: ModuleType | None
try:
    from fastload._collate import _native
except ImportError:  # built without a C compiler: the numpy kernels do all the work
    _native = None

#: Bytes per padded output row from which one slice copy per row beats the mask kernel.
ROW_COPY_MIN_BYTES = 24576

#: The element types the native kernel converts between, numbered as ``_native.c`` numbers them.
NATIVE_TYPES: dict[np.dtype, int] = {
    np.dtype(t): code
    for code, t in enumerate(
        (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
         np.uint64, np.float32, np.float64)
    )
}

# The widest staircase built so far for each side (see row_mask): every narrower mask is a
# window of it, so it is built once, not once per batch. Never written after it is built.
_staircases: dict[bool, np.ndarray] = {}


def row_mask(lengths: npt.NDArray[np.int64], width: int, *, left: bool) -> npt.NDArray[np.bool_]:
    """``[B, width]`` booleans, True where a row holds a real element: its first ``lengths[i]``
    columns, or its last ones with ``left``."""
    staircase = _staircases.get(left)
    if staircase is None or staircase.shape[0] < 2 * width:
        # ``span`` of one value then ``span`` of the other (True first for right padding).
        span = max(width, 64)
        staircase = np.empty(2 * span, dtype=bool)
        staircase[:span] = not left
        staircase[span:] = left
        _staircases[left] = staircase
    span = staircase.shape[0] // 2
    # Window k is the staircase from column k: (span - k) of one value, then the other. Right
    # padding takes the window with exactly lengths[i] Trues before the Falses, left padding
    # the one with width - lengths[i] Falses before the Trues. Built as a strided view directly
    # (sliding_window_view costs more than the gather here).
    windows = np.ndarray((span + 1, width), dtype=bool, buffer=staircase, strides=(1, 1))
    return windows[span - lengths] if not left else windows[span - width + lengths]


def pad_into(
    values: np.ndarray,
    lengths: npt.NDArray[np.int64],
    kept: npt.NDArray[np.int64],
    out: np.ndarray,
    *,
    pad_value: int | float | bool,
    left: bool,
    mask_out: np.ndarray | None,
    starts: npt.NDArray[np.int64] | None = None,
) -> None:
    """Write the ragged rows ``values`` (row ``i`` has ``lengths[i]`` elements, back to back, or
    at ``values[starts[i]:]`` when ``starts`` is given) into ``out`` (``[B, L, *elem]``), keeping
    each row's first ``kept[i] <= lengths[i]`` elements and padding the rest of the row with
    ``pad_value``; write the row mask (1 on kept elements) into ``mask_out`` (``[B, L]``) when
    given."""
    rows, width = out.shape[0], out.shape[1]
    if rows == 0:
        return
    if _native is not None and _native_rows(
        values, lengths, kept, out, pad_value=pad_value, left=left, mask_out=mask_out, starts=starts
    ):
        return
    if starts is not None:
        if out.nbytes // rows >= ROW_COPY_MIN_BYTES or not _window_rows(
            values, starts, kept, out, pad_value=pad_value, left=left, mask_out=mask_out
        ):
            _copy_rows(values, starts, kept, out, pad_value=pad_value, left=left, mask_out=mask_out)
        return
    starts = _back_to_back(lengths)
    if out.nbytes // rows >= ROW_COPY_MIN_BYTES:
        _copy_rows(values, starts, kept, out, pad_value=pad_value, left=left, mask_out=mask_out)
        return
    mask = row_mask(kept, width, left=left)
    if kept is not lengths and not np.array_equal(kept, lengths):
        values = values[_kept_elements(starts, lengths, kept)]
    out.fill(pad_value)
    out[mask] = values
    if mask_out is not None:
        np.copyto(mask_out, mask)


def pack_into(
    source: np.ndarray,
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    row_offsets: npt.NDArray[np.int64],
    out: np.ndarray,
    *,
    pad_value: int | float | bool,
    labels: np.ndarray | None = None,
    label_pad: int = -100,
    positions: np.ndarray | None = None,
    documents: np.ndarray | None = None,
) -> bool:
    """Packed rows in one native pass (``pack_rows`` in ``_native.c``): row ``r`` of ``out``
    (``[B, L, *elem]``) gets the pieces ``row_offsets[r]:row_offsets[r + 1]`` back to back,
    piece ``p`` being ``source[starts[p]:starts[p] + lengths[p]]``, then ``pad_value``; and,
    where given, the int64 ``labels`` (the values, ``label_pad`` on each piece's first element
    and on the padding), int64 or int32 ``positions`` and int32 ``documents`` of those rows. ``False``
    (nothing written) where the kernel is not built or does not take the layout or dtypes: the
    caller's numpy code does the work then."""
    if _native is None:
        return False
    source_type, out_type = NATIVE_TYPES.get(source.dtype), NATIVE_TYPES.get(out.dtype)
    if source_type is None or out_type is None:
        return False
    if not (source.flags.c_contiguous and out.flags.c_contiguous):
        return False
    extras = (labels, positions, documents)
    if any(a is not None and not a.flags.c_contiguous for a in extras):
        return False
    if positions is not None and positions.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        return False
    real = out_type >= NATIVE_TYPES[np.dtype(np.float32)]
    _native.pack_rows(
        source,
        source_type,
        math.prod(source.shape[1:]),
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int64),
        np.ascontiguousarray(row_offsets, dtype=np.int64),
        out,
        out_type,
        out.shape[1],
        0 if real else int(pad_value),
        float(pad_value),
        labels,
        int(label_pad),
        positions,
        documents,
        8 if positions is None else positions.dtype.itemsize,
    )
    return True


def _back_to_back(lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Where each row starts when the rows lie back to back."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def _native_rows(
    values: np.ndarray,
    lengths: npt.NDArray[np.int64],
    kept: npt.NDArray[np.int64],
    out: np.ndarray,
    *,
    pad_value: int | float | bool,
    left: bool,
    mask_out: np.ndarray | None,
    starts: npt.NDArray[np.int64] | None,
) -> bool:
    """The native kernel; ``False`` (nothing written) for a layout or dtype it does not take."""
    assert _native is not None
    source_type = NATIVE_TYPES.get(values.dtype)
    out_type = NATIVE_TYPES.get(out.dtype)
    mask_type = NATIVE_TYPES.get(mask_out.dtype) if mask_out is not None else 0
    if source_type is None or out_type is None or mask_type is None:
        return False  # float16, complex, a byte-swapped dtype: numpy converts those
    if not (values.flags.c_contiguous and out.flags.c_contiguous):
        return False
    if mask_out is not None and not mask_out.flags.c_contiguous:
        return False
    if starts is None:
        starts = _back_to_back(lengths)
    elif starts.dtype != np.int64 or not starts.flags.c_contiguous:
        starts = np.ascontiguousarray(starts, dtype=np.int64)
    if kept.dtype != np.int64 or not kept.flags.c_contiguous:
        kept = np.ascontiguousarray(kept, dtype=np.int64)
    real = out_type >= NATIVE_TYPES[np.dtype(np.float32)]
    _native.pad_rows(
        values,
        source_type,
        starts,
        kept,
        out,
        out_type,
        out.shape[1],
        math.prod(values.shape[1:]),
        0 if real else int(pad_value),
        float(pad_value),
        left,
        mask_out,
        mask_type,
    )
    return True


def _window_rows(
    values: np.ndarray,
    starts: npt.NDArray[np.int64],
    kept: npt.NDArray[np.int64],
    out: np.ndarray,
    *,
    pad_value: int | float | bool,
    left: bool,
    mask_out: np.ndarray | None,
) -> bool:
    """The window kernel; ``False`` (nothing written) when a row's window leaves ``values``."""
    width = out.shape[1]
    count = values.shape[0]
    if width == 0 or width > count:
        return False
    first = starts + kept - width if left else starts
    if int(first.min()) < 0 or int(first.max()) > count - width:
        return False
    elem = values.shape[1:]
    shape, strides = (count - width + 1, width, *elem), (values.strides[0], *values.strides)
    if values.flags.c_contiguous:  # a strided view without as_strided's Python overhead
        windows = np.ndarray(shape, values.dtype, buffer=values, strides=strides)
    else:
        windows = np.lib.stride_tricks.as_strided(values, shape, strides, writeable=False)
    gathered = windows[first]  # a fresh [B, width, *elem] copy in the source dtype
    mask = row_mask(kept, width, left=left)
    where = mask.reshape(mask.shape + (1,) * len(elem))
    if pad_value == 0 and values.dtype.kind in "biu":
        # Zero the padding by multiplying with the 0/1 mask, in whichever of the source and the
        # output dtype is narrower (uint16 ids padded into int64: the mask pass runs on a
        # quarter of the bytes), then one plain casting copy; no casting ufunc loop.
        if out.dtype == values.dtype:
            np.multiply(gathered, where, out=out)
        elif values.dtype.itemsize <= out.dtype.itemsize:
            np.multiply(gathered, where, out=gathered)
            np.copyto(out, gathered, casting="unsafe")
        else:
            np.copyto(out, gathered, casting="unsafe")
            np.multiply(out, where, out=out)
    else:  # floats: NaN * 0 is NaN, so copy under the mask instead
        out.fill(pad_value)
        np.copyto(out, gathered, casting="unsafe", where=where)
    if mask_out is not None:
        np.copyto(mask_out, mask)
    return True


def _copy_rows(
    values: np.ndarray,
    starts: npt.NDArray[np.int64],
    kept: npt.NDArray[np.int64],
    out: np.ndarray,
    *,
    pad_value: int | float | bool,
    left: bool,
    mask_out: np.ndarray | None,
) -> None:
    width = out.shape[1]
    rows = enumerate(zip(starts.tolist(), kept.tolist(), strict=True))
    # Separate loops per side: plain slices per row, nothing else, as this loop is the cost.
    if left:
        for row, (start, count) in rows:
            cut = width - count
            out[row, cut:] = values[start : start + count]
            out[row, :cut] = pad_value
            if mask_out is not None:
                mask_out[row, cut:] = 1
                mask_out[row, :cut] = 0
    else:
        for row, (start, count) in rows:
            out[row, :count] = values[start : start + count]
            out[row, count:] = pad_value
            if mask_out is not None:
                mask_out[row, :count] = 1
                mask_out[row, count:] = 0


def _kept_elements(
    starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], kept: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """Which elements of the concatenated rows survive truncation to ``kept`` per row."""
    position_in_row = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
    return position_in_row < np.repeat(kept, lengths)
