"""The converter's options, validated once at construction (a bad value raises UsageError).

Every option mirrors a command-line flag of the same name (``max_length`` is ``--max-length``),
and error messages name the flag, so that the one-line message a user sees points at what to
change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np

from fastload.errors import UsageError

#: Formats the converter reads; ``None`` (the default) picks one from each file's extension.
FORMATS = ("txt", "jsonl", "json", "csv", "tsv", "parquet", "arrow", "hf", "npy", "npz")
#: Integer dtypes ``--dtype`` may request for token ids.
INTEGER_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
#: The name of the length index at the root of the layout, hence no field may take it.
LENGTHS_NAME = "lengths"

#: Where the converter tokenizes and writes shards: this machine's processes, or a Ray cluster.
ENGINES = ("local", "ray")

#: Default bytes of input per chunk: large enough that per-chunk overhead (pickling to a
#: worker, one spool write per field) vanishes, small enough that a chunk's Python objects
#: (several times its size for parsed JSON) and ``2 * workers`` chunks in flight stay small.
DEFAULT_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Compression:
    """``none`` (contiguous, memory-mappable), ``lzf`` or ``gzip`` at ``level`` 0-9."""

    kind: Literal["none", "lzf", "gzip"] = "none"
    level: int | None = None

    @classmethod
    def parse(cls, text: str) -> Compression:
        """Parse ``none``, ``lzf``, ``gzip`` or ``gzip:LEVEL``."""
        name, _, level = text.partition(":")
        if name in ("none", "lzf") and not level:
            return cls(name)  # type: ignore[arg-type]
        if name == "gzip":
            if not level:
                return cls("gzip", 4)
            if level.isdigit() and 0 <= int(level) <= 9:
                return cls("gzip", int(level))
        raise UsageError(f"--compression must be none, lzf, gzip or gzip:0..9, got {text!r}")

    def __str__(self) -> str:
        return self.kind if self.level is None else f"{self.kind}:{self.level}"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def _valid_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", LENGTHS_NAME)


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """What to convert and how; see ``fastload convert --help`` for each flag.

    ``block_bytes`` (no flag) is the input read per chunk; it changes speed and memory, never
    the output.
    """

    inputs: tuple[str, ...]
    output: Path
    format: str | None = None
    per_file: bool = False
    text_field: str = "text"
    output_field: str = "input_ids"
    fields: tuple[str, ...] = ()
    label_fields: tuple[str, ...] = ()
    offsets: tuple[tuple[str, str], ...] = ()
    tokenizer: str = "bytes"
    min_count: int = 1
    max_vocab: int | None = None
    special_tokens: bool = True
    max_length: int | None = None
    overlong: Literal["truncate", "drop"] = "truncate"
    min_length: int = 1
    dtype: str | None = None
    compression: Compression = Compression()
    shard_size: int | None = None
    workers: int = 0
    on_error: Literal["raise", "skip"] = "raise"
    errors: Literal["strict", "replace"] = "strict"
    overwrite: bool = False
    progress: bool = False
    block_bytes: int = DEFAULT_BLOCK_BYTES
    engine: Literal["local", "ray"] = "local"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        _require(len(self.inputs) > 0, "at least one INPUT is required")
        _require(
            self.format is None or self.format in FORMATS,
            f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}",
        )
        _require(self.min_count >= 1, f"--min-count must be >= 1, got {self.min_count}")
        _require(
            self.max_vocab is None or self.max_vocab >= 1,
            f"--max-vocab must be >= 1, got {self.max_vocab}",
        )
        _require(
            self.max_length is None or self.max_length >= 1,
            f"--max-length must be >= 1, got {self.max_length}",
        )
        _require(self.min_length >= 0, f"--min-length must be >= 0, got {self.min_length}")
        _require(
            self.max_length is None or self.min_length <= self.max_length,
            f"--min-length ({self.min_length}) must not exceed --max-length ({self.max_length})",
        )
        _require(
            self.overlong in ("truncate", "drop"),
            f"--overlong must be truncate or drop, got {self.overlong!r}",
        )
        _require(
            self.dtype is None or self.dtype in INTEGER_DTYPES,
            f"--dtype must be one of {', '.join(INTEGER_DTYPES)}, got {self.dtype!r}",
        )
        _require(
            self.shard_size is None or self.shard_size >= 1,
            f"--shard-size must be >= 1 sample, got {self.shard_size}",
        )
        _require(self.workers >= 0, f"--workers must be >= 0, got {self.workers}")
        _require(
            self.on_error in ("raise", "skip"),
            f"--on-error must be raise or skip, got {self.on_error!r}",
        )
        _require(
            self.errors in ("strict", "replace"),
            f"--errors must be strict or replace, got {self.errors!r}",
        )
        _require(self.block_bytes >= 1, f"block_bytes must be >= 1, got {self.block_bytes}")
        self._check_engine()
        self._check_names()

    def _check_engine(self) -> None:
        _require(
            self.engine in ENGINES,
            f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}",
        )
        _require(
            self.ray_address is None or self.engine == "ray",
            f"--ray-address applies to --engine ray, not --engine {self.engine}",
        )
        address = self.ray_address
        _require(
            address is None
            or address == "auto"
            or (address.startswith("ray://") and len(address) > len("ray://"))
            or (":" in address and address.rsplit(":", 1)[1].isdigit()),
            f"--ray-address must be auto, ray://HOST:PORT or HOST:PORT (a cluster's GCS), got {address!r}",
        )
        _require(
            self.engine == "local" or self.workers == 0,
            f"--workers applies to --engine local; --engine ray uses the cluster's CPUs "
            f"(got --workers {self.workers})",
        )

    def _check_names(self) -> None:
        names = [self.output_field, *self.fields, *self.label_fields]
        names += [values for values, _ in self.offsets]
        for name in names:
            _require(
                _valid_name(name),
                f"field name {name!r} is not allowed: it must be non-empty, contain no '/' "
                f"and not be {LENGTHS_NAME!r} (the layout's length index)",
            )
        outputs = [self.output_field, *self.fields, *self.label_fields]
        duplicates = sorted({n for n in outputs if outputs.count(n) > 1})
        _require(
            not duplicates,
            f"field {', '.join(map(repr, duplicates))} is named twice among --output-field, "
            f"--fields and --label-field",
        )
        _require(
            self.text_field not in (*self.fields, *self.label_fields),
            f"--text-field {self.text_field!r} is also listed in --fields/--label-field",
        )

    @property
    def dtype_override(self) -> np.dtype | None:
        return None if self.dtype is None else np.dtype(self.dtype)

    def recorded(self) -> dict[str, object]:
        """The options that shape the output, as JSON-ready values, for the file's attributes.

        Excludes what cannot change a byte of the result (workers, engine, progress, overwrite,
        chunk size) and the paths, which are recorded separately.
        """
        skip = {"inputs", "output", "workers", "progress", "overwrite", "block_bytes"}
        skip |= {"engine", "ray_address"}
        out: dict[str, object] = {}
        for f in fields(self):
            if f.name in skip:
                continue
            value = getattr(self, f.name)
            if isinstance(value, Compression):
                value = str(value)
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[f.name] = value
        return out
