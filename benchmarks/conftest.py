"""pytest-benchmark settings shared by every benchmark.

``--size smoke`` (the default, run by the test suite so the benchmarks never rot) uses data small
enough to finish in seconds; ``--size full`` uses the sizes quoted in benchmarks/README.md.
Every benchmark reports its result as a ratio against a baseline measured in the same process.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--size",
        choices=("smoke", "full"),
        default="smoke",
        help="smoke: seconds, for CI; full: the sizes quoted in benchmarks/README.md",
    )


@pytest.fixture(scope="session")
def bench_size(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--size"))
