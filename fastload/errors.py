"""The exception tree of fastload.

Every error inherits :class:`FastloadError` *and* the builtin a caller would already catch for the
same situation (``ValueError`` for bad input, ``RuntimeError`` for a failed worker, ``KeyError`` for
a missing field), so code written against torch's DataLoader keeps working unchanged.
"""

from __future__ import annotations

__all__ = [
    "DataFormatError",
    "FastloadError",
    "FieldNotFoundError",
    "LoaderTimeoutError",
    "OversizeSampleError",
    "SharedMemoryError",
    "UsageError",
    "WorkerCrashedError",
]


class FastloadError(Exception):
    """Base class of every error fastload raises on purpose."""


class DataFormatError(FastloadError, ValueError):
    """A file is missing, unreadable or not laid out as expected.

    The message names the file, the field, the sample index where there is one, and what was
    expected instead.
    """


class FieldNotFoundError(DataFormatError, KeyError):
    """A requested field does not exist; the message lists the fields that do."""

    def __str__(self) -> str:  # KeyError would repr() the message and escape its newlines
        return str(self.args[0]) if self.args else ""


class OversizeSampleError(FastloadError, ValueError):
    """A sample is longer than the token budget and the ``oversize`` policy is ``"error"``."""


class WorkerCrashedError(FastloadError, RuntimeError):
    """A worker process died, or a batch killed every worker that tried it.

    ``RuntimeError`` is what torch's DataLoader raises for a dead worker, so existing handlers
    keep catching it.
    """


class LoaderTimeoutError(FastloadError, RuntimeError):
    """No batch arrived within the DataLoader's ``timeout`` (torch raises ``RuntimeError`` too)."""


class SharedMemoryError(FastloadError, OSError):
    """Shared memory for batch slots could not be created or mapped; the message says how much
    was needed and how to provide it."""


class UsageError(FastloadError, ValueError):
    """A command's options cannot work as given (a bad value, a tokenizer that cannot be loaded,
    fields that do not fit the input); the message names the option and what to change."""
