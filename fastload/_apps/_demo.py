"""``fastload demo``: the same tiny training loop fed by fastload and by torch's DataLoader.

It writes a small variable-length token dataset (lognormal lengths, like text) in the fastload
HDF5 layout, then trains a small classifier on the CPU twice, for the same number of steps:
once with ``fastload.DataLoader`` over ``fastload.HDF5Dataset`` with length-grouped batches, and
once with torch's DataLoader over the Dataset a user typically writes (one h5py read per
sample, padding to the batch maximum). It prints samples/s, the stall (the share of the loop's
time spent waiting for data, as ``loader.stats()`` defines it: the first batch, which is
start-up, left out) and the share of padded tokens that were real. fastload's row shows
``loader.stats()``'s own figures; torch's are measured by the same meter in the loop.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.utils.data
from torch import nn

import fastload
from fastload._metrics._meter import StallMeter

VOCAB = 512


def write_dataset(path: Path, samples: int, seed: int = 0) -> None:
    """Token sequences with lognormal lengths (median 120, clipped to 8..1024) and a label the
    model can learn (whether token 7 occurs more often than token 9)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(120), 0.75, samples), 8, 1024).astype(np.int64)
    offsets = np.zeros(samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int64).astype(np.uint16)
    counts7 = np.add.reduceat(values == 7, offsets[:-1])
    counts9 = np.add.reduceat(values == 9, offsets[:-1])
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        grp = f.create_group("tokens")
        grp.create_dataset("values", data=values)
        grp.create_dataset("offsets", data=offsets)
        f.create_dataset("label", data=(counts7 > counts9).astype(np.int64))
        f.create_dataset("lengths", data=lengths)


class TypicalH5Dataset(torch.utils.data.Dataset):
    """What a user usually writes: open lazily, read one sample per ``__getitem__``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._file: Any = None
        with h5py.File(self.path, "r") as f:
            self._n = int(f.attrs["num_samples"])

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
        lo, hi = self._file["tokens/offsets"][i : i + 2]
        tokens = torch.from_numpy(self._file["tokens/values"][lo:hi].astype(np.int64))
        return tokens, int(self._file["label"][i])


def pad_collate(batch: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    tokens = nn.utils.rnn.pad_sequence([t for t, _ in batch], batch_first=True)
    lengths = torch.tensor([len(t) for t, _ in batch])
    mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return {"tokens": tokens, "attention_mask": mask, "lengths": lengths,
            "label": torch.tensor([y for _, y in batch])}


class TinyClassifier(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 2))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(torch.float32).unsqueeze(-1)
        pooled = (self.embed(tokens.long()) * m).sum(1) / m.sum(1).clamp(min=1)
        return self.head(pooled)


def train(batches: Iterable[dict[str, torch.Tensor]], steps: int) -> dict[str, float]:
    """Run ``steps`` optimizer steps; time spent inside ``next()`` is the wait, timed by the
    meter behind ``loader.stats()`` (so the stall is defined as there)."""
    torch.manual_seed(0)
    model = TinyClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    real = padded = 0.0
    losses: list[float] = []
    meter = StallMeter()
    meter.begin_wait()
    it = iter(batches)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(batches)
            batch = next(it)
        mask = batch["attention_mask"]
        lengths = mask.sum(1)
        meter.end_wait(int(mask.shape[0]), int(lengths.sum()), int(mask.numel()))
        logits = model(batch["tokens"], mask)
        loss = nn.functional.cross_entropy(logits, batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
        real += float(lengths.sum())
        padded += mask.numel()
        meter.begin_wait()
    stats = meter.snapshot(num_workers=0)
    del it
    return {
        "samples_per_s": stats.samples_per_s,
        "stall": stats.stall_fraction,
        "padding_efficiency": real / padded,
        "first_loss": float(np.mean(losses[:20])),
        "last_loss": float(np.mean(losses[-20:])),
    }


def run_demo(*, samples: int, steps: int, batch_size: int, workers: int, directory: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="fastload-demo-") as tmp:
        root = Path(directory) if directory else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        path = root / "demo.h5"
        t0 = time.perf_counter()
        write_dataset(path, samples)
        print(f"wrote {samples} variable-length samples to {path} in {time.perf_counter() - t0:.1f} s")
        torch.set_num_threads(1)  # the same compute budget for both loops
        fast: fastload.DataLoader[dict[str, torch.Tensor]] = fastload.DataLoader(
            fastload.HDF5Dataset(path),
            batch_size=batch_size,
            shuffle=True,
            length_grouped=True,
            num_workers=workers,
            collate_fn=fastload.PadCollate(dtype=torch.int64),
        )
        typical = torch.utils.data.DataLoader(
            TypicalH5Dataset(path),
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            collate_fn=pad_collate,
        )
        rows = [("fastload.DataLoader", train(fast, steps)), ("torch DataLoader", train(typical, steps))]
    stats = fast.stats()
    # fastload's row is what its loader.stats() says, printed below: one figure, one name.
    rows[0][1].update(samples_per_s=stats.samples_per_s, stall=stats.stall_fraction)
    print(f"\n{steps} training steps, batch size {batch_size}, num_workers={workers}, CPU\n")
    print(f"{'loader':<22}{'samples/s':>11}{'stall':>9}{'real tokens':>13}{'loss':>15}")
    for name, r in rows:
        print(
            f"{name:<22}{r['samples_per_s']:>11,.0f}{r['stall'] * 100:>7.1f} %"
            f"{r['padding_efficiency']:>13.1%}{r['first_loss']:>8.3f} → {r['last_loss']:.3f}"
        )
    speedup = rows[0][1]["samples_per_s"] / rows[1][1]["samples_per_s"]
    print(f"\nfastload trained {speedup:.1f}× as many samples per second as torch's DataLoader")
    print("(length-grouped batches waste less compute on padding; whole batches are read at once).")
    print("(stall: the share of the loop's time spent waiting for data, the first batch left out)")
    print(f"\nloader.stats(): {stats}")
    return 0
