"""A collate that returns nested tensors: the batches come back from the workers as torch's
DataLoader returns them (nested, the same values), in both layouts."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import fastload


class Ragged(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(i % 5 + 1, dtype=torch.float32) + i


class Nest:
    """A collate_fn: the samples as one nested tensor of ``layout``."""

    def __init__(self, layout: torch.layout) -> None:
        self.layout = layout

    def __call__(self, batch: list[torch.Tensor]) -> torch.Tensor:
        with warnings.catch_warnings():  # the strided layout is a prototype, and says so
            warnings.simplefilter("ignore", UserWarning)
            return torch.nested.nested_tensor(batch, layout=self.layout)


def _rows(batch: torch.Tensor) -> list[list[float]]:
    assert batch.is_nested
    return [row.tolist() for row in batch.unbind()]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_nested_tensors_come_back_from_workers_as_from_torchs_loader(layout: torch.layout, num_workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": num_workers, "collate_fn": Nest(layout)}
    expected = [_rows(b) for b in torch.utils.data.DataLoader(Ragged(), **kwargs)]
    got = list(fastload.DataLoader(Ragged(), **kwargs))
    assert [b.layout for b in got] == [layout] * 3
    assert [_rows(b) for b in got] == expected
