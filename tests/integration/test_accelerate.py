"""``fastload.accelerate.prepare`` with a real ``accelerate.Accelerator`` on CPU: the supported
call keeps fastload's loader and engine; ``accelerator.prepare(loader)`` rebuilds it as torch's
and warns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator

import fastload
import fastload.accelerate
from fastload._integrations._causal import CausalLMCollate
from fastload.errors import RebuiltLoaderWarning

sys.path.insert(0, str(Path(__file__).parent))
from _lm_files import tiny_llama, write_lm_file


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lm_file(tmp_path_factory.mktemp("accel") / "lm.h5", 200)


def _loader(h5: Path, **options: object) -> fastload.DataLoader:
    return fastload.DataLoader(
        fastload.HDF5Dataset(h5, fields=["input_ids"]),
        batch_size=8,
        length_grouped=True,
        collate_fn=CausalLMCollate(),
        **{"num_workers": 1, **options},
    )


@pytest.mark.slow
def test_prepare_keeps_the_fastload_loader_and_trains_from_its_engine(h5: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = _loader(h5)
    prepared = fastload.accelerate.prepare(accelerator, loader)
    assert prepared is loader  # on the CPU nothing needs re-creating

    losses = []
    for batch in prepared:
        batch.pop("lengths")
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert loader.stats().batches == len(losses) == 25  # every batch through fastload
    assert loader.stats().num_workers == 1
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])


def test_accelerator_prepare_rebuilds_the_loader_and_that_warns(h5: Path) -> None:
    accelerator = Accelerator(cpu=True)
    loader = _loader(h5, num_workers=0)
    rebuilt = accelerator.prepare(loader)
    assert not isinstance(rebuilt, fastload.DataLoader)  # accelerate's DataLoaderShard
    with pytest.warns(RebuiltLoaderWarning, match=r"accelerator\.prepare"):
        batches = sum(1 for _ in rebuilt)
    assert batches == 25
    assert loader.stats().batches == 0  # fastload's engine delivered nothing


def test_prepare_refuses_a_loader_sharded_for_another_world(h5: Path) -> None:
    accelerator = Accelerator(cpu=True)
    sampler = fastload.LengthGroupedBatchSampler(
        fastload.HDF5Dataset(h5).lengths, batch_size=8, num_replicas=2, rank=1
    )
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_sampler=sampler)
    with pytest.raises(ValueError, match=r"rank 1 of 2, but this is process 0 of 1"):
        fastload.accelerate.prepare(accelerator, loader)
    with pytest.raises(TypeError, match=r"takes a fastload\.DataLoader"):
        fastload.accelerate.prepare(accelerator, torch.utils.data.DataLoader(range(4)))  # type: ignore[arg-type]
