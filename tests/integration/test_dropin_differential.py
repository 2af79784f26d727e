"""``fastload.DataLoader`` yields exactly torch's batches: each test runs one scenario under torch
2.13's DataLoader and under fastload's, from the same seeds, and compares every batch (types,
dtypes, shapes, strides, values) and the main process's random state afterwards.

A scenario is a function of the loader class, so generators, samplers and iterators are created
afresh for each run. All datasets live in ``_dropin_datasets`` (importable by spawned workers).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler, RandomSampler

import fastload

sys.path.insert(0, str(Path(__file__).parent))
import _dropin_datasets as dd

LoaderClass = type[TorchDataLoader]
Scenario = Callable[[LoaderClass], Any]
SEED = 1234


@dataclass
class Observation:
    """What a scenario returned and the main process's global random state afterwards."""

    result: Any
    torch_state: torch.Tensor
    python_state: Any
    numpy_state: Any


def observe(cls: LoaderClass, scenario: Scenario) -> Observation:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    result = scenario(cls)
    return Observation(result, torch.get_rng_state(), random.getstate(), np.random.get_state())


def assert_matches_torch(scenario: Scenario) -> Any:
    """Run ``scenario`` under both loaders from the same global seeds; the results and the global
    random states afterwards must be identical. Returns torch's result."""
    expected = observe(TorchDataLoader, scenario)
    actual = observe(fastload.DataLoader, scenario)
    dd.assert_same(expected.result, actual.result, "result")
    assert torch.equal(actual.torch_state, expected.torch_state), "torch's global RNG state differs"
    assert actual.python_state == expected.python_state, "Python's random state differs"
    kind, keys, *rest = actual.numpy_state
    expected_kind, expected_keys, *expected_rest = expected.numpy_state
    assert (kind, rest) == (expected_kind, expected_rest), "numpy's random state differs"
    assert np.array_equal(keys, expected_keys), "numpy's random state differs"
    return expected.result


def epochs_of(cls: LoaderClass, dataset: Any, epochs: int = 1, **kwargs: Any) -> list[list[Any]]:
    """Every batch of ``epochs`` full passes over a loader built from ``dataset`` and ``kwargs``."""
    loader = cls(dataset, **kwargs)
    return [list(loader) for _ in range(epochs)]


pytestmark = pytest.mark.usefixtures("collect_what_the_test_left")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


WORKERS = pytest.mark.parametrize("num_workers", [0, 1, 2])
WORKERS_0_2 = pytest.mark.parametrize("num_workers", [0, 2])


# -- map-style datasets -------------------------------------------------------------------------
@WORKERS
@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_map_style_batches_match(num_workers: int, drop_last: bool) -> None:
    ds = dd.Indexed(11)
    result = assert_matches_torch(
        lambda cls: epochs_of(cls, ds, batch_size=3, drop_last=drop_last, num_workers=num_workers)
    )
    assert len(result[0]) == (3 if drop_last else 4)


@WORKERS
def test_shuffle_with_generator_matches_and_leaves_global_rng_alone(num_workers: int) -> None:
    ds = dd.Indexed(13)

    def scenario(cls: LoaderClass) -> Any:
        before = torch.get_rng_state()
        generator = seeded(7)
        batches = epochs_of(
            cls, ds, 2, batch_size=4, shuffle=True, generator=generator, num_workers=num_workers
        )
        assert torch.equal(torch.get_rng_state(), before), "the global generator was used"
        return batches, generator.get_state()

    batches, _ = assert_matches_torch(scenario)
    orders = [torch.cat([b[:, 0] for b in epoch]).tolist() for epoch in batches]
    assert sorted(orders[0]) == list(range(13)) and orders[0] != orders[1]


@WORKERS
def test_shuffle_with_global_seed_matches_and_advances_global_rng_identically(
    num_workers: int,
) -> None:
    ds = dd.Indexed(13)
    batches = assert_matches_torch(
        lambda cls: epochs_of(cls, ds, 2, batch_size=4, shuffle=True, num_workers=num_workers)
    )
    order = [torch.cat([b[:, 0] for b in epoch]).tolist() for epoch in batches]
    assert sorted(order[0]) == list(range(13)) and order[0] != order[1]


@WORKERS_0_2
def test_batch_size_none_yields_converted_single_samples(num_workers: int) -> None:
    ds = dd.RichSamples(5)
    result = assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, batch_size=None, shuffle=True, generator=seeded(3), num_workers=num_workers
        )
    )
    assert isinstance(result[0][0]["array"], torch.Tensor)  # default_convert turned it into one


@WORKERS_0_2
def test_getitems_reads_whole_batches(num_workers: int) -> None:
    ds = dd.ReadPath(10)
    result = assert_matches_torch(
        lambda cls: epochs_of(cls, ds, batch_size=4, num_workers=num_workers)
    )
    assert all(via == "getitems" for batch in result[0] for via in batch["via"])


@WORKERS
def test_default_collate_type_rules(num_workers: int) -> None:
    ds = dd.RichSamples(7)
    result = assert_matches_torch(
        lambda cls: epochs_of(cls, ds, batch_size=3, num_workers=num_workers)
    )
    first = result[0][0]
    assert isinstance(first["point"], dd.Point) and isinstance(first["str"], list)


@WORKERS_0_2
def test_custom_collate_fn(num_workers: int) -> None:
    ds = dd.Indexed(10)
    assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, batch_size=4, collate_fn=dd.collate_sum_and_count, num_workers=num_workers
        )
    )


SAMPLERS: dict[str, Callable[[], Any]] = {
    "sampler-class": lambda: dd.ReversedSampler(10),
    "plain-list": lambda: [3, 1, 4, 1, 5, 9, 2, 6],
    "random-with-replacement": lambda: RandomSampler(
        range(10), replacement=True, num_samples=9, generator=seeded(5)
    ),
    "random-global-seed": lambda: RandomSampler(range(10)),
}


@WORKERS_0_2
@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_given_sampler(kind: str, num_workers: int) -> None:
    ds = dd.Indexed(10)
    assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, 2, batch_size=3, sampler=SAMPLERS[kind](), num_workers=num_workers
        )
    )


BATCH_SAMPLERS: dict[str, Callable[[], Any]] = {
    "sampler-class": lambda: dd.UnevenBatchSampler(12, [1, 4, 2]),
    "list-of-lists": lambda: [[0, 1], [9], [2, 3, 4, 5], [7, 7]],
}


@WORKERS_0_2
@pytest.mark.parametrize("kind", list(BATCH_SAMPLERS))
def test_given_batch_sampler(kind: str, num_workers: int) -> None:
    ds = dd.Indexed(12)
    assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, batch_sampler=BATCH_SAMPLERS[kind](), num_workers=num_workers
        )
    )


@WORKERS_0_2
def test_sampler_yielding_string_keys(num_workers: int) -> None:
    ds = dd.Keyed(["ant", "bee", "cat", "dog", "eel"])
    assert_matches_torch(
        lambda cls: epochs_of(
            cls,
            ds,
            batch_size=2,
            sampler=dd.KeySampler(["eel", "ant", "dog", "bee", "cat"]),
            num_workers=num_workers,
        )
    )


@WORKERS_0_2
def test_distributed_sampler_with_set_epoch(num_workers: int) -> None:
    ds = dd.Indexed(10)

    def scenario(cls: LoaderClass) -> list[list[Any]]:
        sampler: DistributedSampler[int] = DistributedSampler(
            ds, num_replicas=2, rank=1, shuffle=True, seed=3
        )
        loader = cls(ds, batch_size=2, sampler=sampler, num_workers=num_workers)
        epochs = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            epochs.append(list(loader))
        return epochs

    assert_matches_torch(scenario)


# -- iterable-style datasets --------------------------------------------------------------------
@WORKERS
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_sharded_by_worker_info(num_workers: int, drop_last: bool) -> None:
    ds = dd.ShardedStream(11)
    result = assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, 2, batch_size=3, drop_last=drop_last, num_workers=num_workers
        )
    )
    if not drop_last:
        assert sorted(torch.cat(result[0]).tolist()) == list(range(11))


@WORKERS
def test_iterable_without_sharding_is_duplicated_per_worker(num_workers: int) -> None:
    ds = dd.DuplicatedStream(5)
    result = assert_matches_torch(
        lambda cls: epochs_of(cls, ds, batch_size=2, num_workers=num_workers)
    )
    assert Counter(torch.cat(result[0]).tolist()) == {i: max(1, num_workers) for i in range(5)}


@pytest.mark.parametrize(
    ("batch_size", "persistent"), [(None, False), (2, False), (2, True)], ids=str
)
def test_iterable_workers_running_out_at_different_times(
    batch_size: int | None, persistent: bool
) -> None:
    ds = dd.UnevenStream([5, 1])
    assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, 2, batch_size=batch_size, num_workers=2, persistent_workers=persistent
        )
    )


@WORKERS_0_2
def test_iterable_batch_size_none(num_workers: int) -> None:
    ds = dd.ShardedStream(7)
    assert_matches_torch(lambda cls: epochs_of(cls, ds, batch_size=None, num_workers=num_workers))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_iterable_split_by_worker_init_fn(num_workers: int) -> None:
    ds = dd.RangeStream(3, 17)
    result = assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, batch_size=4, worker_init_fn=dd.split_stream_range, num_workers=num_workers
        )
    )
    assert sorted(torch.cat(result[0]).tolist()) == list(range(3, 17))


@WORKERS_0_2
def test_iterable_random_augmentation(num_workers: int) -> None:
    ds = dd.NoisyStream(5)
    assert_matches_torch(lambda cls: epochs_of(cls, ds, 2, batch_size=2, num_workers=num_workers))


# -- inside the workers -------------------------------------------------------------------------
@WORKERS
@pytest.mark.parametrize("seed_source", ["generator", "global"])
def test_worker_info_and_seeds(num_workers: int, seed_source: str) -> None:
    ds = dd.WorkerProbe(8)

    def scenario(cls: LoaderClass) -> Any:
        generator = seeded(11) if seed_source == "generator" else None
        return epochs_of(cls, ds, batch_size=2, num_workers=num_workers, generator=generator)

    result = assert_matches_torch(scenario)
    samples = [
        {key: value[j] for key, value in batch.items()} for batch in result[0] for j in range(2)
    ]
    if num_workers == 0:
        assert all(s["worker_id"] == -1 for s in samples)
        return
    base_seeds = {int(s["info_seed"]) - int(s["worker_id"]) for s in samples}
    assert len(base_seeds) == 1, "worker seeds are not base seed + worker id"
    for s in samples:
        assert int(s["initial_seed"]) == int(s["info_seed"])
        assert int(s["num_workers"]) == num_workers and bool(s["info_dataset_is_self"])
        assert int(s["threads"]) == 1


@pytest.mark.parametrize("num_workers", [1, 2])
def test_worker_init_fn_state_reaches_samples(num_workers: int) -> None:
    ds = dd.WorkerState(8)
    result = assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, batch_size=2, num_workers=num_workers, worker_init_fn=dd.set_worker_state
        )
    )
    states = {int(s) for batch in result[0] for s in batch[1]}
    assert len(states) == num_workers and -1 not in states


# -- epochs, persistence, interleaving ----------------------------------------------------------
@pytest.mark.parametrize("num_workers", [1, 2])
def test_persistent_workers_over_epochs(num_workers: int) -> None:
    ds = dd.Noisy(9)
    result = assert_matches_torch(
        lambda cls: epochs_of(
            cls,
            ds,
            3,
            batch_size=2,
            shuffle=True,
            generator=seeded(2),
            num_workers=num_workers,
            persistent_workers=True,
        )
    )
    orders = [torch.cat(epoch)[:, 0].floor().tolist() for epoch in result]
    assert orders[0] != orders[1] != orders[2], "every epoch must reshuffle"


@pytest.mark.parametrize("persistent", [False, True])
def test_dataset_state_seen_by_workers_across_epochs(persistent: bool) -> None:
    ds = dd.EpochTagged(6)

    def scenario(cls: LoaderClass) -> list[list[Any]]:
        ds.set_epoch(0)
        loader = cls(ds, batch_size=2, num_workers=2, persistent_workers=persistent)
        epochs = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            epochs.append(list(loader))
        return epochs

    result = assert_matches_torch(scenario)
    seen = [sorted({int(e) for batch in epoch for e in batch[1]}) for epoch in result]
    assert seen == ([[0], [0], [0]] if persistent else [[0], [1], [2]])


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (2, True)], ids=str
)
def test_break_out_of_an_epoch_then_iterate_again(num_workers: int, persistent: bool) -> None:
    ds = dd.Noisy(12)

    def scenario(cls: LoaderClass) -> list[Any]:
        loader = cls(
            ds,
            batch_size=2,
            shuffle=True,
            generator=seeded(4),
            num_workers=num_workers,
            persistent_workers=persistent,
        )
        first = []
        for batch in loader:
            first.append(batch)
            if len(first) == 2:
                break
        return [first, list(loader), list(loader)]

    assert_matches_torch(scenario)


@WORKERS_0_2
def test_two_loaders_interleaved(num_workers: int) -> None:
    indexed, noisy = dd.Indexed(9), dd.Noisy(7)

    def scenario(cls: LoaderClass) -> list[Any]:
        a = cls(indexed, batch_size=2, shuffle=True, generator=seeded(8), num_workers=num_workers)
        b = cls(noisy, batch_size=3, shuffle=True, num_workers=num_workers)
        it_a, it_b = iter(a), iter(b)
        out: list[Any] = []
        for _ in range(5):
            out.append(next(it_a, "a-done"))
            out.append(next(it_b, "b-done"))
        out.append(list(zip(a, b, strict=False)))  # b is longer; stop with a
        return out

    assert_matches_torch(scenario)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_out_of_order_delivery_yields_the_same_batches(num_workers: int) -> None:
    ds = dd.Sleepy(12, sleep_at=0, delay_s=0.3)
    runs = {
        cls.__module__: [
            dd.batch_key(b) for b in cls(ds, batch_size=2, num_workers=num_workers, in_order=False)
        ]
        for cls in (TorchDataLoader, fastload.DataLoader)
    }
    in_order = [dd.batch_key(b) for b in TorchDataLoader(ds, batch_size=2)]
    for name, keys in runs.items():
        assert Counter(keys) == Counter(in_order), f"{name} lost or duplicated batches"


# -- start methods ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "form"),
    [("fork", "name"), ("fork", "context"), ("spawn", "name"), ("forkserver", "context")],
)
def test_multiprocessing_context(method: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each start method is really used (a forked worker inherits the parent's module state; a
    forkserver worker's parent is the fork server) and the batches are torch's. Spawn and
    forkserver workers import torch afresh, so one worker keeps these cases short."""
    monkeypatch.setattr(dd, "PARENT_MARKER", "set in the parent")
    ds = dd.StartMethodProbe(4)
    context: Any = method if form == "name" else multiprocessing.get_context(method)

    def scenario(cls: LoaderClass) -> list[Any]:
        batches = epochs_of(cls, ds, batch_size=2, num_workers=1, multiprocessing_context=context)
        expected_marker = "set in the parent" if method == "fork" else "fresh import"
        for batch in batches[0]:
            assert batch["marker"] == [expected_marker] * 2
            parent_is_main = {int(p) for p in batch["ppid"]} == {os.getpid()}
            assert parent_is_main == (method != "forkserver"), f"{method}: ppid {batch['ppid']}"
        return [[{"i": b["i"], "marker": b["marker"]} for b in epoch] for epoch in batches]

    assert_matches_torch(scenario)


# -- pinning, errors mid-epoch, payloads --------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests pin_memory without an accelerator")
@WORKERS_0_2
def test_pin_memory_without_accelerator_returns_the_same_data(num_workers: int) -> None:
    ds = dd.RichSamples(5)

    def scenario(cls: LoaderClass) -> list[list[Any]]:
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true"):
            return epochs_of(cls, ds, batch_size=2, pin_memory=True, num_workers=num_workers)

    assert_matches_torch(scenario)


@WORKERS_0_2
def test_iteration_goes_on_after_a_dataset_exception(num_workers: int) -> None:
    ds = dd.Faulty(12, bad=5, kind="value")

    def scenario(cls: LoaderClass) -> list[Any]:
        it = iter(cls(ds, batch_size=2, num_workers=num_workers))
        out: list[Any] = []
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except ValueError as exc:
                out.append(("raised", type(exc).__name__))

    result = assert_matches_torch(scenario)
    assert result[2] == ("raised", "ValueError") and len(result) == 6


@WORKERS_0_2
def test_map_dataset_raising_stop_iteration_ends_the_epoch(num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's workers that ended this way are told nothing at shutdown: they notice it at their
    # next status check, every MP_STATUS_CHECK_INTERVAL (5 s), while torch waits for each in
    # turn. Checking every 0.1 s changes nothing but the 10 s this test spent in that wait.
    import torch.utils.data._utils as torch_utils
    import torch.utils.data._utils.worker as torch_worker

    monkeypatch.setattr(torch_utils, "MP_STATUS_CHECK_INTERVAL", 0.1)
    monkeypatch.setattr(torch_worker, "MP_STATUS_CHECK_INTERVAL", 0.1)
    ds = dd.StopsEarly(10, stop_at=5)
    result = assert_matches_torch(
        lambda cls: epochs_of(cls, ds, batch_size=2, num_workers=num_workers)
    )
    assert len(result[0]) == 2


@WORKERS_0_2
def test_numpy_arrays_and_tensors_keep_dtype_layout_and_values(num_workers: int) -> None:
    ds = dd.ArrayPayload(4)
    assert_matches_torch(
        lambda cls: epochs_of(
            cls, ds, batch_size=2, collate_fn=dd.collate_keep, num_workers=num_workers
        )
    )
