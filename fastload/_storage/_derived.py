"""Names of cache entries derived from a local source file (a decoded copy of it, say).

An entry is named ``<stem>.<P>.<V>.<X><suffix>``: ``P`` hashes the source's absolute path,
``V`` its size and modification time, ``X`` what the caller derives (the columns, a format
version). A changed source therefore gets a new name (and is derived again), while the entries
of its earlier versions can be found by ``P`` alone, to be deleted.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

_STEM_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
_STEM_MAX = 48


@dataclass(frozen=True)
class SourceVersion:
    """One version of a local file: its absolute path, size and modification time."""

    path: Path
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> SourceVersion:
        """The version of ``path`` now; ``OSError`` if it cannot be stat'ed."""
        info = os.stat(path)
        return cls(path.absolute(), info.st_size, info.st_mtime_ns)


def derived_path(directory: Path, source: SourceVersion, variant: str, suffix: str) -> Path:
    """Where the entry derived as ``variant`` from ``source`` lives in ``directory``."""
    stem = _STEM_CHARS.sub("_", source.path.stem)[:_STEM_MAX] or "file"
    parts = (
        stem,
        _digest(str(source.path), 16),
        _digest(f"{source.size}:{source.mtime_ns}", 12),
        _digest(variant, 12),
    )
    return directory / (".".join(parts) + suffix)


def other_versions(entry: Path) -> list[Path]:
    """The entries beside ``entry`` derived from the same source path at another size or
    modification time (any variant)."""
    mine = _parse(entry.name)
    if mine is None:
        return []
    found = []
    for path in entry.parent.glob(f"*.{mine[1]}.*"):
        other = _parse(path.name)
        if other is not None and other[1] == mine[1] and other[2] != mine[2]:
            found.append(path)
    return sorted(found)


def _parse(name: str) -> tuple[str, str, str, str] | None:
    if name.startswith("."):
        return None  # a lock or a temporary file
    parts = name.split(".")  # the stem holds no dot, the suffix may hold any
    if len(parts) < 4:
        return None
    return parts[0], parts[1], parts[2], parts[3]


def _digest(text: str, chars: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:chars]
