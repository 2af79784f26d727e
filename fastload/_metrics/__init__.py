"""Measuring the loader: the clock, the stall meter, stats snapshots and their diagnosis, the
worker auto-tuning policy, and the batch-size and memory helpers. Pure: no processes, no
threads, no torch, nothing of the package above it (``fastload bench`` builds on these, in
``fastload._apps._bench``)."""

from fastload._metrics._autotune import AutoTuner, Decision, available_cores
from fastload._metrics._batchsize import (
    BatchSizeReport,
    BatchSizeTrial,
    find_batch_size,
    is_out_of_memory,
)
from fastload._metrics._clock import Clock, ManualClock
from fastload._metrics._memory import MemoryEstimate, estimate_memory
from fastload._metrics._meter import ENGINE_FIELDS, StallMeter
from fastload._metrics._stats import LoaderStats, diagnose

__all__ = [
    "ENGINE_FIELDS",
    "AutoTuner",
    "BatchSizeReport",
    "BatchSizeTrial",
    "Clock",
    "Decision",
    "LoaderStats",
    "ManualClock",
    "MemoryEstimate",
    "StallMeter",
    "available_cores",
    "diagnose",
    "estimate_memory",
    "find_batch_size",
    "is_out_of_memory",
]
