"""fastload: whole batches from disk to the GPU, with the GPU never waiting.

Everything public is re-exported here; every other module is private.
"""

from __future__ import annotations

from fastload import errors
from fastload._collate import MicroBatch, PackCollate, PadCollate, split_microbatches
from fastload._doctor import doctor
from fastload._formats import ArrowDataset, HDF5Dataset
from fastload._loader._dataloader import DataLoader
from fastload._metrics import (
    BatchSizeReport,
    LoaderStats,
    MemoryEstimate,
    estimate_memory,
    find_batch_size,
)
from fastload._protocols import BatchReader, SlotCollate
from fastload._sampling import (
    BatchSizeWarmup,
    LengthGroupedBatchSampler,
    MixtureBatchSampler,
    PackedBatchSampler,
    WeightedLengthGroupedSampler,
)
from fastload._types import Field, Ragged

__version__ = "0.1.0"

__all__ = [
    "ArrowDataset",
    "BatchReader",
    "BatchSizeReport",
    "BatchSizeWarmup",
    "DataLoader",
    "Field",
    "HDF5Dataset",
    "LengthGroupedBatchSampler",
    "LoaderStats",
    "MemoryEstimate",
    "MicroBatch",
    "MixtureBatchSampler",
    "PackCollate",
    "PackedBatchSampler",
    "PadCollate",
    "Ragged",
    "SlotCollate",
    "WeightedLengthGroupedSampler",
    "__version__",
    "doctor",
    "errors",
    "estimate_memory",
    "find_batch_size",
    "split_microbatches",
]
