"""A hostile or damaged index is bounded before anything is allocated for what it claims: sample
counts no shard of its size can hold, and lengths that inflate past the count, are refused with
the index's name and the bound, in a few MB of memory."""

from __future__ import annotations

import base64
import json
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _token_files import write_token_file

from fastload._formats._indexing import build_index
from fastload._remote import DatasetIndex
from fastload.errors import DataFormatError

_WHERE = "s3://bucket/corpus/fastload-index.json"
_CLAIMED = 50_000_160


def _document(tmp_path: Path) -> dict[str, Any]:
    write_token_file(tmp_path / "a.h5", 120, 50, seed=1)
    write_token_file(tmp_path / "b.h5", 80, 50, seed=2)
    return json.loads(build_index(tmp_path).to_json())


def _refused(call: Callable[[], object]) -> tuple[str, int]:
    """The DataFormatError's message and the peak bytes allocated until it was raised."""
    tracemalloc.start()
    try:
        with pytest.raises(DataFormatError) as info:
            call()
        return str(info.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_index_claiming_more_samples_than_its_shards_can_hold_is_refused_in_little_memory(tmp_path: Path) -> None:
    document = _document(tmp_path)
    document["shards"][0]["samples"] = _CLAIMED - 80
    document["lengths"]["data"] = base64.b64encode(zlib.compress(bytes(_CLAIMED), 9)).decode()
    data = json.dumps(document).encode()
    assert len(data) < 100_000  # a small file claiming fifty million samples
    message, peak = _refused(lambda: DatasetIndex.from_json(data, _WHERE))
    assert _WHERE in message and "'a.h5' claims 50,000,080 samples in" in message and "at least 1 byte" in message
    assert peak < 8 << 20, peak


def test_lengths_that_inflate_past_the_sample_count_are_refused_in_little_memory(tmp_path: Path) -> None:
    document = _document(tmp_path)
    document["lengths"]["data"] = base64.b64encode(zlib.compress(bytes(_CLAIMED), 9)).decode()
    data = json.dumps(document).encode()
    message, peak = _refused(lambda: DatasetIndex.from_json(data, _WHERE))
    assert _WHERE in message and "decompress to more than" in message and "needs 200" in message
    assert peak < 8 << 20, peak


def test_an_unknown_lengths_dtype_is_refused(tmp_path: Path) -> None:
    document = _document(tmp_path)
    document["lengths"]["dtype"] = "V1000000"
    with pytest.raises(DataFormatError, match=r"damaged fastload index .*lengths dtype 'V1000000'"):
        DatasetIndex.from_json(json.dumps(document).encode(), _WHERE)
