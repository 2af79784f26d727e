"""Byte streams of text inputs, transparently decompressed, read in blocks of whole lines.

Progress is counted in bytes *on disk* (compressed bytes for a compressed file), so that the
total is known from the file sizes before reading and the bar can show an ETA.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import BinaryIO

import numpy as np

from fastload._apps._convert._discover import InputFile
from fastload.errors import DataFormatError, MissingExtraError

BOM = b"\xef\xbb\xbf"


class ByteStream:
    """One input file as decompressed bytes; :meth:`consumed` reports on-disk bytes read since
    its last call. Corrupt compressed data raises DataFormatError naming the file."""

    def __init__(self, file: InputFile) -> None:
        self.file = file
        self._raw = file.path.open("rb")
        self._stream: BinaryIO = self._raw
        self._reported = 0
        if file.compression == "gzip":
            self._stream = gzip.GzipFile(fileobj=self._raw, mode="rb")  # type: ignore[assignment]
        elif file.compression == "zstd":
            try:
                import zstandard
            except ImportError as exc:
                self._raw.close()
                raise MissingExtraError.for_extra(
                    f"{file.display}: reading .zst files", "zstandard", "convert"
                ) from exc
            reader = zstandard.ZstdDecompressor().stream_reader(self._raw, read_across_frames=True)
            self._stream = io.BufferedReader(reader)

    def _guard(self, exc: Exception) -> DataFormatError:
        kind = self.file.compression or "input"
        return DataFormatError(f"{self.file.display}: corrupt or truncated {kind} data ({exc})")

    def _guarded(self, read: Callable[[], bytes]) -> bytes:
        try:
            return read()
        except (OSError, EOFError, zlib.error) as exc:
            raise self._guard(exc) from exc
        except Exception as exc:  # zstandard.ZstdError derives from Exception only
            if type(exc).__module__.startswith("zstandard"):
                raise self._guard(exc) from exc
            raise

    def read(self, size: int = -1) -> bytes:
        return self._guarded(lambda: self._stream.read(size))

    def readline(self) -> bytes:
        return self._guarded(self._stream.readline)

    def lines(self) -> Iterator[bytes]:
        """Lines including their ``\\n`` (the last one may lack it), BOM removed."""
        line = self.readline().removeprefix(BOM)
        while line:
            yield line
            line = self.readline()

    def consumed(self) -> int:
        position = self._raw.tell() if not self._raw.closed else self.file.size
        delta = position - self._reported
        self._reported = position
        return delta

    def rest(self) -> int:
        """On-disk bytes not yet reported: called at the end so the totals match file sizes."""
        delta = self.file.size - self._reported
        self._reported = self.file.size
        return delta

    def close(self) -> None:
        self._stream.close()
        self._raw.close()

    def __enter__(self) -> ByteStream:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def line_blocks(stream: ByteStream, block_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(first line number, whole lines)`` blocks of about ``block_bytes``, BOM removed.

    Each block is one read plus the rest of its last line (one copy of the data, not two); a
    line longer than a block is simply read whole.
    """
    line = 1
    first = True
    while True:
        block = stream.read(block_bytes)
        if first:
            block = block.removeprefix(BOM)
            first = False
        if not block:
            return
        if not block.endswith(b"\n"):
            block += stream.readline()
        yield line, block
        line += int(np.count_nonzero(np.frombuffer(block, dtype=np.uint8) == 10))  # 2x bytes.count


def read_all(stream: ByteStream) -> bytes:
    return stream.read().removeprefix(BOM)
