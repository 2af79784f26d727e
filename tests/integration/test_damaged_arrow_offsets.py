"""An Arrow IPC file or stream whose list (or string) offsets point past their values is refused
with a DataFormatError naming the file, the field and the sample, whatever reads it: the
memory-mapped numeric path, Arrow's ``take`` (strings), the dataset directly, or a loader with
0 or 2 workers. (Parquet stores no offsets: its decoded copy is written by pyarrow.)

The damaged files are real: a valid file is written, then the offsets buffer of one record
batch is overwritten in place, where pyarrow found it in the memory map."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import fastload
from fastload._formats._arrow_check import check_batch
from fastload._formats._arrow_schema import select_fields
from fastload.errors import DataFormatError

ROWS_PER_BATCH, BATCHES, LENGTH = 10, 3, 172
DAMAGED_BATCH = 1  # its last sample (19) is made to end 500 values late


def _table() -> pa.Table:
    rng = np.random.default_rng(0)
    n = ROWS_PER_BATCH * BATCHES
    offsets = np.arange(n + 1, dtype=np.int32) * LENGTH
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 999, offsets[-1]).astype(np.uint16)))
    text = pa.array([f"sample {i} " * 3 for i in range(n)])
    return pa.table({"ids": ids, "text": text, "label": np.arange(n, dtype=np.int64)})


def _read_batch(path: Path, kind: str, index: int) -> tuple[pa.RecordBatch, pa.Buffer]:
    source = pa.memory_map(str(path))
    whole = source.read_buffer()
    if kind == "file":
        return pa.ipc.open_file(whole).get_batch(index), whole
    reader = pa.ipc.open_stream(whole)
    for _ in range(index):
        reader.read_next_batch()
    return reader.read_next_batch(), whole


def _damaged(tmp_path: Path, kind: str, column: str, *, shift: int = 500, row: int = -1) -> Path:
    """A real IPC ``kind`` file whose ``column`` offsets in record batch 1 are moved by
    ``shift`` at entry ``row`` alone (default: the last)."""
    path = tmp_path / f"damaged-{column}.{'arrow' if kind == 'file' else 'stream'}"
    table = _table()
    open_writer = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
    with open_writer(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=ROWS_PER_BATCH):
            writer.write_batch(batch)
    batch, whole = _read_batch(path, kind, DAMAGED_BATCH)
    at = batch.column(column).buffers()[1].address - whole.address
    raw = bytearray(path.read_bytes())
    offsets = np.frombuffer(bytes(raw), np.int32, count=ROWS_PER_BATCH + 1, offset=at).copy()
    offsets[row] += shift
    raw[at : at + offsets.nbytes] = offsets.tobytes()
    path.write_bytes(bytes(raw))
    return path


_NAMED = r"damaged-{column}\.\w+: field '{column}': sample 19 ends at offset \d+, past the \d+ {unit}"


@pytest.mark.parametrize("kind", ["file", "stream"])
@pytest.mark.parametrize(("column", "unit"), [("ids", "values"), ("text", "bytes")])
def test_offsets_past_the_values_are_refused_by_the_dataset(tmp_path: Path, kind: str, column: str, unit: str) -> None:
    path = _damaged(tmp_path, kind, column)
    dataset = fastload.ArrowDataset(path, fields=[column])
    with pytest.raises(DataFormatError, match=_NAMED.format(column=column, unit=unit)):
        dataset.read_batch([19])
    with pytest.raises(DataFormatError, match=_NAMED.format(column=column, unit=unit)):
        dataset[0]  # the whole file is checked when it is opened, not only the samples read


@pytest.mark.parametrize("kind", ["file", "stream"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("column", "unit"), [("ids", "values"), ("text", "bytes")])
def test_offsets_past_the_values_are_refused_by_the_loader(tmp_path: Path, kind: str, workers: int, column: str, unit: str) -> None:
    dataset = fastload.ArrowDataset(_damaged(tmp_path, kind, column), fields=[column, "label"])
    with pytest.raises(DataFormatError, match=_NAMED.format(column=column, unit=unit)):
        list(fastload.DataLoader(dataset, batch_size=4, num_workers=workers))


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_length_grouping_refuses_offsets_past_the_values(tmp_path: Path, kind: str) -> None:
    dataset = fastload.ArrowDataset(_damaged(tmp_path, kind, "ids"))
    with pytest.raises(DataFormatError, match=_NAMED.format(column="ids", unit="values")):
        list(fastload.DataLoader(dataset, max_tokens=2000, num_workers=2))


def test_offsets_that_decrease_name_the_sample(tmp_path: Path) -> None:
    path = _damaged(tmp_path, "file", "ids", shift=LENGTH + 1, row=4)  # sample 14 starts late...
    batch, _ = _read_batch(path, "file", DAMAGED_BATCH)
    batch.validate()  # ...which pyarrow's cheap validation does not see
    fields = select_fields(str(path), batch.schema, ["ids"])
    with pytest.raises(DataFormatError, match=r"field 'ids': sample 14 ends at offset 860, before its start 861"):
        check_batch(batch, fields, ROWS_PER_BATCH * DAMAGED_BATCH, str(path))


def test_an_undamaged_file_reads_as_written(tmp_path: Path) -> None:
    path = _damaged(tmp_path, "file", "ids", shift=0)
    batch = fastload.ArrowDataset(path, fields=["ids"]).read_batch(np.arange(30))["ids"]
    assert (np.asarray(batch.lengths) == LENGTH).all()
