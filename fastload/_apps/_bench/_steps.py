"""The training steps ``fastload bench`` runs between two batches.

* :class:`SleepStep`: a simulated device step — ``time.sleep``, which uses no CPU, like a
  training loop waiting on its GPU. It isolates the loader: any time the loop spends beyond
  the sleeps is waiting for data.
* :class:`TinyModelStep`: a real step of a small model (embedding or projection, a per-token
  MLP, masked mean pooling, a classifier; Adam) on the CPU or a GPU. On the CPU it competes with
  the workers for cores, as a real CPU-side step (or a GPU step's launch overhead) does.

Both copy the batch to the device first (a no-op when the loader already delivered it there),
so a loader that prefetches to the device is credited for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fastload._device import cuda_device, to_device
from fastload._types import Field
from fastload.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (a :class:`UsageError` without CUDA) or ``"auto"`` (CUDA when
    available, else the CPU)."""
    if choice not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}; got {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    try:
        device = cuda_device("cuda")
    except RuntimeError:
        if choice == "cuda":
            raise UsageError(
                "--device cuda was given but CUDA is not available on this machine; pass "
                "--device cpu (or leave --device out) to benchmark on the CPU"
            ) from None
        return torch.device("cpu")
    assert device is not None
    return device


@dataclass(frozen=True)
class SleepStep:
    """Sleeps ``step_ms`` milliseconds per batch after moving it to ``device``."""

    step_ms: float
    device: torch.device

    @property
    def name(self) -> str:
        return f"{self.step_ms:g} ms"

    def __call__(self, batch: Any) -> None:
        to_device(batch, self.device)
        time.sleep(self.step_ms / 1e3)


class TinyModel(nn.Module):
    """About 0.28 M parameters (most in the embedding); the per-token MLP makes its cost grow
    with the padded tokens: about 50 k multiply-adds per token for forward and backward, so a
    batch of 64 rows of 200 tokens is a few tens of milliseconds on one CPU core."""

    VOCAB = 4096

    def __init__(self, field: Field, dim: int = 64) -> None:
        super().__init__()
        self.integer = bool(np.issubdtype(field.dtype, np.integer))
        width = int(np.prod(field.shape)) if field.shape else 1
        self.embed = nn.Embedding(self.VOCAB, dim) if self.integer else None
        self.proj = None if self.integer else nn.Linear(width, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if self.embed is not None:
            h = self.embed(x.reshape(rows, -1).long() % self.VOCAB)
        else:
            assert self.proj is not None
            length = x.shape[1] if mask is not None else 1
            h = self.proj(x.reshape(rows, length, -1).float())
        h = h + self.mlp(h)
        if mask is None:
            return self.head(h.mean(1))
        weights = mask.to(h.dtype).unsqueeze(-1)
        return self.head((h * weights).sum(1) / weights.sum(1).clamp(min=1.0))


class TinyModelStep:
    """One optimizer step of :class:`TinyModel` on batch field ``field`` (with its
    ``attention_mask`` when the field is ragged and padded; packed rows are pooled whole). Ends with ``float(loss)``, which waits for
    the device, so the step's device time is inside the step and not in the next wait."""

    def __init__(self, name: str, field: Field, device: torch.device) -> None:
        self.field = name
        self.ragged = field.kind == "ragged"
        self.device = device
        torch.manual_seed(0)
        self.model = TinyModel(field).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.loss = float("nan")

    @property
    def name(self) -> str:
        return f"tiny ({self.device})"

    def __call__(self, batch: Any) -> None:
        batch = to_device(batch, self.device)
        x = batch[self.field]
        # Packed rows have no attention_mask: they are nearly all real tokens, pooled whole.
        logits = self.model(x, batch.get("attention_mask") if self.ragged else None)
        target = torch.zeros(x.shape[0], dtype=torch.int64, device=self.device)
        loss = nn.functional.cross_entropy(logits, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.detach().item()


def model_field(dataset: Any) -> tuple[str, Field]:
    """The field ``--model tiny`` trains on: the length field, else the first numeric fixed
    field."""
    fields: dict[str, Field] = dataset.fields
    if dataset.length_field is not None:
        return dataset.length_field, fields[dataset.length_field]
    for name, field in fields.items():
        if field.kind == "fixed" and field.dtype != np.dtype(object):
            return name, field
    raise UsageError(
        f"--model tiny needs a numeric field to train on; the dataset has only "
        f"{', '.join(f'{n} ({f.kind})' for n, f in fields.items())}: use --step-ms"
    )
