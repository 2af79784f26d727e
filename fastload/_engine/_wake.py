"""Waking the engine thread from its poll: a non-blocking pipe it watches beside the workers'."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable


def _libc_write() -> Callable[[int, bytes, int], int]:
    """libc's ``write`` called with the GIL held (``ctypes.PyDLL``), or a stand-in returning -1
    where there is no libc to load."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return lambda fd, data, n: -1
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write


_write_holding_gil = _libc_write()


class Waker:
    """One pipe: :meth:`wake` from any thread, :attr:`fd` to poll, :meth:`drain` once woken."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        for fd in (self.fd, self._write_fd):
            os.set_blocking(fd, False)

    def wake(self) -> None:
        # Without releasing the GIL: os.write would hand it to the thread it wakes, and the
        # consumer would wait for the thread's work before its next() returns. This way the
        # thread runs when the consumer next blocks (its step) or after the switch interval.
        if _write_holding_gil(self._write_fd, b"\0", 1) < 0:
            with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: stopping
                os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        """Read every pending wake (the poll said :attr:`fd` is readable)."""
        with contextlib.suppress(OSError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        """Idempotent; a wake after it does nothing."""
        for fd in (self.fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self._write_fd = -1
