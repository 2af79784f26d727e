"""One local Ray instance for the whole of tests/ray (2 CPUs, no dashboard, on 127.0.0.1),
started at the first test that asks for it and stopped at the end of the session (these tests
run last: see tests/conftest.py); and the S3
test server of tests/remote, whose fixtures are loaded from there so that both suites share one
server implementation. Without Ray installed, every test here is skipped."""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REMOTE = Path(__file__).resolve().parents[1] / "remote"


def _load_remote_fixtures() -> object:
    sys.path.insert(0, str(REMOTE))  # tests/remote/conftest.py imports its _servers module
    spec = importlib.util.spec_from_file_location("_remote_fixtures", REMOTE / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_remote = _load_remote_fixtures()
_moto = _remote._moto  # type: ignore[attr-defined]
_proxy = _remote._proxy  # type: ignore[attr-defined]
s3_server = _remote.s3_server  # type: ignore[attr-defined]
bucket = _remote.bucket  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The running instance's GCS address (what ``--ray-address`` takes). Conversions in this
    process find Ray initialized and use it; a CLI in a subprocess connects with the address."""
    pytest.importorskip("ray.data")
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
