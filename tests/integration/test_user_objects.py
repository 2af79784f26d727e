"""A user's objects are not mistaken for fastload's: a plain dataset whose own attributes are
named like a capability (``fields``, ``lengths``, ``remote``) loads as torch's DataLoader loads
it, and a ``PadCollate`` subclass's own methods are called as torch's DataLoader calls them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file

N = 24


def _docs() -> list[dict[str, Any]]:
    rng = np.random.default_rng(5)
    return [{"input_ids": torch.arange(1, int(rng.integers(2, 30)))} for _ in range(N)]


class PlainDocs(torch.utils.data.Dataset[dict[str, Any]]):
    """Sample dicts, with ``lengths`` for packing and nothing named like a capability."""

    def __init__(self) -> None:
        self.items = _docs()
        self.lengths = np.array([len(d["input_ids"]) for d in self.items], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


class OwnAttributes(PlainDocs):
    """The same samples, with attributes of its own that bear capabilities' names."""

    def __init__(self) -> None:
        super().__init__()
        self.fields = {"input_ids": [1, 2, 3], "source": ["web"]}  # the user's own metadata
        self.lengths = [len(d["input_ids"]) for d in self.items]  # a list, not an array
        self.remote = True  # the user's own flag: read from a network mount


#: Attributes of a user's own, named like the rest of fastload's capabilities; none of them is
#: what the capability of that name is.
OWN_ATTRIBUTES: dict[str, Any] = {
    "read_batch": "batches of 64",  # a note, not a method
    "pack_rows": "as many as fit",  # a note, not a row count
    "__getitems__": ("not", "a", "method"),  # truthy, and not callable
}


def _with_own(attribute: str) -> PlainDocs:
    return type("OwnNamed", (PlainDocs,), {attribute: OWN_ATTRIBUTES[attribute]})()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _pad(batch: list[dict[str, Any]]) -> dict[str, Any]:
    ids = torch.nn.utils.rnn.pad_sequence([d["input_ids"] for d in batch], batch_first=True)
    return {"input_ids": ids}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_dataset_with_attributes_named_like_capabilities_loads_as_torch_loads_it(
    num_workers: int,
) -> None:
    kwargs: dict[str, Any] = {"batch_size": 5, "collate_fn": _pad, "num_workers": num_workers}
    expected = list(torch.utils.data.DataLoader(OwnAttributes(), **kwargs))
    loader = fastload.DataLoader(OwnAttributes(), **kwargs)
    got = list(loader)
    assert len(got) == len(expected) == 5
    assert all(_same(a, b) for a, b in zip(got, expected, strict=True))
    # Its ``remote`` flag does not make fastload pick another start method than torch's.
    assert loader.multiprocessing_context is None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_dataset_with_attributes_named_like_capabilities_packs_as_a_plain_one(
    num_workers: int,
) -> None:
    kwargs: dict[str, Any] = {"pack_length": 16, "batch_size": 3, "num_workers": num_workers, "seed": 3}
    expected = list(fastload.DataLoader(PlainDocs(), **{**kwargs, "num_workers": 0}))
    got = list(fastload.DataLoader(OwnAttributes(), **kwargs))
    assert len(got) == len(expected) > 1
    assert all(_same(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("attribute", sorted(OWN_ATTRIBUTES))
@pytest.mark.parametrize("pack_length", [None, 16])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_dataset_with_its_own_attribute_named_like_a_capability_loads_every_sample(
    num_workers: int, pack_length: int | None, attribute: str
) -> None:
    # torch's loader would call a truthy ``__getitems__`` and fail: what fastload gives is what
    # torch gives for the same samples without the attribute.
    if pack_length is None:
        kwargs: dict[str, Any] = {"batch_size": 5, "collate_fn": _pad, "num_workers": num_workers}
        expected = list(torch.utils.data.DataLoader(PlainDocs(), **{**kwargs, "num_workers": 0}))
    else:
        kwargs = {"pack_length": pack_length, "batch_size": 3, "num_workers": num_workers, "seed": 3}
        expected = list(fastload.DataLoader(PlainDocs(), **{**kwargs, "num_workers": 0}))
    got = list(fastload.DataLoader(_with_own(attribute), **kwargs))
    assert len(got) == len(expected) > 1
    assert all(_same(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_of_dicts_packed_reports_its_packing_efficiency(num_workers: int) -> None:
    loader = fastload.DataLoader(OwnAttributes(), pack_length=16, batch_size=3, num_workers=num_workers)
    batches = list(loader)
    real = sum(len(d["input_ids"]) for d in _docs())
    efficiency = loader.stats().packing_efficiency
    assert efficiency == pytest.approx(real / (len(batches) * 3 * 16))


# -- PadCollate subclasses ----------------------------------------------------------------------


class AddsAField(fastload.PadCollate):
    """Overrides ``__call__``: torch's loader calls it, and so must fastload's."""

    def __call__(self, batch: Any) -> dict[str, Any]:
        out = super().__call__(batch)
        out["doubled"] = out["tokens"] * 2
        return out


class MultipliesIds(fastload.PadCollate):
    """Overrides ``collate_into`` (the slot half): the ids it writes are multiplied by 10."""

    def collate_into(self, batch: Any, out: Any) -> None:
        super().collate_into(batch, out)
        out["tokens"] *= 10


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("subclass") / "t.h5", samples=40, max_length=30, seed=2)


def _reference(path: Path, length_grouped: bool) -> list[dict[str, Any]]:
    kwargs: dict[str, Any] = {"batch_size": 6, "length_grouped": length_grouped, "seed": 1}
    return list(fastload.DataLoader(fastload.HDF5Dataset(path), collate_fn=fastload.PadCollate(), **kwargs))


@pytest.mark.parametrize("length_grouped", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pad_collate_subclass_overriding_call_is_called(
    token_file: Path, num_workers: int, length_grouped: bool
) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(token_file), batch_size=6, num_workers=num_workers,
        length_grouped=length_grouped, seed=1, collate_fn=AddsAField(),
    )  # fmt: skip
    got = list(loader)
    reference = _reference(token_file, length_grouped)
    assert len(got) == len(reference)
    for batch, plain in zip(got, reference, strict=True):
        assert torch.equal(batch["doubled"], plain["tokens"] * 2)
        assert torch.equal(batch["tokens"], plain["tokens"])


@pytest.mark.parametrize("length_grouped", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pad_collate_subclass_overriding_collate_into_is_called(
    token_file: Path, num_workers: int, length_grouped: bool
) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(token_file), batch_size=6, num_workers=num_workers,
        length_grouped=length_grouped, seed=1, collate_fn=MultipliesIds(),
    )  # fmt: skip
    got = list(loader)
    reference = _reference(token_file, length_grouped)
    assert len(got) == len(reference)
    for batch, plain in zip(got, reference, strict=True):
        assert torch.equal(batch["tokens"], plain["tokens"] * 10)
        assert torch.equal(batch["attention_mask"], plain["attention_mask"])


def test_a_pad_collate_subclass_is_called_by_torchs_loader_as_by_fastloads(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(token_file)
    for collate in (AddsAField(), MultipliesIds()):
        ours = list(fastload.DataLoader(dataset, batch_size=6, collate_fn=collate))
        torchs = list(torch.utils.data.DataLoader(dataset, batch_size=6, collate_fn=collate))
        assert all(_same(a, b) for a, b in zip(ours, torchs, strict=True))
