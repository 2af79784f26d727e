"""Length-grouped and packed batch sampling: seeded windows, token budgets, rank sharding, exact
resume.

Pure index arithmetic on per-sample lengths (layer 1): nothing here knows of processes or CUDA.
"""

from __future__ import annotations

from fastload._sampling._packed import PackedBatchSampler
from fastload._sampling._sampler import LengthGroupedBatchSampler
from fastload._sampling._warmup import BatchSizeWarmup
from fastload._sampling._weighted import MixtureBatchSampler, WeightedLengthGroupedSampler

__all__ = [
    "BatchSizeWarmup",
    "LengthGroupedBatchSampler",
    "MixtureBatchSampler",
    "PackedBatchSampler",
    "WeightedLengthGroupedSampler",
]
