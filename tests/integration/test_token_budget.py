"""The token budget holds for the batches the collate builds: ``max_tokens`` bounds
``rows * padded length`` where the padded length is the longest row rounded up to the collate's
``pad_to_multiple_of``, on the fast path with and without workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("budget") / "data.h5", 600, 200, seed=4)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("multiple", [8, 64])
def test_no_batch_exceeds_max_tokens_once_padded_to_the_collates_multiple(
    h5: Path, num_workers: int, multiple: int
) -> None:
    budget = 1024
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5),
        max_tokens=budget,
        collate_fn=fastload.PadCollate(pad_to_multiple_of=multiple),
        num_workers=num_workers,
    )
    shapes = [tuple(batch["tokens"].shape) for batch in loader]
    assert sum(rows for rows, _ in shapes) == 600
    assert all(width % multiple == 0 for _, width in shapes)
    assert max(rows * width for rows, width in shapes) <= budget


def test_a_batch_sampler_planned_for_a_coarser_multiple_than_the_collate_is_refused(h5: Path) -> None:
    dataset = fastload.HDF5Dataset(h5)
    sampler = fastload.LengthGroupedBatchSampler(dataset.lengths, max_tokens=1024, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="pad_to_multiple_of=64"):
        fastload.DataLoader(dataset, batch_sampler=sampler, collate_fn=fastload.PadCollate(pad_to_multiple_of=64))


def test_a_collate_whose_pad_to_multiple_of_is_not_an_int_is_named(h5: Path) -> None:
    class Odd:
        pad_to_multiple_of = "eight"

        def __call__(self, batch: object) -> object:
            return batch

    with pytest.raises(TypeError, match=r"Odd.*pad_to_multiple_of.*'eight'"):
        fastload.DataLoader(fastload.HDF5Dataset(h5), max_tokens=1024, collate_fn=Odd())


def test_the_default_collate_rounds_nothing(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), max_tokens=1024)
    assert max(int(torch.tensor(b["tokens"].shape).prod()) for b in loader) <= 1024
