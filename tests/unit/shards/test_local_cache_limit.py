"""``cache_limit=`` on a local dataset: code that picks local or remote data by its path keeps
working; the option is checked, ignored (local files are read in place) and a log line says so
once per process."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from fastload import ArrowDataset
from fastload._shards import _remote_source


def _arrow_file(path: Path) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("x", pa.int64())])) as writer:
        writer.write_table(pa.table({"x": np.arange(5, dtype=np.int64)}))
    return path


def test_cache_limit_on_a_local_path_is_ignored_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_remote_source, "_said", [])
    path = _arrow_file(tmp_path / "a.arrow")
    with caplog.at_level(logging.WARNING, logger="fastload"):
        first = ArrowDataset(path, cache_limit="1GB")
        second = ArrowDataset(path, cache_limit=10)
    assert len(first) == len(second) == 5
    said = [r.getMessage() for r in caplog.records if "cache_limit" in r.getMessage()]
    assert len(said) == 1 and "ignored for local files" in said[0]


def test_a_bad_cache_limit_is_refused_on_a_local_path_too(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cache_limit must be a number of bytes.*'lots'"):
        ArrowDataset(_arrow_file(tmp_path / "a.arrow"), cache_limit="lots")
