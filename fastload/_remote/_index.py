"""The dataset index: one small file beside a dataset's shards that says everything a loader
needs to plan epochs without opening a shard.

``fastload-index.json`` holds the format of the shards (``hdf5`` or ``arrow``), their fields, the
field the lengths describe, and per shard its path (relative to the index, so a folder indexed
locally and then uploaded works), sample count, size in bytes and SHA-256; and the length of
every sample, packed: the narrowest unsigned integer type that holds them, zlib-compressed,
base64 (10 M lengths of a lognormal corpus take about 12 MB). A remote dataset reads it once per
node, and plans from it alone.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._types import Field
from fastload.errors import DataFormatError

INDEX_NAME = "fastload-index.json"
INDEX_FORMAT = "fastload-index"
INDEX_VERSION = 1
KINDS = ("hdf5", "arrow")
_LENGTH_DTYPES = ("<u1", "<u2", "<u4", "<u8")

# NOTE [index bounds]
# An index is read from a store that is not ours, before any shard: what it claims is bounded
# before anything is allocated for it. A sample takes at least one byte of an HDF5 or Arrow IPC
# shard (its values, or its offset), and at least 1/64 byte of a Parquet one (run-length and
# bit-packed encodings); the lengths are decompressed in a stream that stops at the size the
# sample count implies; and no index claims more than MAX_SAMPLES samples in all.
MAX_SAMPLES = 1 << 34
_SAMPLES_PER_BYTE = {".parquet": 64}
_SLACK_BYTES = 1 << 16


@dataclass(frozen=True)
class ShardEntry:
    """One shard: ``path`` relative to the index (``/``-separated), its samples, bytes and
    SHA-256 (hex). ``sha256`` is ``None`` where it is unknown (an index derived from a listing,
    without reading the shards whole); ``version`` is then the store's version of the object
    (its mtime or ETag, ``""`` when none), so that a rewritten object gets another cache key."""

    path: str
    samples: int
    bytes: int
    sha256: str | None
    version: str = ""

    @property
    def cache_version(self) -> str:
        """What tells this shard's content apart in cache keys: its checksum, else its size
        and the store's version."""
        return self.sha256 if self.sha256 is not None else f"size={self.bytes};version={self.version}"


@dataclass(frozen=True)
class DatasetIndex:
    """What a dataset holds (see the module text); ``lengths`` is read-only int64."""

    kind: str
    fields: dict[str, Field]
    length_field: str | None
    shards: tuple[ShardEntry, ...]
    lengths: npt.NDArray[np.int64]

    @property
    def num_samples(self) -> int:
        return int(sum(s.samples for s in self.shards))

    @property
    def total_bytes(self) -> int:
        return int(sum(s.bytes for s in self.shards))

    def to_json(self) -> bytes:
        lengths = self.lengths
        top = int(lengths.max()) if lengths.size else 0
        dtype = next(t for t in ("<u1", "<u2", "<u4", "<u8") if top <= np.iinfo(np.dtype(t)).max)
        packed = zlib.compress(np.ascontiguousarray(lengths, dtype=dtype).tobytes(), 6)
        document = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "kind": self.kind,
            "fields": {
                name: {"kind": f.kind, "dtype": f.dtype.str, "shape": list(f.shape)}
                for name, f in self.fields.items()
            },
            "length_field": self.length_field,
            "shards": [
                {"path": s.path, "samples": s.samples, "bytes": s.bytes, "sha256": s.sha256}
                | ({"version": s.version} if s.version else {})
                for s in self.shards
            ],
            "lengths": {
                "dtype": dtype,
                "codec": "zlib+base64",
                "data": base64.b64encode(packed).decode("ascii"),
            },
        }
        return json.dumps(document, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> DatasetIndex:
        """The index in ``data``; ``where`` (its URL or path) names it in every error."""
        try:
            document = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataFormatError(f"{where}: is not a fastload index (not JSON: {exc})") from exc
        if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT:
            raise DataFormatError(f"{where}: is not a fastload index (no format {INDEX_FORMAT!r})")
        if document.get("version") != INDEX_VERSION:
            raise DataFormatError(
                f"{where}: index version {document.get('version')!r} is not the supported "
                f"{INDEX_VERSION}; write it again with this fastload (`fastload index`)"
            )
        try:
            kind = _choice(document["kind"], KINDS, "kind")
            fields = {
                str(name): Field(str(name), spec["kind"], np.dtype(spec["dtype"]), tuple(spec["shape"]))
                for name, spec in document["fields"].items()
            }
            length_field = document["length_field"]
            shards = tuple(
                ShardEntry(
                    str(s["path"]),
                    int(s["samples"]),
                    int(s["bytes"]),
                    None if s["sha256"] is None else str(s["sha256"]),
                    str(s.get("version", "")),
                )
                for s in document["shards"]
            )
            packed = document["lengths"]
            if packed["codec"] != "zlib+base64":
                raise ValueError(f"lengths codec {packed['codec']!r}")
            dtype = _choice(packed["dtype"], _LENGTH_DTYPES, "lengths dtype")
            _bound_claims(shards, where)
            expected = sum(s.samples for s in shards) * np.dtype(dtype).itemsize
            raw = _inflate(base64.b64decode(packed["data"]), expected, where)
            lengths = np.frombuffer(raw, dtype=np.dtype(dtype)).astype(np.int64)
        except (KeyError, TypeError, ValueError, zlib.error) as exc:
            if isinstance(exc, DataFormatError):
                raise
            raise DataFormatError(f"{where}: damaged fastload index ({type(exc).__name__}: {exc})") from exc
        index = cls(kind, fields, length_field, shards, lengths)
        index.check(where)
        lengths.flags.writeable = False
        return index

    def check(self, where: str) -> None:
        """Raise :class:`DataFormatError` naming ``where`` unless the parts agree."""
        if not self.shards:
            raise DataFormatError(f"{where}: the index lists no shard")
        if self.length_field is not None and self.fields.get(self.length_field, None) is None:
            raise DataFormatError(f"{where}: length field {self.length_field!r} is not among its fields")
        if self.lengths.size != self.num_samples:
            raise DataFormatError(
                f"{where}: the index holds {self.lengths.size} lengths for "
                f"{self.num_samples} samples in its shards"
            )
        for shard in self.shards:
            if shard.path.startswith("/") or ".." in shard.path.split("/") or not shard.path:
                raise DataFormatError(
                    f"{where}: shard path {shard.path!r} must be relative to the index, inside "
                    "its folder"
                )
            if shard.samples < 0 or shard.bytes < 0 or (shard.sha256 is not None and len(shard.sha256) != 64):
                raise DataFormatError(f"{where}: shard {shard.path!r} has a bad count, size or sha256")

    def matching(self, names: Sequence[str]) -> DatasetIndex:
        """This index restricted to the shards ``names`` (paths relative to the index), in
        that order, with their lengths."""
        position = {s.path: i for i, s in enumerate(self.shards)}
        starts = np.concatenate(([0], np.cumsum([s.samples for s in self.shards])))
        chosen = [position[name] for name in names]
        lengths = (
            np.concatenate([self.lengths[starts[i] : starts[i + 1]] for i in chosen])
            if chosen
            else np.zeros(0, np.int64)
        )
        lengths.flags.writeable = False
        return DatasetIndex(self.kind, self.fields, self.length_field, tuple(self.shards[i] for i in chosen), lengths)


def _bound_claims(shards: Sequence[ShardEntry], where: str) -> None:
    """Refuse counts no shard of its size can hold (NOTE [index bounds])."""
    total = 0
    for shard in shards:
        if shard.samples < 0 or shard.bytes < 0:
            raise DataFormatError(f"{where}: shard {shard.path!r} has a negative sample count or size")
        per_byte = next((n for suffix, n in _SAMPLES_PER_BYTE.items() if shard.path.endswith(suffix)), 1)
        if shard.samples > shard.bytes * per_byte:
            raise DataFormatError(
                f"{where}: shard {shard.path!r} claims {shard.samples:,} samples in {shard.bytes:,}"
                f" bytes; a sample takes at least {'1 byte' if per_byte == 1 else f'1/{per_byte} byte'}"
                " of its shard, so the index is damaged or not the shards'; index them again"
                " (`fastload index`)"
            )
        total += shard.samples
    if total > MAX_SAMPLES:
        raise DataFormatError(
            f"{where}: claims {total:,} samples, more than the {MAX_SAMPLES:,} an index may hold;"
            " split the dataset into several"
        )


def _inflate(data: bytes, expected: int, where: str) -> bytes:
    """``data`` decompressed, about ``expected`` bytes: the stream stops a little past it, so a
    small input that inflates to gigabytes costs no more than that (a count that differs by
    less is reported by :meth:`DatasetIndex.check`, with both numbers)."""
    cap = expected + _SLACK_BYTES
    stream = zlib.decompressobj()
    raw = stream.decompress(data, cap + 1)
    if len(raw) > cap or stream.unconsumed_tail:
        raise DataFormatError(
            f"{where}: damaged fastload index (its lengths decompress to more than {cap:,} bytes,"
            f" while its sample count needs {expected:,}); write it again (`fastload index`)"
        )
    if not stream.eof:
        raise DataFormatError(f"{where}: damaged fastload index (its lengths are truncated)")
    return raw


def _choice(value: Any, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {list(allowed)}")
    return str(value)


def fields_equal(a: Mapping[str, Field], b: Mapping[str, Field]) -> bool:
    """Whether two field descriptions agree (names in order, kinds, dtypes, shapes)."""
    return list(a.items()) == list(b.items())


__all__ = ["INDEX_NAME", "DatasetIndex", "ShardEntry", "fields_equal"]
