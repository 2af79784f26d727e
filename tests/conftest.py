"""Suite-wide settings: warnings are errors (pyproject), every test has a timeout and a hang
dumps all stacks (pytest-timeout + faulthandler), tests that need CUDA are skipped where there
is none, and fastload's local cache (decoded Parquet copies) is a temporary directory, never the
user's. Also the fixtures that unit and integration tests share.

The suite runs with host tuning as the environment says (``FASTLOAD_HOST_TUNING``); a test
marked ``host_tuned`` checks its mechanism and runs with it on whatever the environment says.

A finished iterator's workers are not parked for the next one (``FASTLOAD_PARK_S=0``): most
tests check what a loader leaves behind at the end of its epoch, torch's behaviour. A test
marked ``parked_workers`` runs with parking on (NOTE [parked workers] in
``fastload/_engine/_parking.py``), and closes what it parked."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastload._engine import _parking, _pump


@pytest.fixture(autouse=True, scope="session")
def _local_cache_in_a_temporary_directory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTLOAD_CACHE", str(tmp_path_factory.mktemp("fastload-cache")))
        yield


@pytest.fixture(autouse=True)
def _parking_only_where_a_test_checks_it(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    marker = request.node.get_closest_marker("parked_workers")
    monkeypatch.setenv(_parking.ENV, "0" if marker is None else str(marker.kwargs.get("seconds", 60)))
    yield
    if marker is not None:
        _parking.close_parked()


@pytest.fixture(autouse=True)
def _host_tuning_for_tests_of_its_mechanisms(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("host_tuned") is not None:
        monkeypatch.setenv("FASTLOAD_HOST_TUNING", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tests/ray last: the Ray instance they start lives to the end of the session (eight idle
    # processes beside every later test on 2 cores), and a process that has run Ray keeps its
    # threads and its SIGTERM handler after ray.shutdown(), which later forks inherit.
    ray_dir = Path(__file__).parent / "ray"
    items.sort(key=lambda item: item.path.is_relative_to(ray_dir))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["threaded", "inline"])
def driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the engine thread driving throughout, or with ``next()`` driving
    from the second batch on (the thread drives during the first step), whatever the pace."""
    if request.param == "threaded":
        monkeypatch.setattr(_pump, "FAST_STEP_S", -1.0)
        monkeypatch.setattr(_pump, "SLOW_STEP_S", -1.0)
    else:
        monkeypatch.setattr(_pump, "FAST_STEP_S", 1e9)
        monkeypatch.setattr(_pump, "SLOW_STEP_S", 2e9)
    return str(request.param)


@pytest.fixture
def refcounts_only() -> Iterator[None]:
    """Without the cyclic collector for the test, an object dropped is freed at once (a
    reference cycle would keep it, a host batch's shared-memory slot or a loader's workers,
    until some later collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def collect_what_the_test_left() -> Iterator[None]:
    """Collect the reference cycles a test leaves behind (an exception's traceback keeps an
    iterator, and its workers, alive in one), so that their shutdown is not charged to the next
    test. What existed before the test is frozen (``gc.freeze``) until then: the collection
    scans the test's own objects, not the suite's whole heap (0.3-0.5 s a collection once
    the suite has imported everything, per test of a module of hundreds)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()
