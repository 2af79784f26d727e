"""``--workers N``: results in input order, failures re-raised at their item, and output bytes
that do not depend on N."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastload._apps._convert._convert import convert
from fastload._apps._convert._convert_options import ConvertOptions
from fastload._apps._convert._parallel import ordered_map
from fastload.errors import DataFormatError, WorkerCrashedError


def square_unless(bad: int) -> Callable[[int], int]:
    """Runs in the workers: squares, sleeping so that later items often finish first."""

    def function(x: int) -> int:
        if x == bad:
            raise DataFormatError(f"item {x} is bad")
        if x == -bad:
            os._exit(3)
        time.sleep(0.02 * ((7 * x) % 5))
        return x * x

    return function


def test_results_come_in_input_order_and_a_failure_at_its_item() -> None:
    results = []
    with pytest.raises(DataFormatError, match="item 12 is bad"):
        for value in ordered_map(square_unless, 12, iter(range(20)), workers=2):
            results.append(value)
    assert results == [x * x for x in range(12)]


def test_a_worker_that_dies_raises_worker_crashed() -> None:
    with pytest.raises(WorkerCrashedError, match="worker process died"):
        list(ordered_map(square_unless, 4, iter([1, 2, -4, 5]), workers=2))


def test_in_process_map_is_the_plain_map() -> None:
    assert list(ordered_map(square_unless, 99, iter(range(5)), workers=0)) == [0, 1, 4, 9, 16]


def test_output_bytes_do_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    lines = []
    for i in range(400):
        record = {"text": " ".join(f"w{(i * j) % 37}" for j in range(i % 23)), "label": i % 4}
        lines.append("{broken" if i % 97 == 5 else json.dumps(record))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    digests = {}
    for workers in (0, 2):
        folder = tmp_path / f"w{workers}"
        folder.mkdir()
        options = ConvertOptions(
            inputs=(str(tmp_path / "data.jsonl"),),
            output=folder / "out.h5",
            tokenizer="whitespace",
            label_fields=("label",),
            on_error="skip",
            shard_size=150,
            workers=workers,
            block_bytes=2000,  # many chunks, so the workers really interleave
        )
        report = convert(options)
        assert report.stats.skipped == {"malformed JSON": 5}
        files = sorted(folder.iterdir())
        digests[workers] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert digests[0] == digests[2]
    assert sorted(digests[0]) == [
        "fastload-index.json", "out-00000.h5", "out-00001.h5", "out-00002.h5", "out.vocab.txt"
    ]  # fmt: skip
