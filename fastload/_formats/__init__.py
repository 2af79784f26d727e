"""Readers of HDF5, Arrow and Parquet files that return whole batches in one vectorized call."""

from fastload._formats._arrow_dataset import ArrowDataset
from fastload._formats._hdf5_dataset import HDF5Dataset

__all__ = ["ArrowDataset", "HDF5Dataset"]
