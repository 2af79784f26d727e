"""The wait histogram's quantiles stay within the stated relative error of the exact ones."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload._metrics._histogram import MIN_S, RATIO, LogHistogram


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(min_value=1e-6, max_value=1e3), min_size=1, max_size=300),
    st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
)
def test_quantiles_are_within_the_relative_error_bound(values: list[float], q: float) -> None:
    hist = LogHistogram()
    for v in values:
        hist.record(v)
    exact = nearest_rank(values, q)
    got = hist.quantile(q)
    assert got is not None
    assert abs(got - exact) <= (math.sqrt(RATIO) - 1) * exact * (1 + 1e-9)


def test_sub_microsecond_waits_report_as_zero_and_memory_is_constant() -> None:
    hist = LogHistogram()
    size = hist._counts.nbytes
    for v in np.random.default_rng(0).uniform(0, MIN_S / 2, 10_000):
        hist.record(float(v))
    assert hist.quantile(0.99) == 0.0
    assert hist.count == 10_000
    assert hist._counts.nbytes == size


def test_an_empty_histogram_has_no_quantile() -> None:
    assert LogHistogram().quantile(0.5) is None


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=0.0, max_value=2e4),
            st.sampled_from([0.0, MIN_S, MIN_S * RATIO, MIN_S * RATIO**7, 1e4, 1e5]),
        ),
        max_size=200,
    )
)
def test_recording_all_at_once_fills_the_same_buckets_as_one_by_one(values: list[float]) -> None:
    one, many = LogHistogram(), LogHistogram()
    for v in values:
        one.record(v)
    many.record_all(values)
    assert many.count == one.count == len(values)
    assert many._counts.tolist() == one._counts.tolist()
