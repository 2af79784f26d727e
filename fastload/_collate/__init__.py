"""Collation (layer 2): pad ragged fields, stack fixed ones, masks and lengths — into arrays the
caller provides — pack documents into fixed-length rows, and split batches into micro-batches
for gradient accumulation."""

from __future__ import annotations

from fastload._collate._microbatch import MicroBatch, split_microbatches
from fastload._collate._pack import PackCollate
from fastload._collate._pack_source import PackedSource
from fastload._collate._pad import PadCollate

__all__ = ["MicroBatch", "PackCollate", "PackedSource", "PadCollate", "split_microbatches"]
