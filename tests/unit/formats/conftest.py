"""Fixtures for the reader tests: one small corpus, written by the helpers in _format_files."""

from __future__ import annotations

import pytest
from _format_files import Corpus, make_corpus

NUM_SAMPLES = 57  # prime, so batch, chunk and row-group boundaries fall everywhere


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return make_corpus(NUM_SAMPLES)
