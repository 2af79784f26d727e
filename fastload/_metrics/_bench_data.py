"""The data side of ``fastload bench``: open DATA with the right reader and fix the batch plan
that every configuration, fastload's and torch's, then loads.

The plan is computed once, before any measurement: lists of sample indices (length-grouped
when the dataset has a ragged field, else a seeded shuffle) and, per batch, its rows, real
tokens and padded tokens (rows * the longest row, as ``PadCollate`` pads by default). Counting
from the plan costs nothing during the measured loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fastload
from fastload.errors import DataFileNotFoundError, UsageError

HDF5_SUFFIXES = (".h5", ".hdf5")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".parquet")


def open_dataset(data: str) -> Any:
    """``fastload.HDF5Dataset`` for ``.h5``/``.hdf5`` (or a folder holding such files),
    ``fastload.ArrowDataset`` for Arrow IPC, Feather and Parquet (or any other folder, e.g. a
    Hugging Face ``save_to_disk`` folder). Missing files raise
    :class:`~fastload.errors.DataFileNotFoundError`, unreadable ones
    :class:`~fastload.errors.DataFormatError`."""
    path = Path(data)
    suffix = path.suffix.lower()
    if suffix in HDF5_SUFFIXES:
        return fastload.HDF5Dataset(data)
    if suffix in ARROW_SUFFIXES:
        return fastload.ArrowDataset(data)
    if path.is_dir():
        if any(p.suffix.lower() in HDF5_SUFFIXES for p in path.iterdir()):
            return fastload.HDF5Dataset(data)
        return fastload.ArrowDataset(data)
    if not path.exists():
        raise DataFileNotFoundError(f"{data}: no such file or directory", data)
    raise UsageError(
        f"DATA {data}: unknown file type {suffix or '(no extension)'}; expected "
        f"{', '.join(HDF5_SUFFIXES)} (HDF5Dataset) or {', '.join(ARROW_SUFFIXES)} (ArrowDataset)"
    )


@dataclass(frozen=True)
class BatchPlan:
    """The batches every configuration loads, with their sizes counted up front.

    ``rows[i]`` is batch ``i``'s number of samples; ``real_tokens[i]`` and ``padded_tokens[i]``
    its tokens of the length field before and after padding (``None`` when the dataset has no
    ragged field); ``skipped`` counts samples longer than ``max_tokens``, left out."""

    batches: tuple[list[int], ...]
    rows: tuple[int, ...]
    real_tokens: tuple[int, ...] | None
    padded_tokens: tuple[int, ...] | None
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.batches)

    def counts(self, index: int) -> tuple[int, int | None, int | None]:
        """Rows, real tokens and padded tokens of batch ``index``."""
        if self.real_tokens is None or self.padded_tokens is None:
            return self.rows[index], None, None
        return self.rows[index], self.real_tokens[index], self.padded_tokens[index]

    @property
    def padding_efficiency(self) -> float | None:
        if self.real_tokens is None or self.padded_tokens is None or not sum(self.padded_tokens):
            return None
        return sum(self.real_tokens) / sum(self.padded_tokens)


def dataset_lengths(dataset: Any) -> np.ndarray | None:
    """The per-sample lengths of the dataset's length field, ``None`` if it has no ragged
    field."""
    if dataset.length_field is None:
        return None
    return np.asarray(dataset.lengths)


def make_plan(
    dataset: Any, *, batches: int, batch_size: int | None, max_tokens: int | None, seed: int = 0
) -> BatchPlan:
    """``batches`` batches: length-grouped (``LengthGroupedBatchSampler`` with ``batch_size``
    and/or ``max_tokens``, shuffled with ``seed``, epoch after epoch until there are enough) when
    the dataset has a ragged field; else ``batch_size`` samples of a seeded permutation."""
    lengths = dataset_lengths(dataset)
    if len(dataset) == 0:
        raise UsageError(f"DATA {describe(dataset)} holds no samples; there is nothing to load")
    if lengths is None:
        if max_tokens is not None:
            raise UsageError(
                f"--max-tokens needs a ragged field to count tokens in; {describe(dataset)} has "
                f"only fixed and object fields ({', '.join(dataset.fields)}): use --batch-size"
            )
        return _shuffled_plan(len(dataset), batches, batch_size or 1, seed)
    sampler = fastload.LengthGroupedBatchSampler(
        lengths,
        batch_size=batch_size,
        max_tokens=max_tokens,
        shuffle=True,
        seed=seed,
        oversize="skip",
        num_replicas=1,
        rank=0,
    )
    if len(sampler) == 0:
        raise UsageError(
            f"--max-tokens {max_tokens} is below every sample's length in {describe(dataset)}: "
            "no batch can be formed"
        )
    plan: list[list[int]] = []
    epoch = 0
    while len(plan) < batches:
        sampler.set_epoch(epoch)
        plan.extend(list(map(int, b)) for b in sampler)
        epoch += 1
    plan = plan[:batches]
    rows = tuple(len(b) for b in plan)
    real = tuple(int(lengths[b].sum()) for b in plan)
    padded = tuple(len(b) * int(lengths[b].max()) for b in plan)
    return BatchPlan(tuple(plan), rows, real, padded, skipped=int(sampler.skipped))


def _shuffled_plan(samples: int, batches: int, batch_size: int, seed: int) -> BatchPlan:
    rng = np.random.default_rng(seed)
    plan: list[list[int]] = []
    while len(plan) < batches:
        order = rng.permutation(samples)
        plan.extend(order[i : i + batch_size].tolist() for i in range(0, samples, batch_size))
    plan = plan[:batches]
    return BatchPlan(tuple(plan), tuple(len(b) for b in plan), None, None)


def describe(dataset: Any) -> str:
    files = dataset.files
    return files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more files)"
