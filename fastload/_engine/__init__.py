"""The only package with processes, threads and shared memory.

The loader's iterator uses what is exported here and nothing else: :func:`start_runner` builds
the machinery for one iterator from one :class:`RunnerOptions`; :func:`in_process_fetcher`
builds batches in the calling process (``num_workers=0``).
"""

from fastload._engine._arena import available_memory_bytes
from fastload._engine._counts import batch_counts, planned_counts
from fastload._engine._fetch import in_process_fetcher
from fastload._engine._host import HostPolicy
from fastload._engine._messages import DONE, FAILED, OK, Delivery, Kind
from fastload._engine._parking import ParkingKey, park, park_seconds, parking_key
from fastload._engine._parking import take as take_parked
from fastload._engine._runner import (
    Runner,
    RunnerOptions,
    fast_path_collate,
    fresh_process_context,
    start_runner,
)

__all__ = [
    "DONE",
    "FAILED",
    "OK",
    "Delivery",
    "HostPolicy",
    "Kind",
    "ParkingKey",
    "Runner",
    "RunnerOptions",
    "available_memory_bytes",
    "batch_counts",
    "fast_path_collate",
    "fresh_process_context",
    "in_process_fetcher",
    "park",
    "park_seconds",
    "parking_key",
    "planned_counts",
    "start_runner",
    "take_parked",
]
