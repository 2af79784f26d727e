"""Resume as a training loop meets it, after torchdata's ``StatefulDataLoader`` tests: the
uninterrupted run equals a run checkpointed at batch ``k`` (the ``for`` loop left by ``break``,
or run to its end), then continued by a fresh loader that loaded the state, for ``k`` at the
start, mid-epoch, at the last batch and at the end of the epoch; on the fast path (fastload HDF5
+ ``PadCollate``, length-grouped) and the generic path (a plain map dataset, torch's default
collate), in the calling process and with worker processes."""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file

N = 96  # 12 batches of 8 per epoch


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_token_file(tmp_path_factory.mktemp("resume_break") / "data.h5", N, 40, seed=3)
    with h5py.File(path, "a") as f:
        f.create_dataset("idx", data=np.arange(N, dtype=np.int64))  # which sample a row is
    return path


class Numbers(Dataset[dict[str, Any]]):
    """A plain map-style dataset: sample ``i`` is ``{"idx": i}``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"idx": torch.tensor(i)}


def _fast(h5: Path, num_workers: int) -> fastload.DataLoader:
    dataset = fastload.HDF5Dataset(h5, fields=["tokens", "idx"])
    return fastload.DataLoader(dataset, batch_size=8, length_grouped=True, seed=5, num_workers=num_workers)


def _generic(h5: Path, num_workers: int) -> fastload.DataLoader:
    generator = torch.Generator().manual_seed(9)
    return fastload.DataLoader(Numbers(), batch_size=8, shuffle=True, generator=generator, num_workers=num_workers)


PATHS: dict[str, Callable[[Path, int], fastload.DataLoader]] = {"fast": _fast, "generic": _generic}


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["idx"].reshape(-1).tolist()


def _checkpoint_at(loader: fastload.DataLoader, k: int | None) -> tuple[list[list[int]], dict[str, Any]]:
    """The batches a training loop takes before it checkpoints, and the state it saves (through
    JSON, as a checkpoint keeps it): ``break`` after ``k`` batches, or (``None``) after the
    ``for`` loop ran to the end of the epoch."""
    taken: list[list[int]] = []
    if k != 0:
        for batch in loader:
            taken.append(_ids(batch))
            if len(taken) == k:
                break
    return taken, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("k", [0, 1, 5, 11, 12, None], ids=lambda k: "end" if k is None else f"k{k}")
def test_a_checkpoint_after_break_resumes_at_the_next_batch(
    h5: Path, path: str, num_workers: int, k: int | None
) -> None:
    make = PATHS[path]
    reference = make(h5, num_workers)
    uninterrupted = [_ids(b) for _ in range(3) for b in reference]

    taken, state = _checkpoint_at(make(h5, num_workers), k)
    resumed = make(h5, num_workers)
    resumed.load_state_dict(state)
    got = taken + [_ids(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]
    assert len(got) >= 2 * 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_at_the_end_of_an_epoch_starts_the_next(h5: Path, num_workers: int) -> None:
    reference = _fast(h5, num_workers)
    epoch0, epoch1 = [_ids(b) for b in reference], [_ids(b) for b in reference]

    taken, state = _checkpoint_at(_fast(h5, num_workers), None)
    assert taken == epoch0
    resumed = _fast(h5, num_workers)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert [_ids(b) for b in resumed] == epoch1


def _resumed_through_own_state(make: Any, k: int | None) -> list[list[int]]:
    """The batches taken before a checkpoint at ``k`` (see :func:`_checkpoint_at`) and two epochs
    of a fresh loader resumed from it, checked against three uninterrupted epochs; returned."""
    reference = make()
    uninterrupted = [_ids(b) for _ in range(3) for b in reference]
    taken, state = _checkpoint_at(make(), k)
    resumed = make()
    resumed.load_state_dict(state)
    got = taken + [_ids(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]
    return got


class OwnPositionSampler(torch.utils.data.Sampler[int]):
    """A sampler that keeps its own position, in torchdata's convention: a seeded permutation
    per epoch, ``state_dict()`` the epoch and the items its iterator yielded; loading a state
    makes the next ``iter()`` continue there. It moves to its next epoch when an iteration
    runs out, so a loader that draws ahead leaves it past what the consumer received."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.yielded, self._resume_at = 0, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        return self._items(order, start)

    def _items(self, order: list[int], start: int) -> Any:
        for i in order[start:]:
            self.yielded += 1
            yield i
        self.epoch, self.yielded = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._resume_at = state["epoch"], state["yielded"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k", [0, 1, 5, 11, 12, None], ids=lambda k: "end" if k is None else f"k{k}")
def test_a_sampler_with_its_own_state_resumes_through_it(num_workers: int, k: int | None) -> None:
    def make() -> fastload.DataLoader:
        return fastload.DataLoader(Numbers(), batch_size=8, sampler=OwnPositionSampler(N, 4), num_workers=num_workers)

    got = _resumed_through_own_state(make, k)
    assert len(got) >= 2 * 12


class OwnPositionStream(torch.utils.data.IterableDataset[dict[str, Any]]):
    """An iterable dataset that keeps its own position (torchdata's convention): the numbers
    ``0..n-1`` in a seeded order per pass, ``state_dict()`` the pass and the items yielded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.passes, self.yielded, self._resume_at = 0, 0, 0

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes)).tolist()
        info = torch.utils.data.get_worker_info()
        if info is not None:  # each worker its share, as torch's documentation shards
            order = order[info.id :: info.num_workers]
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        for i in order[start:]:
            self.yielded += 1
            yield {"idx": torch.tensor(i)}
        self.passes, self.yielded = self.passes + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes, self._resume_at = state["passes"], state["yielded"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k", [0, 1, 5, 11, None], ids=lambda k: "end" if k is None else f"k{k}")
def test_an_iterable_dataset_with_its_own_state_resumes_through_it(num_workers: int, k: int | None) -> None:
    def make() -> fastload.DataLoader:
        return fastload.DataLoader(OwnPositionStream(N), batch_size=8, num_workers=num_workers)

    _resumed_through_own_state(make, k)


def test_an_iterable_dataset_without_state_keeps_the_clear_error() -> None:
    class Plain(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(4))

    with pytest.raises(TypeError, match=r"IterableDataset.*give it state_dict"):
        fastload.DataLoader(Plain()).state_dict()


class Gated(Dataset[dict[str, Any]]):
    """Sample ``i`` is ``{"idx": i}``; sample 0 is held back until the file ``gate`` exists
    (at most a minute), so that with ``in_order=False`` the batches after the first arrive
    before it, whatever the machine's speed."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 0:
            for _ in range(600):
                if self.gate.exists():
                    break
                time.sleep(0.1)
        return {"idx": torch.tensor(i)}


def test_out_of_order_a_resume_neither_loses_nor_repeats_a_sample(tmp_path: Path) -> None:
    gate = tmp_path / "gate"

    def make() -> fastload.DataLoader:
        return fastload.DataLoader(Gated(gate), batch_size=8, num_workers=2, in_order=False)

    taken: list[list[int]] = []
    loader = make()
    for batch in loader:
        taken.append(_ids(batch))
        if len(taken) == 3:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    gate.touch()
    assert 0 not in {i for b in taken for i in b}  # received past the first batch

    resumed = make()
    resumed.load_state_dict(state)
    rest = [_ids(b) for b in resumed]
    samples = sorted(i for b in taken + rest for i in b)
    assert samples == list(range(N))
    assert sorted(i for b in resumed for i in _ids(b)) == list(range(N))  # the next epoch whole


class Augmented(Dataset[dict[str, Any]]):
    """Sample ``i`` with random augmentation drawn in ``__getitem__`` from torch's, Python's
    and numpy's generators, as a dataset's transforms draw it."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "idx": torch.tensor(i),
            "torch": torch.randint(0, 1 << 30, ()),
            "python": torch.tensor(random.randrange(1 << 30)),
            "numpy": torch.tensor(int(np.random.randint(0, 1 << 30))),
        }


def _augmented(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    return [batch[key].tolist() for key in ("idx", "torch", "python", "numpy")]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("k", [0, 1, 4, 5, 11, 12, None], ids=lambda k: "end" if k is None else f"k{k}")
def test_the_workers_random_states_resume_with_the_batches(k: int | None, persistent: bool) -> None:
    def make() -> fastload.DataLoader:
        generator = torch.Generator().manual_seed(21)
        return fastload.DataLoader(
            Augmented(), batch_size=8, shuffle=True, generator=generator, num_workers=2, persistent_workers=persistent
        )

    reference = make()
    uninterrupted = [_augmented(b) for _ in range(3) for b in reference]

    interrupted = make()
    taken: list[list[list[int]]] = []
    if k != 0:
        for batch in interrupted:
            taken.append(_augmented(batch))
            if len(taken) == k:
                break
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    got = taken + [_augmented(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]


@pytest.mark.parametrize("k", [1, 6], ids=lambda k: f"k{k}")
def test_persistent_workers_random_states_resume_in_a_later_epoch(k: int) -> None:
    def make() -> fastload.DataLoader:
        generator = torch.Generator().manual_seed(5)
        return fastload.DataLoader(
            Augmented(), batch_size=8, shuffle=True, generator=generator, num_workers=2, persistent_workers=True
        )

    reference = make()
    uninterrupted = [_augmented(b) for _ in range(3) for b in reference]

    interrupted = make()
    taken = [_augmented(b) for b in interrupted]
    for batch in interrupted:
        taken.append(_augmented(batch))
        if len(taken) == 12 + k:
            break
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    got = taken + [_augmented(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]


@pytest.mark.parametrize("begun", [True, False], ids=["begun", "finished"])
def test_persistent_workers_a_state_at_the_start_of_a_later_epoch_names_its_first_worker(begun: bool) -> None:
    def make() -> fastload.DataLoader:  # 11 batches an epoch: epoch 1 begins on worker 1
        generator = torch.Generator().manual_seed(5)
        return fastload.DataLoader(
            Augmented(88), batch_size=8, shuffle=True, generator=generator, num_workers=2, persistent_workers=True
        )

    reference = make()
    uninterrupted = [_augmented(b) for _ in range(3) for b in reference]

    interrupted = make()
    taken = [_augmented(b) for b in interrupted]
    it = iter(interrupted) if begun else None  # epoch 1 begun, nothing received yet
    state = json.loads(json.dumps(interrupted.state_dict()))
    del it
    resumed = make()
    resumed.load_state_dict(state)
    got = taken + [_augmented(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]


class SparseAugmented(Dataset[dict[str, Any]]):
    """Draws a random number for one sample in 24 and samples 4 and 76 only: most batches leave a
    worker's random states as they were."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        noise = random.randrange(1 << 30) if i % 24 == 0 or i in (4, 76) else -1
        return {"idx": torch.tensor(i), "torch": torch.tensor(noise), "python": torch.tensor(0), "numpy": torch.tensor(0)}


def test_resuming_twice_keeps_the_states_of_workers_whose_batches_drew_nothing() -> None:
    def make() -> fastload.DataLoader:
        generator = torch.Generator().manual_seed(2)  # the workers' base seed
        return fastload.DataLoader(SparseAugmented(), batch_size=4, num_workers=2, generator=generator)  # 24 batches

    reference = make()
    uninterrupted = [_augmented(b) for _ in range(2) for b in reference]
    got: list[list[list[int]]] = []
    state = None
    for stop in (5, 17):  # resumed at 5, checkpointed again at 17
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        for batch in loader:
            got.append(_augmented(batch))
            if len(got) == stop:
                break
        state = json.loads(json.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    got += [_augmented(b) for _ in range(2) for b in resumed]
    assert got == uninterrupted[: len(got)]
