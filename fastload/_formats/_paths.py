"""Turning the ``path`` argument of a reader into the ordered list of shard files it names."""

from __future__ import annotations

import glob
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Union

from fastload._remote import INDEX_NAME, REMOTE_SCHEMES, DatasetIndex
from fastload.errors import DataFileNotFoundError, DataFormatError, UnsupportedSchemeError

PathArg = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

_GLOB_CHARS = frozenset("*?[")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # RFC 3986's scheme, then an authority


def check_scheme(path: str) -> None:
    """Raise :class:`UnsupportedSchemeError` if ``path`` is a URL of a scheme no reader opens
    (a remote one is handled before paths are resolved; anything else would be looked for as a
    relative local path and reported missing, hiding the real mistake)."""
    match = _URL.match(path)
    if match is None or match.group(1).lower() in REMOTE_SCHEMES:
        return
    scheme = match.group(1)
    raise UnsupportedSchemeError(
        f"{path}: fastload cannot read {scheme}:// URLs; it reads"
        f" {', '.join(s + '://' for s in REMOTE_SCHEMES)} and a local path"
        + (" (pass the path without file://)" if scheme.lower() == "file" else "")
    )


def files_in_directory(directory: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files of ``directory`` (not recursive) whose names end in one of ``suffixes``, sorted;
    raises :class:`DataFileNotFoundError` when there is none. A directory with a
    ``fastload-index.json`` stands for the shards its index lists instead (see
    :func:`indexed_files`)."""
    if (directory / INDEX_NAME).is_file():
        return indexed_files(directory, suffixes)
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(suffixes))
    if not files:
        raise DataFileNotFoundError(
            f"{directory}: the directory holds no file ending in {', '.join(suffixes)}", directory
        )
    return files


def indexed_files(directory: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The shards ``directory/fastload-index.json`` lists, in its order (as ``fastload index``
    promises: the folder's dataset is planned from its index). Shard files under the folder that
    it does not list are named in a warning and not read; a listed shard that is missing, or an
    index of shards whose names do not end in ``suffixes`` (the other reader's), is an error."""
    where = directory / INDEX_NAME
    index = DatasetIndex.from_json(where.read_bytes(), str(where))
    foreign = [s.path for s in index.shards if not s.path.endswith(suffixes)]
    if foreign:
        reader = "ArrowDataset" if index.kind == "arrow" else "HDF5Dataset"
        raise DataFormatError(
            f"{where}: lists {index.kind} shards ({foreign[0]}), which this reader does not read "
            f"(it reads {', '.join(suffixes)}); open the folder with {reader}"
        )
    files = [directory.joinpath(*s.path.split("/")) for s in index.shards]
    missing = [s.path for s, f in zip(index.shards, files, strict=True) if not f.is_file()]
    if missing:
        raise DataFileNotFoundError(
            f"{where}: lists {len(missing)} shard(s) that are not in the folder ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); restore them, or write the index again with "
            f"`fastload index {directory}`",
            directory / missing[0],
        )
    listed = {s.path for s in index.shards}
    extra = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name.endswith(suffixes) and p.relative_to(directory).as_posix() not in listed
    )
    if extra:
        warnings.warn(
            f"{directory}: holds {len(extra)} shard files the index does not list, which are not "
            f"read: {', '.join(extra[:10])}{', ...' if len(extra) > 10 else ''} (the dataset is "
            f"the index's {index.num_samples:,} samples); to read them too, write the index "
            f"again with `fastload index {directory}`",
            stacklevel=4,
        )
    return files


def resolve_paths(path: PathArg, *, expand_directory: Callable[[Path], list[Path]]) -> list[Path]:
    """Return the shard files ``path`` names, as absolute paths, in the order they form one
    dataset.

    * A single existing file is one shard.
    * A string containing ``*``, ``?`` or ``[`` (and naming no existing file) is a glob; its
      matches are sorted by path (a matching directory is expanded as below), and ``**``
      recurses.
    * A directory stands for the files ``expand_directory(directory)`` returns.
    * A list or tuple is the concatenation of its items, each resolved as above, in the given
      order (a list is an explicit order; only globs and directories are sorted).

    Raises :class:`UnsupportedSchemeError` for a URL (``scheme://...``) of any item,
    :class:`DataFileNotFoundError` (a ``FileNotFoundError``) for a path that does not
    exist or a glob that matches no file, naming it, :class:`DataFormatError` for an empty list,
    and whatever ``expand_directory`` raises for a directory.
    """
    if isinstance(path, (str, os.PathLike)):
        check_scheme(os.fspath(path))
        return _resolve_one(path, expand_directory)
    if not isinstance(path, Sequence):
        raise TypeError(f"path must be a str, a Path, or a list of them; got {type(path).__name__}")
    if len(path) == 0:
        raise DataFormatError("path is an empty list: it must name at least one file")
    for item in path:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"each path in the list must be a str or a Path; got {item!r}")
        check_scheme(os.fspath(item))
    resolved: list[Path] = []
    for item in path:
        resolved.extend(_resolve_one(item, expand_directory))
    return resolved


def _resolve_one(
    item: str | os.PathLike[str], expand_directory: Callable[[Path], list[Path]]
) -> list[Path]:
    text = os.fspath(item)
    # Absolute, so that worker processes started elsewhere (a forkserver) find the same files.
    candidate = Path(text).expanduser().absolute()
    if candidate.is_file():
        return [candidate]
    if candidate.is_dir():
        return expand_directory(candidate)
    if _GLOB_CHARS.intersection(text):
        files: list[Path] = []
        pattern = os.path.expanduser(text)
        for match in sorted(Path(p).absolute() for p in glob.glob(pattern, recursive=True)):
            if match.is_file():
                files.append(match)
            elif match.is_dir():
                files.extend(expand_directory(match))
        if not files:
            # Not one missing path, but to a caller the same fact: the files it named are not there.
            raise DataFileNotFoundError(f"the glob {text!r} matches no file", text)
        return files
    raise DataFileNotFoundError(f"{candidate}: no such file or directory", candidate)
