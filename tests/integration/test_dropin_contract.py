"""The DataLoader contract, checked on both classes: every test taking ``loader_cls`` runs once on
torch 2.13's DataLoader (which defines the contract) and once on ``fastload.DataLoader``.

Covered: the class and its constructor (signature, defaults, positional order, validation
errors), attribute rules, ``multiprocessing_context``, re-creation from constructor arguments
with a distributed sampler, ``timeout``, ``prefetch_factor``, worker exceptions, ``worker_init_fn``,
persistent workers, ``in_order``, ``pin_memory`` warnings, ``len()`` and iterator behaviour.
Tests at the end check what only fastload promises (the batch and sample indices in a worker
error's message).
"""

from __future__ import annotations

import functools
import gc
import inspect
import multiprocessing
import os
import pickle
import re
import sys
import time
import traceback
import typing
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data._utils.collate import default_collate, default_convert

import fastload

sys.path.insert(0, str(Path(__file__).parent))
import _dropin_datasets as dd

LoaderClass = type[TorchDataLoader]


@pytest.fixture(params=[TorchDataLoader, fastload.DataLoader], ids=["torch", "fastload"])
def loader_cls(request: pytest.FixtureRequest) -> LoaderClass:
    cls: LoaderClass = request.param
    return cls


pytestmark = pytest.mark.usefixtures("collect_what_the_test_left")


def flat(batches: list[torch.Tensor]) -> list[int]:
    return [int(v) for b in batches for v in b.reshape(-1)]


def raised_by(action: Callable[[], object]) -> Exception:
    """The exception ``action()`` raises, without its traceback (the text of a worker's
    traceback is in the message).

    The traceback's frames hold the iterator, in a reference cycle; dropping them lets the
    caller's ``del`` stop the workers at once, the normal way, instead of leaving it to the
    garbage collector (where torch's shutdown can wait 5 s per worker)."""
    try:
        action()
    except Exception as exc:
        chained: BaseException | None = exc
        while chained is not None:  # torch's RuntimeError fallback chains the failed rebuild
            traceback.clear_frames(chained.__traceback__)
            chained.__traceback__ = None
            chained = chained.__context__
        return exc
    pytest.fail("expected an exception from the loader; none was raised")


def first_epoch_error(loader: TorchDataLoader) -> Exception:
    """The exception that a full pass over ``loader`` raises (its iterator is deleted)."""
    it = iter(loader)
    exc = raised_by(functools.partial(list, it))
    del it
    return exc


# -- the class and its constructor --------------------------------------------------------------
def test_is_a_torch_dataloader(loader_cls: LoaderClass) -> None:
    assert isinstance(loader_cls(dd.Indexed(3)), TorchDataLoader)


def test_class_can_be_subscripted_in_type_hints(loader_cls: LoaderClass) -> None:
    alias = loader_cls[torch.Tensor]  # type: ignore[index]
    assert typing.get_origin(alias) is loader_cls
    assert typing.get_args(alias) == (torch.Tensor,)


def test_constructor_accepts_torchs_parameters_in_torchs_order() -> None:
    """torch's parameters come first, in torch's order, with torch's kinds and defaults; any
    option fastload adds is keyword-only and optional, so every call written for torch binds
    exactly as it does there."""
    theirs = list(inspect.signature(TorchDataLoader.__init__).parameters.values())
    ours = list(inspect.signature(fastload.DataLoader.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [
        (p.name, p.kind, p.default) for p in theirs
    ]
    for extra in ours[len(theirs) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY, extra
        assert extra.default is not inspect.Parameter.empty, extra


def test_defaults(loader_cls: LoaderClass) -> None:
    ds = dd.Indexed(5)
    loader = loader_cls(ds)
    assert loader.dataset is ds
    assert loader.batch_size == 1 and loader.drop_last is False
    assert isinstance(loader.sampler, SequentialSampler)
    assert isinstance(loader.batch_sampler, BatchSampler) and loader.batch_sampler.batch_size == 1
    assert loader.num_workers == 0 and loader.prefetch_factor is None
    assert loader.collate_fn is default_collate
    assert loader.pin_memory is False and loader.pin_memory_device == ""
    assert loader.timeout == 0 and loader.worker_init_fn is None
    assert loader.multiprocessing_context is None and loader.generator is None
    assert loader.persistent_workers is False and loader.in_order is True


def test_derived_defaults(loader_cls: LoaderClass) -> None:
    ds = dd.Indexed(5)
    generator = torch.Generator()
    with_workers = loader_cls(ds, num_workers=1, shuffle=True, generator=generator)
    assert with_workers.prefetch_factor == 2
    assert isinstance(with_workers.sampler, RandomSampler)
    assert with_workers.sampler.generator is generator
    unbatched = loader_cls(ds, batch_size=None)
    assert unbatched.batch_sampler is None and unbatched.collate_fn is default_convert
    given = [[0, 1], [2]]
    custom = loader_cls(ds, batch_sampler=given)
    assert custom.batch_sampler is given and custom.batch_size is None


def test_positional_arguments_in_torchs_order(loader_cls: LoaderClass) -> None:
    ds, sampler, generator = dd.Indexed(6), dd.ReversedSampler(6), torch.Generator()
    loader = loader_cls(
        ds,
        4,
        False,
        sampler,
        None,
        0,
        dd.collate_keep,
        False,
        True,
        0,
        dd.set_worker_state,
        None,
        generator,
    )
    assert loader.batch_size == 4 and loader.sampler is sampler
    assert loader.collate_fn is dd.collate_keep and loader.drop_last is True
    assert loader.worker_init_fn is dd.set_worker_state and loader.generator is generator
    assert [len(b) for b in loader] == [4]


def test_options_after_generator_are_keyword_only(loader_cls: LoaderClass) -> None:
    with pytest.raises(TypeError):
        loader_cls(  # type: ignore[call-arg]  # prefetch_factor given positionally
            dd.Indexed(3), 1, False, None, None, 1, None, False, False, 0, None, None, None, 2
        )


@pytest.mark.parametrize(
    "attr", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_setting_a_fixed_attribute_after_construction_raises(
    loader_cls: LoaderClass, attr: str
) -> None:
    loader = loader_cls(dd.Indexed(4), batch_size=2)
    before = getattr(loader, attr)
    with pytest.raises(ValueError, match=f"{attr} attribute should not be set after"):
        setattr(loader, attr, before)


def test_other_attributes_stay_settable(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.Indexed(4), batch_size=2)
    loader.num_workers = 1
    loader.timeout = 3
    loader.collate_fn = dd.collate_keep
    loader.multiprocessing_context = "spawn"  # validated against the new num_workers
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.collate_fn is dd.collate_keep and loader.timeout == 3


def test_multiprocessing_context_names_and_objects(loader_cls: LoaderClass) -> None:
    for method in ("fork", "spawn", "forkserver"):
        loader = loader_cls(dd.Indexed(4), num_workers=1, multiprocessing_context=method)
        assert isinstance(loader.multiprocessing_context, multiprocessing.context.BaseContext)
        assert loader.multiprocessing_context.get_start_method() == method
        context = multiprocessing.get_context(method)
        assert loader_cls(dd.Indexed(4), num_workers=1, multiprocessing_context=context)
        assert (
            loader_cls(
                dd.Indexed(4), num_workers=1, multiprocessing_context=context
            ).multiprocessing_context
            is context
        )


def test_multiprocessing_context_validated_when_set(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.Indexed(4), num_workers=1)
    with pytest.raises(ValueError, match="multiprocessing_context"):
        loader.multiprocessing_context = "teleport"
    with pytest.raises(TypeError, match="multiprocessing_context"):
        loader.multiprocessing_context = 42
    single = loader_cls(dd.Indexed(4))
    with pytest.raises(ValueError, match="num_workers > 0"):
        single.multiprocessing_context = "fork"


BAD_ARGUMENTS: dict[str, tuple[str, dict[str, Any], type[Exception]]] = {
    # id: (dataset kind, constructor keywords, torch's exception type)
    "negative-num-workers": ("map", {"num_workers": -1}, ValueError),
    "negative-timeout": ("map", {"timeout": -1}, ValueError),
    "prefetch-without-workers": ("map", {"prefetch_factor": 2}, ValueError),
    "persistent-without-workers": ("map", {"persistent_workers": True}, ValueError),
    "shuffle-with-iterable": ("iterable", {"shuffle": True}, ValueError),
    "sampler-with-iterable": ("iterable", {"sampler": [0, 1]}, ValueError),
    "sampler-and-shuffle": ("map", {"sampler": [0, 1], "shuffle": True}, ValueError),
    "batch-sampler-and-batch-size": ("map", {"batch_sampler": [[0]], "batch_size": 2}, ValueError),
    "batch-sampler-and-batch-size-none": (
        "map",
        {"batch_sampler": [[0]], "batch_size": None},
        ValueError,
    ),
    "batch-sampler-and-drop-last": ("map", {"batch_sampler": [[0]], "drop_last": True}, ValueError),
    "no-batching-and-drop-last": ("map", {"batch_size": None, "drop_last": True}, ValueError),
    "zero-batch-size": ("map", {"batch_size": 0}, ValueError),
    "unknown-start-method": ("map", {"num_workers": 1, "multiprocessing_context": "x"}, ValueError),
    "start-method-of-wrong-type": (
        "map",
        {"num_workers": 1, "multiprocessing_context": 3},
        TypeError,
    ),
    "shuffle-empty-dataset": ("empty", {"shuffle": True}, ValueError),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_invalid_arguments_raise_torchs_exception_type(loader_cls: LoaderClass, case: str) -> None:
    kind, kwargs, expected = BAD_ARGUMENTS[case]
    dataset = {"map": dd.Indexed(4), "iterable": dd.ShardedStream(4), "empty": dd.Indexed(0)}[kind]
    with pytest.raises(expected) as raised:
        loader_cls(dataset, **kwargs)
    assert type(raised.value) is expected


# -- re-creation by frameworks ------------------------------------------------------------------
def recreate_with_sampler(loader: TorchDataLoader, sampler: Any) -> TorchDataLoader:
    """What Lightning does to inject a distributed sampler: read every ``__init__`` parameter
    that the loader has as an attribute, swap in the sampler, call the loader's own class."""
    params = inspect.signature(type(loader).__init__).parameters
    kwargs = {
        name: getattr(loader, name) for name in params if name != "self" and hasattr(loader, name)
    }
    kwargs.update(sampler=sampler, batch_sampler=None, shuffle=False)
    kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    return type(loader)(**kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_recreated_with_a_distributed_sampler_yields_the_shard(
    loader_cls: LoaderClass, num_workers: int
) -> None:
    ds = dd.Indexed(10)
    context = "fork" if num_workers else None
    original = loader_cls(
        ds, batch_size=2, shuffle=True, num_workers=num_workers, multiprocessing_context=context
    )
    shard: DistributedSampler[int] = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False)
    recreated = recreate_with_sampler(original, shard)
    assert type(recreated) is loader_cls and recreated.num_workers == num_workers
    batches = list(recreated)
    assert [b[:, 0].tolist() for b in batches] == [[0, 2], [4, 6], [8]]


# -- timeout and prefetching --------------------------------------------------------------------
def test_timeout_raises_runtime_error_when_a_worker_hangs(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.Sleepy(4, sleep_at=1, delay_s=2.5), num_workers=1, timeout=1)
    it = iter(loader)
    assert next(it).tolist() == [0]
    started = time.monotonic()
    exc = raised_by(functools.partial(next, it))
    assert time.monotonic() - started < 2.0
    del it
    assert isinstance(exc, RuntimeError)
    assert str(exc) == "DataLoader timed out after 1 seconds"


def fetched_count(folder: Path, at_least: int, settle_s: float = 0.15, limit_s: float = 5.0) -> int:
    """How many samples the workers have read, once at least ``at_least`` have been read (or
    ``limit_s`` passed) and then ``settle_s`` more seconds, so reads beyond it show up too."""
    deadline = time.monotonic() + limit_s
    while len(os.listdir(folder)) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(settle_s)
    return len(os.listdir(folder))


@pytest.mark.parametrize(
    ("num_workers", "prefetch_factor"), [(1, 3), (2, 1), (2, 2)], ids=lambda v: str(v)
)
def test_prefetch_requests_exactly_prefetch_factor_times_workers_ahead(
    loader_cls: LoaderClass, num_workers: int, prefetch_factor: int, tmp_path: Path
) -> None:
    ahead = num_workers * prefetch_factor
    n = ahead + 3
    loader = loader_cls(
        dd.FetchLog(n, tmp_path), num_workers=num_workers, prefetch_factor=prefetch_factor
    )
    it = iter(loader)
    assert fetched_count(tmp_path, ahead) == ahead
    for k in range(n):
        assert next(it).tolist() == [k]
        expected = min(n, k + 1 + ahead)
        assert fetched_count(tmp_path, expected) == expected, f"after batch {k}"


# -- worker exceptions --------------------------------------------------------------------------
ERROR_TYPES = {"value": ValueError, "key": KeyError, "custom": dd.CustomLoadError}


@pytest.mark.parametrize("kind", list(ERROR_TYPES))
def test_worker_exception_keeps_its_type_and_names_the_worker(
    loader_cls: LoaderClass, kind: str
) -> None:
    exc = first_epoch_error(loader_cls(dd.Faulty(8, bad=5, kind=kind), batch_size=2, num_workers=2))
    assert type(exc) is ERROR_TYPES[kind]
    assert "in DataLoader worker process 0" in str(exc)  # batch 2 goes to worker 0
    assert "sample 5 is corrupt" in str(exc)


def test_exception_that_cannot_be_rebuilt_becomes_runtime_error(loader_cls: LoaderClass) -> None:
    exc = first_epoch_error(
        loader_cls(dd.Faulty(8, bad=3, kind="two-arg"), batch_size=2, num_workers=2)
    )
    assert type(exc) is RuntimeError
    assert "TwoArgError" in str(exc) and "in DataLoader worker process 1" in str(exc)
    assert "sample 3 is corrupt" in str(exc)


def test_worker_init_fn_exception_raised_for_that_workers_first_batch(
    loader_cls: LoaderClass,
) -> None:
    loader = loader_cls(
        dd.Indexed(8), batch_size=2, num_workers=2, worker_init_fn=dd.fail_in_worker_init
    )
    it = iter(loader)
    assert next(it)[:, 0].tolist() == [0, 1]
    exc = raised_by(functools.partial(next, it))
    del it
    assert type(exc) is dd.CustomLoadError
    assert "in DataLoader worker process 1" in str(exc)
    assert "worker 1 could not open its files" in str(exc)


def test_collate_error_in_a_worker_is_a_type_error(loader_cls: LoaderClass) -> None:
    samples = [{"value": None}, {"value": None}]  # a plain list is a map-style dataset too
    exc = first_epoch_error(loader_cls(samples, batch_size=2, num_workers=1))  # type: ignore[arg-type]
    assert type(exc) is TypeError
    assert "in DataLoader worker process 0" in str(exc) and "NoneType" in str(exc)


# -- workers across epochs ----------------------------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_init_fn_runs_once_per_worker(
    loader_cls: LoaderClass, persistent: bool, tmp_path: Path
) -> None:
    loader = loader_cls(
        dd.Indexed(6),
        batch_size=2,
        num_workers=2,
        persistent_workers=persistent,
        worker_init_fn=functools.partial(dd.record_worker_init, str(tmp_path)),
    )
    for _ in range(2):
        assert len(list(loader)) == 3
    calls = [name.split("-") for name in os.listdir(tmp_path)]
    assert all(call == "0" for *_, call in calls), "worker_init_fn ran twice in one process"
    per_worker = Counter(wid for _, wid, _, _ in calls)
    assert per_worker == {"0": 1 if persistent else 2, "1": 1 if persistent else 2}


def test_persistent_workers_keep_their_processes(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.PidReporter(8), batch_size=2, num_workers=2, persistent_workers=True)
    epochs = []
    for _ in range(3):
        pids: set[int] = set()
        for batch in loader:
            assert get_worker_info() is None  # the main process is no worker
            pids.update(int(p) for p in batch)
        epochs.append(pids)
    assert len(epochs[0]) == 2 and os.getpid() not in epochs[0]
    assert epochs[0] == epochs[1] == epochs[2]


def test_out_of_order_delivery_does_not_wait_for_a_slow_batch(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.Sleepy(8, sleep_at=0, delay_s=0.5), num_workers=2, in_order=False)
    values = [int(b) for b in loader]
    assert values[0] != 0, "in_order=False still waited for the slow first batch"
    assert sorted(values) == list(range(8))


# -- pin_memory ---------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests pin_memory without an accelerator")
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, True)], ids=str)
def test_pin_memory_without_accelerator_warns_once_per_iterator(
    loader_cls: LoaderClass, num_workers: int, persistent: bool
) -> None:
    loader = loader_cls(
        dd.Indexed(4),
        batch_size=2,
        pin_memory=True,
        num_workers=num_workers,
        persistent_workers=persistent,
    )
    with pytest.warns(UserWarning) as first:
        assert flat(list(loader)) == flat(
            [torch.tensor([[0, 0], [1, 1]]), torch.tensor([[2, 4], [3, 9]])]
        )
    assert [str(w.message) for w in first] == [
        "'pin_memory' argument is set as true but no accelerator is found, then device pinned "
        "memory won't be used."
    ]
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        assert len(list(loader)) == 2
    assert len(second) == (0 if persistent else 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests pin_memory without an accelerator")
def test_pin_memory_device_is_reported_as_deprecated(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.Indexed(2), pin_memory=True, pin_memory_device="cpu")
    with pytest.warns(UserWarning) as record:
        assert len(list(loader)) == 2
    messages = [str(w.message) for w in record]
    assert any("pin_memory_device is deprecated" in m for m in messages), messages
    assert any("no accelerator is found" in m for m in messages), messages


# -- len() and the iterator ---------------------------------------------------------------------
LENGTHS: dict[str, tuple[Any, dict[str, Any], int]] = {
    "batched": (dd.Indexed(10), {"batch_size": 3}, 4),
    "drop-last": (dd.Indexed(10), {"batch_size": 3, "drop_last": True}, 3),
    "unbatched": (dd.Indexed(10), {"batch_size": None}, 10),
    "batch-sampler": (dd.Indexed(12), {"batch_sampler": dd.UnevenBatchSampler(12, [1, 4, 2])}, 5),
    "iterable-with-len": (dd.DuplicatedStream(10), {"batch_size": 4}, 3),
}


@pytest.mark.parametrize("case", list(LENGTHS))
def test_len(loader_cls: LoaderClass, case: str) -> None:
    dataset, kwargs, expected = LENGTHS[case]
    loader = loader_cls(dataset, **kwargs)
    assert len(loader) == expected
    if case != "iterable-with-len":  # an iterable dataset's iterator counts its infinite sampler
        assert len(iter(loader)) == expected
        assert len(list(loader)) == expected


def test_iterable_dataset_longer_than_its_len_warns(loader_cls: LoaderClass) -> None:
    loader = loader_cls(dd.DuplicatedStream(3), batch_size=None, num_workers=2)
    assert len(loader) == 3
    it = iter(loader)
    assert [int(next(it)) for _ in range(3)] == [0, 0, 1]
    with pytest.warns(
        UserWarning, match=r"was reported to be 3\(when accessing len\(dataloader\)\)"
    ):
        next(it)


def test_iterator_cannot_be_pickled(loader_cls: LoaderClass) -> None:
    it = iter(loader_cls(dd.Indexed(4)))
    with pytest.raises(NotImplementedError):
        pickle.dumps(it)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exhausted_iterator_keeps_raising_stop_iteration(
    loader_cls: LoaderClass, num_workers: int
) -> None:
    it = iter(loader_cls(dd.Indexed(3), batch_size=2, num_workers=num_workers))
    assert len(list(it)) == 2
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)


def test_more_workers_than_cpus_warns_at_construction_and_iteration(
    loader_cls: LoaderClass,
) -> None:
    cpus = torch.utils.data.dataloader.torch._utils.cpu_count() or 1
    if cpus > 7:
        pytest.skip(f"{cpus} CPUs: too many worker processes to start for this check")
    with pytest.warns(UserWarning, match="suggested max number of worker"):
        loader = loader_cls(dd.Indexed(4), num_workers=cpus + 1)
    with pytest.warns(UserWarning, match="suggested max number of worker"):
        assert len(list(loader)) == 4


# -- what only fastload promises ----------------------------------------------------------------
@pytest.mark.parametrize("kind", list(ERROR_TYPES))
def test_fastload_worker_error_names_the_batch_and_its_sample_indices(kind: str) -> None:
    exc = first_epoch_error(
        fastload.DataLoader(dd.Faulty(8, bad=5, kind=kind), batch_size=2, num_workers=2)
    )
    message = str(exc)
    assert re.search(r"\bbatch 2\b", message), message
    assert "[4, 5]" in message, message
    assert "worker process 0" in message and "sample 5 is corrupt" in message


def test_fastload_worker_init_fn_error_names_the_batch_it_failed() -> None:
    loader = fastload.DataLoader(
        dd.Indexed(8), batch_size=2, num_workers=2, worker_init_fn=dd.fail_in_worker_init
    )
    it = iter(loader)
    next(it)
    exc = raised_by(functools.partial(next, it))
    del it
    assert re.search(r"\bbatch 1\b", str(exc)) and "[2, 3]" in str(exc), str(exc)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_whose_start_raises_leaves_nothing_to_clean_up_that_fails(num_workers: int) -> None:
    """``iter()`` raising half-way (here torch's pin-memory warning, an error under this suite's
    filters) leaves an iterator half made; collecting it must not raise in ``__del__``."""

    loader = fastload.DataLoader(list(range(8)), batch_size=4, pin_memory=True, num_workers=num_workers)
    with pytest.raises(UserWarning, match="pin_memory"):
        iter(loader)
    gc.collect()
