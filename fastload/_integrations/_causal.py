"""``CausalLMCollate``: padded batches as a causal language model's forward takes them —
``input_ids``, ``attention_mask`` and ``labels`` (the ids, -100 on padding), what
``transformers.DataCollatorForLanguageModeling(mlm=False)`` makes.

A wrapper around :class:`~fastload.PadCollate` rather than a subclass or an option of it: the
labels are one more array in the batch slot (the engine's zero-copy path, ``prepare`` and
``layout``), written from the padded ids and the mask after ``PadCollate`` fills them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload._collate import PadCollate
from fastload._protocols import Layout, PreparedBatch
from fastload._types import Counts

LABELS = "labels"
IGNORE_INDEX = -100  # what torch's cross entropy, and so every transformers LM loss, ignores


class CausalLMCollate:
    """Pads the token field ``field`` (default ``input_ids``) into int64 ids, with
    ``attention_mask`` (1 on real tokens) and ``labels``: the ids, ``label_pad`` where the mask
    is 0. transformers' causal LM losses shift the labels themselves, so the labels are not
    shifted here. The other fields pass through as ``PadCollate`` outputs them (a fixed
    ``idx`` stacked, ``lengths``); the trainer gives the model only what its forward takes.

    ``pad_token_id`` fills the ids beyond each row (its value never reaches the loss: those
    labels are ``label_pad``); ``pad_to_multiple_of``, ``max_length`` and ``padding_side`` are
    ``PadCollate``'s. A collate for torch's DataLoader too (a list of sample dicts).
    """

    #: The batch is a function of the columnar batch alone, and ragged columns may come as
    #: spans over a reader's memory map (``fastload._protocols``).
    process_independent = True
    takes_spans = True

    def __init__(
        self,
        *,
        field: str = "input_ids",
        pad_token_id: int = 0,
        label_pad: int = IGNORE_INDEX,
        pad_to_multiple_of: int | None = None,
        max_length: int | None = None,
        padding_side: str = "right",
    ) -> None:
        if not isinstance(field, str) or field in (LABELS, "attention_mask", "lengths"):
            raise ValueError(
                f"field must name the token field, not one this collate generates; got {field!r}"
            )
        if not isinstance(label_pad, int) or isinstance(label_pad, bool):
            raise TypeError(f"label_pad must be an int; got {label_pad!r}")
        self._field = field
        self._label_pad = label_pad
        self._pad = PadCollate(
            pad_value={field: pad_token_id},
            dtype={field: torch.int64},
            primary=field,
            pad_to_multiple_of=pad_to_multiple_of,
            max_length=max_length,
            padding_side=padding_side,
        )

    @property
    def field(self) -> str:
        return self._field

    @property
    def pad_to_multiple_of(self) -> int | None:
        """The multiple padded lengths are rounded up to (``fastload._protocols.RoundingCollate``)."""
        return self._pad.pad_to_multiple_of

    def prepare(self, batch: Mapping[str, Any]) -> _WithLabels:
        """The padded batch planned once, plus its ``labels`` (``fastload._protocols``)."""
        return _WithLabels(self._pad.prepare(batch), self._field, self._label_pad)

    def layout(self, batch: Mapping[str, Any]) -> Layout:
        return self.prepare(batch).layout

    def collate_into(self, batch: Mapping[str, Any], out: Mapping[str, np.ndarray]) -> None:
        prepared = self.prepare(batch)
        for name, (shape, dtype) in prepared.layout.items():
            if name not in out or out[name].shape != shape or out[name].dtype != dtype:
                raise ValueError(
                    f"collate_into: array {name!r} must have shape {shape} and dtype {dtype}"
                )
        prepared.fill(out)

    def __call__(self, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        out = self._pad(batch)
        out[LABELS] = out[self._field].masked_fill(out["attention_mask"] == 0, self._label_pad)
        return out


class _WithLabels:
    """``PadCollate``'s prepared batch with a ``labels`` array after its own."""

    def __init__(self, padded: PreparedBatch, field: str, label_pad: int) -> None:
        if LABELS in padded.layout:
            raise ValueError(
                f"the batch already has a {LABELS!r} field; CausalLMCollate makes the labels "
                "from the token ids: leave it out of the dataset's fields"
            )
        self._padded = padded
        self._field = field
        self._label_pad = label_pad
        layout = dict(padded.layout)
        layout[LABELS] = (layout[field][0], layout[field][1])
        self._layout: Layout = layout

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def counts(self) -> Counts:
        return self._padded.counts

    def fill(self, out: Mapping[str, np.ndarray]) -> None:
        self._padded.fill({name: out[name] for name in self._padded.layout})
        labels = out[LABELS]
        np.copyto(labels, out[self._field])
        labels[out["attention_mask"] == 0] = self._label_pad
