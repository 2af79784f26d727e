"""A fastload loader rebuilt as torch's (what Accelerate's ``prepare`` and ``Trainer`` do) says
so at its first batch; fastload's own iteration, and a fastload loader re-created from the
first one's attributes (what Lightning does), say nothing."""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fastload
from fastload.errors import RebuiltLoaderWarning

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("rebuilt") / "tokens.h5", 200, 64)


def _loader(h5: Path, **options: object) -> fastload.DataLoader:
    return fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, length_grouped=True, **options)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fastload_iterating_its_own_sampler_does_not_warn(h5: Path, num_workers: int) -> None:
    loader = _loader(h5, num_workers=num_workers, persistent_workers=num_workers > 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the second epoch resets persistent workers' iterator
            assert sum(1 for _ in loader) == len(loader)


def test_a_torch_loader_rebuilt_from_a_fastload_loader_warns_at_its_first_batch(h5: Path) -> None:
    loader = _loader(h5)
    # What accelerate.data_loader.prepare_data_loader does with a single process.
    rebuilt = torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn
    )
    with pytest.warns(RebuiltLoaderWarning, match=r"fastload\.accelerate\.prepare"):
        next(iter(rebuilt))
    with warnings.catch_warnings():  # once per loader, not once per epoch
        warnings.simplefilter("error")
        assert sum(1 for _ in rebuilt) == len(loader)


def test_a_fastload_loader_recreated_from_the_attributes_takes_the_sampler_over(h5: Path) -> None:
    first = _loader(h5)
    second = fastload.DataLoader(
        first.dataset, batch_sampler=first.batch_sampler, collate_fn=first.collate_fn, length_grouped=True
    )
    assert second.batch_sampler is first.batch_sampler
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(1 for _ in second) == len(first)


def test_a_copy_of_the_sampler_belongs_to_no_loader(h5: Path) -> None:
    copy = pickle.loads(pickle.dumps(_loader(h5).batch_sampler))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(copy)) == 25
