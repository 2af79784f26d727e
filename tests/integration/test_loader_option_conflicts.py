"""Options that contradict each other, or that the loader would silently ignore, are refused at
construction, naming the options as the user typed them; lengths that make length grouping or
a token budget pointless (all equal) are warned about once, naming the dataset and the field."""

from __future__ import annotations

import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _token_files import write_token_file

import fastload
from fastload.errors import UniformLengthsWarning


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("conflicts") / "tokens.h5", 60, 150)


@pytest.fixture(scope="module")
def raw_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conflicts") / "corpus.parquet"
    pq.write_table(pa.table({"text": [f"line {i} " * (i % 7 + 1) for i in range(40)]}), path)
    return path


def test_packing_by_token_budget_refuses_a_batch_size_it_would_ignore(tokens: Path) -> None:
    with pytest.raises(ValueError, match=r"pack_length=64 with max_tokens=100 .* batch_size=4 would be ignored"):
        fastload.DataLoader(fastload.HDF5Dataset(tokens), pack_length=64, max_tokens=100, batch_size=4)
    # batch_size that agrees with the budget, and torch's default, are accepted.
    for batch_size in (1, None):
        loader = fastload.DataLoader(
            fastload.HDF5Dataset(tokens), pack_length=64, max_tokens=128, batch_size=batch_size
        )
        assert loader.batch_sampler.rows == 2


def test_packing_refuses_a_token_budget_below_one_row_in_its_own_words(tokens: Path) -> None:
    with pytest.raises(ValueError, match=r"max_tokens=32 is less than pack_length=64"):
        fastload.DataLoader(fastload.HDF5Dataset(tokens), pack_length=64, max_tokens=32)


def test_readahead_without_workers_is_refused(tokens: Path) -> None:
    with pytest.raises(ValueError, match=r"readahead=True .* num_workers=0"):
        fastload.DataLoader(fastload.HDF5Dataset(tokens), readahead=True)


def test_download_concurrency_for_a_local_dataset_is_refused(tokens: Path) -> None:
    with pytest.raises(ValueError, match=r"download_concurrency=8 .* HDF5Dataset .* local"):
        fastload.DataLoader(fastload.HDF5Dataset(tokens), download_concurrency=8)


@pytest.mark.parametrize("option", [{"length_grouped": True, "batch_size": 4}, {"max_tokens": 64}])
def test_equal_lengths_under_length_grouping_warn_naming_dataset_and_field(
    raw_text: Path, option: dict[str, object]
) -> None:
    dataset = fastload.ArrowDataset(raw_text)
    with pytest.warns(UniformLengthsWarning) as caught:
        fastload.DataLoader(dataset, **option)
    (warning,) = caught
    text = str(warning.message)
    assert "ArrowDataset" in text and "all 40 lengths are 1" in text
    assert "no ragged field" in text and "'text'" in text


def test_varied_lengths_do_not_warn(tokens: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastload.DataLoader(fastload.HDF5Dataset(tokens), batch_size=4, length_grouped=True)
        fastload.DataLoader(fastload.HDF5Dataset(tokens), pack_length=64, batch_size=2)
