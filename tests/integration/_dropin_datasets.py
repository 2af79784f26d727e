"""Datasets, samplers, collate functions and comparison helpers for the drop-in tests.

Everything here is defined at module level so that worker processes of every start method (fork,
spawn, forkserver) can unpickle it by reference: the test modules put this folder on ``sys.path``
before importing it, and spawn and forkserver children receive the parent's ``sys.path``.

Each dataset is deterministic given the worker's random state, so running it under torch's
DataLoader and under ``fastload.DataLoader`` must give the same batches.
"""

from __future__ import annotations

import collections
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

# Rebound by a test in the parent before workers start: a forked worker sees the new value, a
# spawned or forkserver worker imports this module afresh and sees this one.
PARENT_MARKER = "fresh import"

# Set in each worker by ``set_worker_state`` (a worker_init_fn) and read back by ``WorkerState``.
WORKER_STATE: int | None = None


# -- comparison ---------------------------------------------------------------------------------
def assert_same(expected: Any, actual: Any, path: str = "batch") -> None:
    """Recursive exact equality that also checks types, dtypes, shapes, strides and
    namedtuple/dict classes, and names the first differing path."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert actual.stride() == expected.stride(), f"{path}: strides differ"
        assert torch.equal(actual, expected), f"{path}: values differ:\n{actual}\n!=\n{expected}"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert actual.strides == expected.strides, (
            f"{path}: strides {actual.strides} != {expected.strides}"
        )
        assert actual.flags.writeable == expected.flags.writeable, f"{path}: writeable differs"
        np.testing.assert_array_equal(actual, expected, err_msg=path)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def batch_key(batch: Any) -> str:
    """A hashable rendering of a batch, to compare batches as multisets."""
    if isinstance(batch, torch.Tensor):
        return f"tensor{batch.dtype}{batch.tolist()}"
    if isinstance(batch, dict):
        return "{" + ",".join(f"{k}:{batch_key(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return "[" + ",".join(batch_key(v) for v in batch) + "]"
    return repr(batch)


# -- map-style datasets -------------------------------------------------------------------------
class Indexed(Dataset[torch.Tensor]):
    """Sample ``i`` is the tensor ``[i, i*i]`` (int64)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} out of range 0..{self.n - 1}")
        return torch.tensor([i, i * i])


class Point(NamedTuple):
    x: float
    label: str


class RichSamples(Dataset[dict[str, Any]]):
    """Samples with every kind of leaf ``default_collate`` has a rule for: tensors (several
    dtypes), numpy arrays and scalars, Python ints, floats and bools, strings, bytes, nested dicts,
    an OrderedDict, a namedtuple, tuples and lists."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "tensor": torch.arange(3, dtype=torch.float32) + i,
            "half": torch.full((2, 2), i, dtype=torch.float16),
            "mask": torch.tensor([i % 2 == 0, True]),
            "array": np.arange(4, dtype=np.int16) * i,
            "np_scalar": np.float64(i) / 4,
            "np_int": np.int32(i),
            "int": i,
            "float": i / 3,
            "bool": i % 3 == 0,
            "str": f"sample-{i}",
            "bytes": bytes([i % 256]),
            "nested": {"inner": [i, i + 1], "pair": (torch.tensor(i), f"n{i}")},
            "ordered": collections.OrderedDict([("b", i), ("a", -i)]),
            "point": Point(x=i * 0.5, label=f"p{i}"),
        }


class ReadPath(Dataset[dict[str, Any]]):
    """Reports whether a sample was read through ``__getitems__`` (the batch) or ``__getitem__``,
    and the size of the batch ``__getitems__`` was asked for."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "via": "getitem", "request": 1}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{"i": i, "via": "getitems", "request": len(indices)} for i in indices]


class Keyed(Dataset[dict[str, Any]]):
    """A dataset indexed by string keys (used with a sampler that yields keys)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, key: str) -> dict[str, Any]:
        if key not in self.keys:
            raise KeyError(key)
        return {"key": key, "rank": self.keys.index(key)}


class WorkerProbe(Dataset[dict[str, Any]]):
    """Each sample records what the process that read it sees: ``get_worker_info()`` fields, the
    seeds and the next draw of torch's, Python's and numpy's global generators, torch's thread
    count. ``-1`` stands for "no worker info" (the main process)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = get_worker_info()
        return {
            "index": i,
            "worker_id": info.id if info is not None else -1,
            "num_workers": info.num_workers if info is not None else -1,
            "info_seed": info.seed if info is not None else -1,
            "info_dataset_is_self": info is not None and info.dataset is self,
            "initial_seed": torch.initial_seed(),
            "torch_rand": torch.rand(2),
            "py_random": random.random(),
            "np_random": int(np.random.randint(0, 2**31 - 1)),
            "threads": torch.get_num_threads(),
        }


class Noisy(Dataset[torch.Tensor]):
    """A randomly augmented sample: ``i`` plus noise from torch's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return i + torch.rand(3)


class WorkerState(Dataset[tuple[int, int]]):
    """Sample ``i`` is ``(i, WORKER_STATE)``: what ``set_worker_state`` left in this process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, -1 if WORKER_STATE is None else WORKER_STATE


class PidReporter(Dataset[int]):
    """Sample ``i`` is the pid of the process that read it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return os.getpid()


class StartMethodProbe(Dataset[dict[str, Any]]):
    """Reports what tells the start methods apart: a forked worker inherits the parent's
    ``PARENT_MARKER``; a forkserver worker's parent is the fork server, not the main process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "marker": PARENT_MARKER, "ppid": os.getppid()}


class EpochTagged(Dataset[tuple[int, int]]):
    """A dataset with ``set_epoch`` state: sample ``i`` is ``(i, epoch)`` as the reading process
    sees it (persistent workers keep the copy they started with)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, self.epoch


class FetchLog(Dataset[int]):
    """Creates the file ``<folder>/<i>`` when sample ``i`` is read, so that the parent can see
    which samples the workers have fetched so far."""

    def __init__(self, n: int, folder: Path) -> None:
        self.n = n
        self.folder = str(folder)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        Path(self.folder, str(i)).touch()
        return i


class Sleepy(Dataset[int]):
    """Sample ``i`` is ``i``; reading sample ``sleep_at`` first sleeps ``delay_s`` seconds."""

    def __init__(self, n: int, sleep_at: int, delay_s: float) -> None:
        self.n = n
        self.sleep_at = sleep_at
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.sleep_at:
            time.sleep(self.delay_s)
        return i


class CustomLoadError(Exception):
    """A user's own exception type, raised by ``Faulty(kind="custom")``."""


class TwoArgError(Exception):
    """An exception whose constructor needs two arguments, so it cannot be rebuilt from a
    message alone (torch re-raises it as ``RuntimeError``)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


def make_error(kind: str, message: str) -> Exception:
    """The exception ``Faulty`` raises for ``kind``: "value", "key", "custom" or "two-arg"."""
    if kind == "value":
        return ValueError(message)
    if kind == "key":
        return KeyError(message)
    if kind == "custom":
        return CustomLoadError(message)
    if kind == "two-arg":
        return TwoArgError(7, message)
    raise ValueError(f"unknown error kind {kind!r}; expected value, key, custom or two-arg")


class Faulty(Dataset[int]):
    """Sample ``i`` is ``i``, except that reading sample ``bad`` raises ``make_error(kind)`` with
    the message ``"sample <bad> is corrupt"``."""

    def __init__(self, n: int, bad: int, kind: str) -> None:
        self.n = n
        self.bad = bad
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise make_error(self.kind, f"sample {i} is corrupt")
        return i


class StopsEarly(Dataset[int]):
    """A map-style dataset whose ``__getitem__`` raises ``StopIteration`` at ``stop_at`` (the
    legacy way some datasets signal their end)."""

    def __init__(self, n: int, stop_at: int) -> None:
        self.n = n
        self.stop_at = stop_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i >= self.stop_at:
            raise StopIteration
        return i


class ArrayPayload(Dataset[dict[str, Any]]):
    """Numpy arrays of several dtypes and memory layouts, large enough (64 KiB and more) that a
    loader may move them through shared memory instead of pickling them, and a transposed
    (non-contiguous) tensor."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        base = np.arange(128 * 128, dtype=np.float32).reshape(128, 128) + i
        return {
            "f32": base,
            "fortran": np.asfortranarray(base),
            "u16": (base % 60000).astype(np.uint16),
            "f16": base.astype(np.float16),
            "c64": base.astype(np.complex64),
            "bool": base.astype(np.int64) % 3 == 0,
            "small": np.arange(5, dtype=np.int64) + i,
            "transposed": (torch.arange(64 * 64).reshape(64, 64) + i).t(),
        }


# -- iterable-style datasets --------------------------------------------------------------------
class ShardedStream(IterableDataset[int]):
    """Yields ``0..n-1``, split between workers by ``get_worker_info()`` (worker ``w`` of ``k``
    yields ``w, w+k, ...``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class DuplicatedStream(IterableDataset[int]):
    """Yields ``0..n-1`` in every worker (no sharding), so ``k`` workers yield it ``k`` times.
    ``__len__`` says ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class UnevenStream(IterableDataset[tuple[int, int]]):
    """Worker ``w`` yields ``lengths[w]`` items ``(w, 0), (w, 1), ...``; the main process yields
    ``lengths[0]``. Workers run out at different times."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = get_worker_info()
        wid = 0 if info is None else info.id
        return ((wid, k) for k in range(self.lengths[wid]))


class RangeStream(IterableDataset[int]):
    """Yields ``start..end-1``; ``split_stream_range`` narrows each worker's copy (the pattern of
    torch's documentation)."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


class NoisyStream(IterableDataset[torch.Tensor]):
    """``n`` randomly augmented items from torch's global generator, in every worker."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.n):
            yield i + torch.rand(2)


# -- worker_init_fn helpers ---------------------------------------------------------------------
def split_stream_range(worker_id: int) -> None:
    """worker_init_fn: give worker ``worker_id`` its contiguous share of a ``RangeStream``."""
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    dataset = info.dataset
    assert isinstance(dataset, RangeStream)
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    start = dataset.start + worker_id * per_worker
    dataset.start, dataset.end = start, min(start + per_worker, dataset.end)


def set_worker_state(worker_id: int) -> None:
    """worker_init_fn: set ``WORKER_STATE`` from the worker id and the worker's seeded ``random``
    (so it differs between workers and depends on the base seed)."""
    global WORKER_STATE
    WORKER_STATE = worker_id * 1000 + random.randint(0, 999)


def record_worker_init(folder: str, worker_id: int) -> None:
    """worker_init_fn (bind ``folder`` with ``functools.partial``): create the file
    ``init-<worker_id>-<pid>-<n>`` in ``folder``, ``n`` counting earlier calls in this process."""
    calls = len(list(Path(folder).glob(f"init-{worker_id}-{os.getpid()}-*")))
    Path(folder, f"init-{worker_id}-{os.getpid()}-{calls}").touch()


def fail_in_worker_init(worker_id: int) -> None:
    """worker_init_fn that fails in worker 1 only."""
    if worker_id == 1:
        raise CustomLoadError(f"worker {worker_id} could not open its files")


# -- samplers and collate functions -------------------------------------------------------------
class ReversedSampler(Sampler[int]):
    """``n-1, n-2, ..., 0``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))


class UnevenBatchSampler(Sampler[list[int]]):
    """Consecutive batches of ``0..n-1`` whose sizes cycle through ``sizes``."""

    def __init__(self, n: int, sizes: Sequence[int]) -> None:
        self.n = n
        self.sizes = list(sizes)

    def _batches(self) -> list[list[int]]:
        batches, start, k = [], 0, 0
        while start < self.n:
            size = self.sizes[k % len(self.sizes)]
            batches.append(list(range(start, min(start + size, self.n))))
            start, k = start + size, k + 1
        return batches

    def __len__(self) -> int:
        return len(self._batches())

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())


class KeySampler(Sampler[str]):
    """Yields the given keys in the given order."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys)


def collate_sum_and_count(batch: list[torch.Tensor]) -> dict[str, Any]:
    """A custom collate_fn: the element-wise sum of the batch and its size."""
    return {"sum": torch.stack(batch).sum(dim=0), "count": len(batch)}


def collate_keep(batch: list[Any]) -> list[Any]:
    """A custom collate_fn that keeps the samples as they are (a list)."""
    return batch
