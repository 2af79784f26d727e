"""How a generic-path batch crosses from a worker to the main process.

Results are pickled with multiprocessing's ``ForkingPickler``, for which ``torch.multiprocessing``
registers reducers that move a tensor's storage into shared memory and pass only a file
descriptor. We add the same for numpy arrays: a large numeric array travels as a shared-memory
tensor and comes back as a numpy view of it, so no payload is copied through the pipe as bytes.
Small tensors and arrays (under ``INLINE_BYTES``) are cheaper to pickle inline than to share.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing

INLINE_BYTES = 16 * 1024


def _rebuild_ndarray(tensor: torch.Tensor, dtype: np.dtype, fortran: bool) -> np.ndarray:
    arr = tensor.numpy().view(dtype)
    return arr.T if fortran else arr


def _reduce_ndarray(arr: np.ndarray) -> Any:
    """Share a large numeric array's memory; it arrives as pickle would deliver it: a Fortran-
    ordered array stays Fortran-ordered, any other layout becomes C-contiguous, and the result
    is writeable."""
    if arr.nbytes >= INLINE_BYTES and arr.dtype.isnative and arr.dtype.kind in "biufc":
        fortran = arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous
        data = arr.T if fortran else arr
        if not (data.flags.c_contiguous and data.flags.writeable):
            data = np.array(data, order="C")
        try:
            tensor = torch.from_numpy(data)
        except TypeError:  # a dtype torch has no tensor type for
            pass
        else:
            return _rebuild_ndarray, (tensor, arr.dtype, fortran)
    return arr.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _rebuild_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


_torch_reduce_tensor = ForkingPickler._extra_reducers[torch.Tensor]  # type: ignore[attr-defined]


def _reduce_tensor(t: torch.Tensor) -> Any:
    """A small, contiguous CPU tensor travels inline, by value: sharing it would cost a new
    shared-memory block and a file-descriptor round trip per tensor (milliseconds), far more
    than copying a few kilobytes. Everything else is shared as torch shares it."""
    if (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_nested  # strided too, but no flat buffer of its shape: torch's reducer
        and not t.requires_grad
        and not t.is_quantized
        and t.is_contiguous()
        and t.numel() * t.element_size() < INLINE_BYTES
    ):
        return _rebuild_tensor, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))
    return _torch_reduce_tensor(t)


class _ResultPickler(ForkingPickler):
    _extra_reducers = {
        **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        np.ndarray: _reduce_ndarray,
        torch.Tensor: _reduce_tensor,
    }
    _copyreg_dispatch_table = copyreg.dispatch_table


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _ResultPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getbuffer().tobytes()


loads = pickle.loads


def is_pickle(payload: bytes) -> bool:
    """Whether a message is a pickle (protocol 2 and up start with PROTO, 0x80), as opposed to a
    codec's own binary message, which starts with a letter."""
    return payload[:1] == b"\x80"


def dumps_task(msg: Any) -> bytes:
    """A task message (indices, slot references): plain pickle, no shared-memory reducers."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


# multiprocessing.Connection's framing, which both ends may write with send_bytes: a signed
# big-endian 4-byte length, or -1 followed by an unsigned 8-byte length for large messages.
_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


def frame(payload: bytes) -> bytes:
    """``payload`` in Connection's framing (what ``Connection.recv_bytes`` reads)."""
    if len(payload) > 0x7FFFFFFF:
        return _HEADER.pack(-1) + _LONG_HEADER.pack(len(payload)) + payload
    return _HEADER.pack(len(payload)) + payload


def write_frame(fd: int, payload: bytes) -> None:
    """Write one message in Connection's framing to the blocking or non-blocking pipe ``fd``,
    whole: a short write is continued (a non-blocking pipe that is full raises
    ``BlockingIOError``)."""
    size = len(payload)  # frame(), without the call for the short header: once per batch
    data = _HEADER.pack(size) + payload if size <= 0x7FFFFFFF else frame(payload)
    written = os.write(fd, data)
    if written < len(data):  # a pipe that was nearly full
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]


def take_frames(inbox: bytearray, decode: Callable[[bytes], Any] = pickle.loads) -> list[Any]:
    """Decode every whole message at the front of ``inbox`` (bytes read raw from a pipe in
    Connection's framing) and remove them from it; a message cut off stays for the next read.
    ``decode`` turns one message's bytes into the message (a pickle, unless the sender's codec
    wrote its own format: see :func:`is_pickle`)."""
    out: list[Any] = []
    start, end = 0, len(inbox)
    while end - start >= _HEADER.size:
        (size,) = _HEADER.unpack_from(inbox, start)
        head = _HEADER.size
        if size == -1:
            if end - start < head + _LONG_HEADER.size:
                break
            (size,) = _LONG_HEADER.unpack_from(inbox, start + head)
            head += _LONG_HEADER.size
        if end - start - head < size:
            break
        out.append(decode(bytes(inbox[start + head : start + head + size])))
        start += head + size
    del inbox[:start]
    return out
