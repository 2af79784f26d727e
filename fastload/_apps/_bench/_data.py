"""The data side of ``fastload bench``: open DATA with the right reader and fix the batch plan
that every configuration, fastload's and torch's, then loads.

The plan is computed once, before any measurement: lists of sample indices (length-grouped
when the dataset has a ragged field, else a seeded shuffle), or with ``--pack N`` packed batches
(``PackedBatchSampler``'s), and, per batch, its rows, real tokens and padded tokens (rows * the
longest row, as ``PadCollate`` pads by default; packed: rows * N). Counting from the plan costs
nothing during the measured loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

import fastload
from fastload._remote import is_remote
from fastload._types import PackedBatch
from fastload.errors import DataFileNotFoundError, DataFormatError, UsageError

HDF5_SUFFIXES = (".h5", ".hdf5")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".parquet")


def open_dataset(data: str, remote: Mapping[str, Any] | None = None) -> Any:
    """``fastload.HDF5Dataset`` for ``.h5``/``.hdf5`` (or a folder holding such files),
    ``fastload.ArrowDataset`` for Arrow IPC, Feather and Parquet (or any other folder, e.g. a
    Hugging Face ``save_to_disk`` folder). Missing files raise
    :class:`~fastload.errors.DataFileNotFoundError`, unreadable ones
    :class:`~fastload.errors.DataFormatError`.

    A URL (``s3://``, ``gs://``, ``https://``) is opened with the keyword arguments ``remote``
    (``storage_options``, ``cache_dir``, ``cache_limit``): by its suffix when it names files,
    else (a folder) as HDF5, and as Arrow when its index says the shards are Arrow."""
    if is_remote(data):
        options = dict(remote or {})
        suffix = PurePosixPath(data.rstrip("/")).suffix.lower()
        if suffix in ARROW_SUFFIXES:
            return fastload.ArrowDataset(data, **options)
        try:
            return fastload.HDF5Dataset(data, **options)
        except DataFormatError:
            if suffix in HDF5_SUFFIXES:
                raise
            # A folder's shards are HDF5 or Arrow, as its index says; a fault of the index
            # itself fails as Arrow too, with the same message.
            return fastload.ArrowDataset(data, **options)
    if remote:
        raise UsageError(
            f"DATA {data}: --storage-option, --cache-dir and --cache-limit are for a remote DATA"
            " (s3://, gs://, https://); a local path is read in place"
        )
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
    ragged field); ``skipped`` counts samples longer than ``max_tokens``, left out.
    ``pack_length``: the batches are :class:`~fastload._types.PackedBatch` rows of that many
    tokens (``None``: lists of sample indices)."""

    batches: tuple[list[int] | PackedBatch, ...]
    rows: tuple[int, ...]
    real_tokens: tuple[int, ...] | None
    padded_tokens: tuple[int, ...] | None
    skipped: int = 0
    pack_length: int | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def counts(self, index: int) -> tuple[int, int | None, int | None]:
        """Rows, real tokens and padded tokens of batch ``index``."""
        if self.real_tokens is None or self.padded_tokens is None:
            return self.rows[index], None, None
        return self.rows[index], self.real_tokens[index], self.padded_tokens[index]

    @property
    def padding_efficiency(self) -> float | None:
        """Real over padded tokens of padded batches (``None`` for packed ones)."""
        return None if self.pack_length is not None else self._real_share()

    @property
    def packing_efficiency(self) -> float | None:
        """Real tokens over rows * ``pack_length`` of packed batches (``None`` otherwise)."""
        return None if self.pack_length is None else self._real_share()

    def _real_share(self) -> float | None:
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
    dataset: Any,
    *,
    batches: int,
    batch_size: int | None,
    max_tokens: int | None,
    seed: int = 0,
    pack_length: int | None = None,
) -> BatchPlan:
    """``batches`` batches: length-grouped (``LengthGroupedBatchSampler`` with ``batch_size``
    and/or ``max_tokens``, shuffled with ``seed``, epoch after epoch until there are enough) when
    the dataset has a ragged field; else ``batch_size`` samples of a seeded permutation. With
    ``pack_length``, packed batches of that ``seq_len`` (see :func:`make_packed_plan`)."""
    lengths = dataset_lengths(dataset)
    if len(dataset) == 0:
        raise UsageError(f"DATA {describe(dataset)} holds no samples; there is nothing to load")
    if pack_length is not None:
        if lengths is None:
            raise UsageError(
                f"--pack needs a ragged field to pack; {describe(dataset)} has only fixed and "
                f"object fields ({', '.join(dataset.fields)})"
            )
        return make_packed_plan(
            lengths, batches=batches, seq_len=pack_length, rows=batch_size,
            max_tokens=max_tokens, seed=seed,
        )
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


def make_packed_plan(
    lengths: np.ndarray,
    *,
    batches: int,
    seq_len: int,
    rows: int | None,
    max_tokens: int | None,
    seed: int = 0,
) -> BatchPlan:
    """``batches`` packed batches of ``PackedBatchSampler`` (``rows`` rows, or ``max_tokens //
    seq_len``; samples longer than ``seq_len`` split; shuffled with ``seed``, epoch after epoch
    until there are enough); a :class:`UsageError` repeats the sampler's reason for bad
    options."""
    try:
        sampler = fastload.PackedBatchSampler(
            lengths,
            seq_len=seq_len,
            rows=rows if max_tokens is None else None,
            max_tokens=max_tokens,
            shuffle=True,
            seed=seed,
            num_replicas=1,
            rank=0,
        )
    except ValueError as error:
        raise UsageError(f"--pack {seq_len}: {error}") from None
    if rows is not None and max_tokens is not None and rows != sampler.rows:
        raise UsageError(
            f"--pack {seq_len} with --max-tokens {max_tokens} makes batches of {sampler.rows} "
            f"rows, but --batch-size says {rows}: give one of them"
        )
    if len(sampler) == 0:
        raise UsageError(f"--pack {seq_len}: the data holds no token to pack")
    plan: list[PackedBatch] = []
    epoch = 0
    while len(plan) < batches:
        sampler.set_epoch(epoch)
        plan.extend(sampler)
        epoch += 1
    plan = plan[:batches]
    return BatchPlan(
        tuple(plan),
        tuple(b.rows for b in plan),
        tuple(b.num_tokens for b in plan),
        tuple(b.rows * seq_len for b in plan),
        pack_length=seq_len,
    )


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
