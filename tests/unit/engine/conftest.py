"""Fixtures of the engine's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _fake_pool import Fakes


@pytest.fixture
def fakes() -> Iterator[Fakes]:
    """Engines and pumps over fake pools, closed (pumps first) after the test."""
    made = Fakes()
    yield made
    made.close()
