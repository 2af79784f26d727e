"""The exception tree of fastload.

Every error inherits :class:`FastloadError` *and* the builtin a caller would already catch for the
same situation (``ValueError`` for bad input, ``RuntimeError`` for a failed worker, ``KeyError`` for
a missing field, ``FileNotFoundError`` for a missing file), so code written against torch's
DataLoader keeps working unchanged.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any

__all__ = [
    "CacheError",
    "DataFileNotFoundError",
    "DataFormatError",
    "FastloadError",
    "FieldNotFoundError",
    "LoaderTimeoutError",
    "MissingExtraError",
    "OversizeSampleError",
    "PreflightWarning",
    "RebuiltLoaderWarning",
    "SharedMemoryError",
    "StorageChecksumError",
    "StorageError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "UnguardedMainError",
    "UniformLengthsWarning",
    "UnsupportedSchemeError",
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


class _FastloadOSError(FastloadError, OSError):
    """An ``OSError`` whose ``str()`` is fastload's whole message (``OSError`` would print
    ``[Errno N] ...`` instead), with ``errno``, ``strerror`` and ``filename`` set, and which
    pickles with all three (a worker's error travels to the main process)."""

    def __init__(
        self, message: str, filename: str | os.PathLike[str] | None = None, errno: int | None = None
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = None if errno is None else os.strerror(errno)
        self.filename = None if filename is None else os.fspath(filename)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        message = self.args[0] if self.args else ""
        return type(self), (message, self.filename, self.errno), self.__dict__ or None


class DataFileNotFoundError(DataFormatError, _FastloadOSError, FileNotFoundError):
    """A file or directory the caller named does not exist, a glob matches no file, a directory
    holds no data file, or a file has vanished since the dataset was created.

    A ``FileNotFoundError`` (so ``except OSError`` catches it too) and still a
    :class:`DataFormatError`; ``filename`` is the missing path (or the glob), ``errno`` is
    ``ENOENT``, and the message names the path.
    """

    def __init__(self, message: str, filename: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message, filename, _errno.ENOENT)

    def __reduce__(self) -> tuple[Any, ...]:
        message = self.args[0] if self.args else ""
        return type(self), (message, self.filename), self.__dict__ or None


class CacheError(_FastloadOSError):
    """The local cache directory (``cache_dir=``, ``FASTLOAD_CACHE``) cannot hold a file: it
    cannot be created, is read-only, or its disk is full. ``filename`` is the directory,
    ``errno`` that of the failed operation (``ENOSPC``, ``EROFS``, ``EACCES``, ...); the message
    names the directory and how to choose another. Nothing half-written is ever left where a
    reader would take it for data."""


class StorageError(_FastloadOSError):
    """Remote storage (S3 or an S3-compatible store, GCS, HTTPS) failed for good: a permanent
    error (403, a missing bucket), a transient one that outlasted the retry budget, or a
    checksum that stays wrong. ``filename`` is the URL; the message names it and the cause.
    A read through a dataset or a loader raises it as it is, so ``except StorageError``
    catches every storage failure."""


class StorageNotFoundError(StorageError, DataFileNotFoundError):
    """A remote object or bucket does not exist (404, NoSuchKey, NoSuchBucket): a
    ``FileNotFoundError``, and a :class:`DataFileNotFoundError` as a missing local file is."""


class StorageChecksumError(StorageError, DataFormatError):
    """An object's bytes do not match the size or SHA-256 the dataset's index gives, however
    often it is downloaded: it changed after it was indexed, or the store serves it damaged.
    A :class:`DataFormatError` too, as a damaged local file is."""


class StoragePermissionError(StorageError, PermissionError):
    """The store refused the request (403, AccessDenied, an invalid key)."""


class UnsupportedSchemeError(FastloadError, ValueError):
    """A path is a URL whose scheme fastload cannot read (``hdfs://``, ``file://``, a typo);
    the message names the scheme and the ones it reads."""


#: The name fastload is installed under from the package index (``fastload`` there is another
#: project); the import name stays ``fastload``.
DISTRIBUTION = "torch-fastload"


def install_command(extra: str) -> str:
    """The command that installs fastload with ``extra``, e.g. ``pip install 'torch-fastload[hf]'``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


class MissingExtraError(FastloadError, ImportError):
    """An optional dependency is not installed (or lacks a part fastload needs); the message
    names what needs it and, where an extra brings it, the extra and its install command
    (``pip install 'torch-fastload[hf]'``), which ``extra`` holds as ``"hf"``."""

    def __init__(self, message: str, extra: str | None = None) -> None:
        super().__init__(message)
        self.extra = extra

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0] if self.args else "", self.extra)

    @classmethod
    def for_extra(cls, needed_by: str, package: str, extra: str) -> MissingExtraError:
        """``needed_by`` (what the user asked for) needs ``package``, which ``extra`` installs."""
        return cls(
            f"{needed_by} needs the {package!r} package, which is not installed: "
            f"{install_command(extra)} (the {extra!r} extra)",
            extra,
        )


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


class UnguardedMainError(FastloadError, RuntimeError):
    """Workers start by ``spawn`` or ``forkserver`` (remote datasets' default), which re-run the
    main script in each worker, and the statement that starts them is not under
    ``if __name__ == "__main__":``: each worker would start workers of its own. The message names
    the script, the line and what to write."""


class LoaderTimeoutError(FastloadError, RuntimeError):
    """No batch arrived within the DataLoader's ``timeout`` (torch raises ``RuntimeError`` too)."""


class SharedMemoryError(FastloadError, OSError):
    """Shared memory for batch slots could not be created or mapped; the message says how much
    was needed and how to provide it."""


class UsageError(FastloadError, ValueError):
    """A command's options cannot work as given (a bad value, a tokenizer that cannot be loaded,
    fields that do not fit the input); the message names the option and what to change."""


class RebuiltLoaderWarning(UserWarning):
    """A ``fastload.DataLoader``'s batch sampler is iterated by a loader that is not fastload's:
    a framework (Accelerate's ``prepare``, ``transformers.Trainer``) rebuilt the loader as
    ``torch.utils.data.DataLoader``, so fastload's engine no longer loads the batches. The
    message names the supported call."""


class UniformLengthsWarning(UserWarning):
    """Every sample of the dataset has the same length, so length grouping or a token budget
    groups nothing (often a text column read as one value per sample). The message names the
    dataset and the field its lengths come from."""


class PreflightWarning(UserWarning):
    """A check run as a loader starts found something that will slow or break the run (a small
    ``/dev/shm``, a low open-file limit, a memory limit below the plan, a dataset of many Python
    objects, missing native kernels). The message says what to change; ``fastload doctor`` and
    ``fastload.doctor(loader)`` run every check and report them all."""
