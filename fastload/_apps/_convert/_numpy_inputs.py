"""``.npy`` / ``.npz`` inputs: numeric arrays, streamed row block by row block.

A *table* is a set of named arrays with one row per sample: all ``.npy`` inputs together
(named by file stem), or one ``.npz`` file (named by member; several ``.npz`` files are shards
read one after another). Every array becomes a fixed field, except pairs given as
``--offsets VALUES=OFFSETS``, which form a ragged field named VALUES: ``VALUES`` holds all
samples back to back and ``OFFSETS`` (N+1 integers from 0) where each one starts.

Arrays are read through their ``.npy`` headers and then sequentially (also inside a compressed
``.npz``), so memory stays at one block of rows whatever the array sizes.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fastload._apps._convert._discover import InputFile
from fastload._apps._convert._encode import notice
from fastload._apps._convert._model import EMPTY_INPUT, ChunkStats, Encoded, NoticeChunk
from fastload._apps._convert._writer import OutputField
from fastload.errors import DataFormatError, UsageError


class _ArrayReader:
    """The rows of one ``.npy`` stream, read in order."""

    def __init__(self, stream: BinaryIO, where: str) -> None:
        self._stream = stream
        self.where = where
        try:
            version = np.lib.format.read_magic(stream)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read_header(stream)
        except ValueError as exc:
            raise DataFormatError(f"{where}: not a .npy array ({exc})") from exc
        if dtype.hasobject:
            raise DataFormatError(
                f"{where}: holds Python objects (dtype {dtype}); only numeric arrays can be stored"
            )
        if not shape:
            raise DataFormatError(f"{where}: is a 0-d array; expected one row per sample")
        if fortran_order and len(shape) > 1:
            raise DataFormatError(
                f"{where}: is Fortran-ordered; save it with numpy.ascontiguousarray"
            )
        self.rows = int(shape[0])
        self.row_shape: tuple[int, ...] = tuple(int(d) for d in shape[1:])
        self.dtype: np.dtype = dtype
        self.row_bytes = dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))

    def read(self, count: int) -> np.ndarray:
        wanted = count * self.row_bytes
        data = self._stream.read(wanted)
        if len(data) != wanted:
            raise DataFormatError(f"{self.where}: truncated (the header promises {self.rows} rows)")
        return np.frombuffer(data, dtype=self.dtype).reshape((count, *self.row_shape))


@dataclass(frozen=True)
class _Table:
    """Openers of the arrays of one table, by name, and the files it spans."""

    name: str
    arrays: dict[str, Callable[[ExitStack], BinaryIO]]
    files: tuple[InputFile, ...]


def _npz_table(file: InputFile) -> _Table:
    try:
        with zipfile.ZipFile(file.path) as archive:
            members = [m for m in archive.namelist() if m.endswith(".npy")]
    except zipfile.BadZipFile as exc:
        raise DataFormatError(f"{file.display}: not an .npz archive ({exc})") from exc

    def opener(member: str) -> Callable[[ExitStack], BinaryIO]:
        def open_member(stack: ExitStack) -> BinaryIO:
            archive = stack.enter_context(zipfile.ZipFile(file.path))
            return stack.enter_context(archive.open(member))  # type: ignore[return-value]

        return open_member

    return _Table(file.display, {m[: -len(".npy")]: opener(m) for m in members}, (file,))


def _npy_table(files: tuple[InputFile, ...]) -> _Table:
    arrays: dict[str, Callable[[ExitStack], BinaryIO]] = {}
    for file in files:
        name = Path(file.path.name).stem
        if name in arrays:
            raise UsageError(
                f"two .npy inputs are named {name!r}; each names a field, so stems must differ"
            )

        def open_file(stack: ExitStack, path: Path = file.path) -> BinaryIO:
            return stack.enter_context(path.open("rb"))

        arrays[name] = open_file
    return _Table(", ".join(f.display for f in files), arrays, files)


@dataclass(frozen=True)
class NumpyPlan:
    """The fields of a numpy conversion (ragged first, the first of them primary)."""

    tables: tuple[_Table, ...]
    ragged: tuple[tuple[str, str], ...]
    fixed: tuple[str, ...]
    fields: tuple[OutputField, ...]

    @property
    def primary(self) -> str | None:
        return self.ragged[0][0] if self.ragged else None


def plan_numpy(
    files: tuple[InputFile, ...], *, fields: tuple[str, ...], offsets: tuple[tuple[str, str], ...]
) -> NumpyPlan:
    if files[0].format == "npz":
        tables = tuple(_npz_table(f) for f in files)
    else:
        tables = (_npy_table(files),)
    names = list(tables[0].arrays)
    for values, offs in offsets:
        for key in (values, offs):
            if key not in names:
                raise UsageError(
                    f"--offsets {values}={offs}: no array {key!r} in {tables[0].name} (arrays: {', '.join(names)})"
                )
    paired = {k for pair in offsets for k in pair}
    for key in fields:
        if key not in names:
            raise UsageError(
                f"--fields: no array {key!r} in {tables[0].name} (arrays: {', '.join(names)})"
            )
    fixed = tuple(k for k in (fields or names) if k not in paired)
    with ExitStack() as stack:
        readers = {
            k: _ArrayReader(tables[0].arrays[k](stack), f"{tables[0].name}[{k}]")
            for k in (*paired, *fixed)
        }
    out: list[OutputField] = []
    for values, _ in offsets:
        reader = readers[values]
        if reader.row_shape:
            raise DataFormatError(
                f"{reader.where}: ragged values must be 1-D, got shape ({reader.rows}, {', '.join(map(str, reader.row_shape))})"
            )
        spool = np.dtype(np.int64) if reader.dtype.kind in "iu" else reader.dtype
        out.append(OutputField(values, "ragged", spool))
    out += [OutputField(k, "fixed", readers[k].dtype, readers[k].row_shape) for k in fixed]
    for table in tables[1:]:
        missing = sorted(set(readers) - set(table.arrays))
        if missing:
            raise DataFormatError(
                f"{table.name} lacks array {missing[0]!r} that {tables[0].name} has"
            )
    return NumpyPlan(tables, offsets, fixed, tuple(out))


def _open_readers(plan: NumpyPlan, table: _Table, stack: ExitStack) -> dict[str, _ArrayReader]:
    """Readers of the arrays ``plan`` uses, checked against the first table's dtypes."""
    needed = [k for pair in plan.ragged for k in pair] + list(plan.fixed)
    readers = {k: _ArrayReader(table.arrays[k](stack), f"{table.name}[{k}]") for k in needed}
    for field in plan.fields:
        reader = readers[field.name]
        expected = (
            field.spool_dtype
            if field.kind == "fixed" or field.spool_dtype.kind not in "iu"
            else None
        )
        if (
            expected is not None and reader.dtype != expected
        ) or reader.row_shape != field.row_shape:
            raise DataFormatError(
                f"{reader.where}: dtype {reader.dtype} and row shape {reader.row_shape} differ from "
                f"the first input's ({field.spool_dtype}, {field.row_shape})"
            )
    for _, offsets_key in plan.ragged:
        if readers[offsets_key].dtype.kind not in "iu" or readers[offsets_key].row_shape:
            raise DataFormatError(
                f"{readers[offsets_key].where}: offsets must be a 1-D integer array"
            )
    return readers


def _num_samples(plan: NumpyPlan, table: _Table, readers: dict[str, _ArrayReader]) -> int:
    counts = {o: readers[o].rows - 1 for _, o in plan.ragged} | {
        k: readers[k].rows for k in plan.fixed
    }
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{k}: {n}" for k, n in counts.items())
        raise DataFormatError(f"{table.name}: arrays disagree on the number of samples ({listed})")
    return max(0, next(iter(counts.values())))


def _ragged_block(
    readers: dict[str, _ArrayReader],
    values_key: str,
    offsets_key: str,
    start: int,
    count: int,
    previous: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``start:start + count`` of one ragged pair, given the offset that precedes them."""
    ends = readers[offsets_key].read(count).astype(np.int64)
    lengths = np.diff(ends, prepend=previous)
    if (lengths < 0).any():
        bad = start + int(np.flatnonzero(lengths < 0)[0])
        raise DataFormatError(f"{readers[offsets_key].where}: offsets decrease at sample {bad}")
    if ends[-1] > readers[values_key].rows:
        raise DataFormatError(
            f"{readers[offsets_key].where}: offset {ends[-1]} is past the end of {values_key!r} "
            f"({readers[values_key].rows} values)"
        )
    return readers[values_key].read(int(lengths.sum())), lengths


def _table_blocks(
    plan: NumpyPlan, table: _Table, block_bytes: int, on_error: str
) -> Iterator[Encoded]:
    with ExitStack() as stack:
        readers = _open_readers(plan, table, stack)
        samples = _num_samples(plan, table, readers)
        size = sum(f.size for f in table.files)
        if samples == 0:
            yield Encoded(
                {}, {}, notice(NoticeChunk(table.name, EMPTY_INPUT, "no samples", size), on_error)
            )
            return
        previous = {}
        for _, offsets_key in plan.ragged:
            previous[offsets_key] = int(readers[offsets_key].read(1)[0])
            if previous[offsets_key] != 0:
                raise DataFormatError(
                    f"{readers[offsets_key].where}: offsets must start at 0, got {previous[offsets_key]}"
                )
        # Rows per block from the average sample size: a function of the data alone.
        row_bytes = sum(readers[k].row_bytes for k in plan.fixed)
        row_bytes += sum(readers[v].rows * readers[v].row_bytes // samples for v, _ in plan.ragged)
        step = max(1, block_bytes // max(1, row_bytes))
        for start in range(0, samples, step):
            count = min(step, samples - start)
            done = size * (start + count) // samples - size * start // samples
            encoded = Encoded({}, {}, ChunkStats(records=count, input_bytes=done))
            for values_key, offsets_key in plan.ragged:
                block = _ragged_block(
                    readers, values_key, offsets_key, start, count, previous[offsets_key]
                )
                encoded.ragged[values_key] = block
                previous[offsets_key] += int(block[1].sum())
            for key in plan.fixed:
                encoded.fixed[key] = readers[key].read(count)
            yield encoded
        for values_key, offsets_key in plan.ragged:
            if previous[offsets_key] != readers[values_key].rows:
                raise DataFormatError(
                    f"{readers[offsets_key].where}: the last offset is {previous[offsets_key]} "
                    f"but {values_key!r} has {readers[values_key].rows} values"
                )


def numpy_blocks(plan: NumpyPlan, *, block_bytes: int, on_error: str) -> Iterator[Encoded]:
    """Every table's samples, in blocks of about ``block_bytes``."""
    for table in plan.tables:
        yield from _table_blocks(plan, table, block_bytes, on_error)
