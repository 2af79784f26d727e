"""Vectorized padding of one ragged column into caller-provided arrays.

Two kernels, measured on 64 token-id rows (int32 in, int64 ids and int64 mask out) on the
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

import numpy as np
import numpy.typing as npt

#: Bytes per padded output row from which one slice copy per row beats the mask kernel.
ROW_COPY_MIN_BYTES = 24576


def row_mask(lengths: npt.NDArray[np.int64], width: int, *, left: bool) -> npt.NDArray[np.bool_]:
    """``[B, width]`` booleans, True where a row holds a real element: its first ``lengths[i]``
    columns, or its last ones with ``left``."""
    real_first = not left
    staircase = np.empty(2 * width, dtype=bool)
    staircase[:width] = real_first
    staircase[width:] = not real_first
    # Window k is the staircase from column k: (width - k) of one value, then k of the other.
    # Built as a strided view directly (sliding_window_view costs more than the gather here).
    windows = np.ndarray((width + 1, width), dtype=bool, buffer=staircase, strides=(1, 1))
    return windows[width - lengths] if real_first else windows[lengths]


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
    if starts is not None:
        if out.nbytes // rows >= ROW_COPY_MIN_BYTES or not _window_rows(
            values, starts, kept, out, pad_value=pad_value, left=left, mask_out=mask_out
        ):
            _copy_rows(values, starts, kept, out, pad_value=pad_value, left=left, mask_out=mask_out)
        return
    starts = np.zeros(rows, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
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
