"""A user's own ``BatchReader`` (no fastload base class) over a fastload HDF5 file, for the
fast-path tests; ``hook`` runs in the worker before each batch is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastload


class UserReader(torch.utils.data.Dataset):
    def __init__(self, path: Path) -> None:
        self.inner = fastload.HDF5Dataset(path, fields=["tokens"])
        self.lengths = self.inner.lengths
        self.fields = self.inner.fields

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.inner[i]

    def read_batch(self, indices: Any) -> Any:
        self.hook(np.asarray(indices))
        return self.inner.read_batch(indices)

    def hook(self, indices: np.ndarray) -> None:
        """Called with each batch's indices before it is read (a test's fault or delay)."""
