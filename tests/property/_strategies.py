"""Hypothesis strategies the property tests share."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


@st.composite
def shard_windows(draw: st.DrawFn, num_samples: int) -> dict[str, Any]:
    """``shard_sizes`` cutting ``num_samples`` into 1 to 11 shards (some may be empty), and a
    ``shuffle_shards`` from one shard per group to more than there are."""
    cuts = sorted(draw(st.lists(st.integers(0, num_samples), max_size=10)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, num_samples], strict=True)]
    return {"shard_sizes": sizes, "shuffle_shards": draw(st.integers(1, len(sizes) + 1))}
