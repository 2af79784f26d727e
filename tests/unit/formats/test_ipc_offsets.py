"""List lengths of an Arrow IPC file read from its footer, batch metadata and offsets alone:
the same as pyarrow's for every layout fastload reads (nested in structs, after columns of
every kind, large lists, nulls, LZ4 and ZSTD bodies, empty batches), a fraction of the file
read, and ``None`` (read it through pyarrow) for a layout it does not count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from fastload._formats._ipc_offsets import ipc_list_lengths, ipc_rows

TAIL = 4096


def write(path: Path, table: pa.Table, *, chunk: int, compression: str | None = None) -> None:
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as out:
        for batch in table.to_batches(max_chunksize=chunk):
            out.write_batch(batch)
        out.write_batch(pa.RecordBatch.from_pylist([], schema=table.schema))  # an empty batch


class Reads:
    """A real file's bytes by offset, counting what is read beyond the tail."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self.tail = self.data[-TAIL:]
        self.read = 0

    def __call__(self, offset: int, length: int) -> bytes:
        assert offset >= 0 and offset + length <= len(self.data)
        self.read += length
        return self.data[offset : offset + length]


def lengths_of(reads: Reads, schema: pa.Schema, path: tuple[str, ...]) -> np.ndarray | None:
    return ipc_list_lengths(reads, len(reads.data), reads.tail, schema, path)


def expected(table: pa.Table, column: str, child: str | None = None) -> list[int]:
    values = table.column(column).to_pylist()
    if child is not None:
        values = [None if v is None else v[child] for v in values]
    return [0 if v is None else len(v) for v in values]


def sample_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids = [None if i % 17 == 5 else rng.integers(0, 9, int(rng.integers(0, 40))).tolist() for i in range(rows)]
    return pa.table(
        {
            "text": [rng.bytes(20).hex() for _ in range(rows)],
            "flag": rng.random(rows) < 0.5,
            "vec": pa.array(rng.random((rows, 3)).tolist(), pa.list_(pa.float32(), 3)),
            "meta": pa.array([{"n": i, "tags": list(range(i % 4))} for i in range(rows)]),
            "blob": pa.array([rng.bytes(8) for _ in range(rows)], pa.binary(8)),
            "ids": pa.array(ids, pa.list_(pa.int32())),
            "big": pa.array([list(range(i % 7)) for i in range(rows)], pa.large_list(pa.int64())),
        }
    )


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_lengths_as_pyarrow_reads_them_from_a_fraction_of_the_file(tmp_path: Path, compression: str | None) -> None:
    table = sample_table(1000, seed=1)
    write(tmp_path / "a.arrow", table, chunk=300, compression=compression)
    reads = Reads(tmp_path / "a.arrow")
    got = lengths_of(reads, table.schema, ("ids",))
    assert got is not None and got.tolist() == expected(table, "ids")
    assert reads.read < len(reads.data) / 8  # metadata and offsets, not the values
    for path, want in ((("big",), expected(table, "big")), (("meta", "tags"), expected(table, "meta", "tags"))):
        found = lengths_of(reads, table.schema, path)
        assert found is not None and found.tolist() == want
    assert ipc_rows(reads, len(reads.data), reads.tail) == 1000


def test_a_long_footer_is_read_past_the_tail(tmp_path: Path) -> None:
    table = pa.table({"ids": pa.array([[1, 2], [3]] * 400, pa.list_(pa.int8()))})
    write(tmp_path / "many.arrow", table, chunk=2)  # 401 blocks: a footer of ~10 KB
    reads = Reads(tmp_path / "many.arrow")
    got = lengths_of(reads, table.schema, ("ids",))
    assert got is not None and got.tolist() == [2, 1] * 400


def test_layouts_it_does_not_count_are_left_to_pyarrow(tmp_path: Path) -> None:
    when = pa.array(np.arange(4).astype("datetime64[s]"))
    table = pa.table({"when": when, "ids": pa.array([[1], [], [2, 3], [4]])})
    write(tmp_path / "t.arrow", table, chunk=4)
    assert lengths_of(Reads(tmp_path / "t.arrow"), table.schema, ("ids",)) is None
    nullable = pa.table({"s": pa.array([{"ids": [1, 2]}, None, {"ids": [3]}], pa.struct([("ids", pa.list_(pa.int64()))]))})
    write(tmp_path / "n.arrow", nullable, chunk=3)
    assert lengths_of(Reads(tmp_path / "n.arrow"), nullable.schema, ("s", "ids")) is None
