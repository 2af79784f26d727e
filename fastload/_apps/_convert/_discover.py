"""Turn the INPUT arguments (files, folders, globs) into an ordered list of typed input files.

Order is part of the output's contract: inputs in the order given, each folder or glob expanded
in sorted path order (lexicographic, so zero-padded shard names sort as numbered), a Hugging
Face ``save_to_disk`` folder in the order its ``state.json`` lists.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastload.errors import DataFormatError, UsageError

EXTENSIONS = {
    ".txt": "txt",
    ".text": "txt",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".npy": "npy",
    ".npz": "npz",
}
COMPRESSIONS: dict[str, Literal["gzip", "zstd"]] = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
#: Formats read as a byte stream, hence also accepted gzip- or zstd-compressed.
STREAM_FORMATS = frozenset({"txt", "jsonl", "json", "csv", "tsv"})
ARRAY_FORMATS = frozenset({"npy", "npz"})


@dataclass(frozen=True)
class InputFile:
    """One file to read. ``display`` is the name used in messages (as the user spelled it);
    ``size`` is its size on disk in bytes (compressed size for compressed files)."""

    path: Path
    display: str
    format: str
    compression: Literal["", "gzip", "zstd"]
    size: int


@dataclass(frozen=True)
class Discovery:
    files: tuple[InputFile, ...]
    #: Files inside folders skipped because their extension names no known format.
    ignored: int


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _hf_arrow_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder in their saved order, or None
    when ``folder`` is not one."""
    state = folder / "state.json"
    if state.is_file():
        try:
            listed = json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])
            names = [entry["filename"] for entry in listed]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataFormatError(f"{state}: unreadable Hugging Face state.json ({exc})") from exc
        if names:
            return [folder / name for name in names]
    if (folder / "dataset_info.json").is_file():
        return sorted(folder.glob("*.arrow"))
    return None


def _typed(path: Path, display: str, fmt: str | None) -> InputFile | None:
    """Type one file by ``fmt`` or, failing that, by its extension; None if unknown."""
    suffixes = [s.lower() for s in path.suffixes]
    compression: Literal["", "gzip", "zstd"] = ""
    if suffixes and suffixes[-1] in COMPRESSIONS:
        compression = COMPRESSIONS[suffixes.pop()]
    detected = fmt or (EXTENSIONS.get(suffixes[-1]) if suffixes else None)
    if detected is None:
        return None
    if detected == "hf":
        detected = "arrow"
    if compression and detected not in STREAM_FORMATS:
        raise UsageError(
            f"{display}: {compression}-compressed {detected} files are not supported; "
            f"only text formats ({', '.join(sorted(STREAM_FORMATS))}) may be compressed"
        )
    return InputFile(path, display, detected, compression, path.stat().st_size)


def _walk(folder: Path, fmt: str | None) -> tuple[list[InputFile], int]:
    hf = _hf_arrow_files(folder)
    if hf is not None:
        return [_hf_file(p) for p in hf], 0
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        example = f", e.g. {folder / splits[0]}" if splits else ""
        raise UsageError(
            f"{folder} is a DatasetDict folder (splits: {', '.join(splits) or 'none'}); "
            f"pass one split's folder{example}"
        )
    if fmt == "hf":
        raise UsageError(
            f"{folder} is not a Hugging Face save_to_disk folder (no state.json or "
            f"dataset_info.json); pass a folder written by Dataset.save_to_disk"
        )
    found: list[InputFile] = []
    ignored = 0
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue  # hidden files and folders (.git, our own temporary folders)
        if entry.is_dir():
            sub, sub_ignored = _walk(entry, fmt)
            found += sub
            ignored += sub_ignored
        elif entry.is_file():
            typed = _typed(entry, str(entry), fmt)
            if typed is None:
                ignored += 1
            else:
                found.append(typed)
    return found, ignored


def _hf_file(path: Path) -> InputFile:
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path} (listed in its folder's state.json)")
    return InputFile(path, str(path), "arrow", "", path.stat().st_size)


def _expand_one(text: str, fmt: str | None) -> tuple[list[InputFile], int]:
    path = Path(text)
    if path.is_dir():
        files, ignored = _walk(path, fmt)
        if not files:
            hint = " (pass --format to read files with other extensions)" if ignored else ""
            raise FileNotFoundError(f"no input files in folder {text}{hint}")
        return files, ignored
    if path.is_file():
        typed = _typed(path, text, fmt)
        if typed is None:
            raise UsageError(
                f"cannot tell the format of {text} from its extension; pass --format "
                f"(one of txt, jsonl, json, csv, tsv, parquet, arrow, hf, npy, npz)"
            )
        return [typed], 0
    if _is_glob(text):
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise FileNotFoundError(f"no files match {text}")
        files, ignored = [], 0
        for match in matches:
            if os.path.basename(match).startswith("."):
                continue
            sub, sub_ignored = _expand_one(match, fmt)
            files += sub
            ignored += sub_ignored
        return files, ignored
    raise FileNotFoundError(f"input not found: {text}")


def discover(inputs: tuple[str, ...], fmt: str | None) -> Discovery:
    """Expand and type every input; raise FileNotFoundError, UsageError or DataFormatError."""
    files: list[InputFile] = []
    ignored = 0
    for text in inputs:
        found, skipped = _expand_one(text, fmt)
        files += found
        ignored += skipped
    kinds = {f.format in ARRAY_FORMATS for f in files}
    if len(kinds) > 1:
        raise UsageError(
            "numpy inputs (.npy/.npz) cannot be mixed with record inputs in one conversion"
        )
    if any(f.format == "npz" for f in files) and any(f.format == "npy" for f in files):
        raise UsageError(".npy and .npz inputs cannot be mixed; use one or the other")
    return Discovery(tuple(files), ignored)
