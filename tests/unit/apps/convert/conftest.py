"""Fixtures of the converter tests: run a conversion in this process, and read the written
layout back with plain h5py (independent of fastload's own reader)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from fastload._apps._convert._convert import ConvertReport, convert
from fastload._apps._convert._convert_options import ConvertOptions

Run = Callable[..., ConvertReport]


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """``run(*inputs, out="out.h5", **options)``: convert into ``tmp_path / out``."""

    def _run(*inputs: str | Path, out: str = "out.h5", **options: object) -> ConvertReport:
        return convert(
            ConvertOptions(inputs=tuple(map(str, inputs)), output=tmp_path / out, **options)
        )  # type: ignore[arg-type]

    return _run


def ragged(path: Path, name: str = "input_ids") -> list[np.ndarray]:
    """Every sample of ragged field ``name``, checking the layout invariants on the way."""
    with h5py.File(path, "r") as f:
        values, offsets = f[name]["values"], f[name]["offsets"][:]
        assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == values.shape[0]
        assert np.all(np.diff(offsets) >= 0)
        assert f.attrs["num_samples"] == offsets.shape[0] - 1
        data = values[:]
        return [data[a:b] for a, b in itertools.pairwise(offsets)]


def texts(path: Path, name: str = "input_ids") -> list[str]:
    """The samples of a byte-tokenized field, decoded."""
    return [bytes(sample).decode("utf-8") for sample in ragged(path, name)]


def fixed(path: Path, name: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[name][:]


def lengths(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["lengths"][:]


def is_contiguous(dataset: h5py.Dataset) -> bool:
    return dataset.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A tiny word-level tokenizer.json built locally (never downloaded): ids 0..5 for
    ``[UNK] [BOS] hello world the cat``, whitespace pre-tokenization, ``[BOS]`` prepended as a
    special token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[BOS]": 1, "hello": 2, "world": 3, "the": 4, "cat": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["[BOS]"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)]
    )
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path
