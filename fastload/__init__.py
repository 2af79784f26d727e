"""fastload: whole batches from disk to the GPU, with the GPU never waiting.

Everything public is re-exported here; every other module is private.
"""

from __future__ import annotations

from fastload import errors
from fastload._formats import ArrowDataset, HDF5Dataset
from fastload._loader import DataLoader

__version__ = "0.1.0"

__all__ = [
    "ArrowDataset",
    "DataLoader",
    "HDF5Dataset",
    "__version__",
    "errors",
]
