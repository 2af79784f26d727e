"""Does the GPU wait for data? Copies, GPU idle at a fixed GPU step, and a small model's training.

What it measures, on one GPU, over the lognormal token corpus of ``_engine_harness.py``
(uint16 ids, lengths median 200, clipped 8..2048; every batch padded to its longest row, int64):

1. **copies**: host-to-device GB/s of one buffer from pinned and from pageable memory (CUDA
   events, median of 5);
2. **GPU idle**: a GPU step of fixed length (``torch.cuda._sleep``, calibrated with CUDA events)
   per batch of 256 rows, at steps that demand 30k, 60k, 100k and 130k samples/s; GPU idle is the
   time between one step's end and the next one's start on the consumer's stream (CUDA events,
   read after the run), over the run after the first batch. Loaders: torch's DataLoader with a
   per-sample h5py dataset and with a ``__getitems__`` gathering from a memory map (both
   ``pin_memory=True`` and the user's ``non_blocking`` copy), fastload with ``device="cuda"``,
   and fastload with ``pin_memory=True`` and the user's own ``non_blocking`` copy (the loop of
   the pinned-memory issue: a slot reused under a pending copy corrupts batches);
3. **training**: real tokens/s of a small next-token model (an embedding, two per-token MLP
   blocks, an output layer; Adam), batches of 64 rows, whose step is short enough for the loader
   to matter, against the same batches already resident on the GPU.

Every batch that reaches the GPU is compared with the reference built from the file in RAM: a
position-weighted int64 checksum of every element of ``tokens`` (and the sum of ``lengths``)
is queued on the GPU after the batch arrives and read once the run is over, and its shape is
checked. A mismatch fails the run (exit status 1).

Without CUDA (the suite's smoke run, ``tests/integration/test_bench_gpu.py``) the loaders run
on the host and the same comparison runs on the host batches; every GPU-only figure reads
"no CUDA".

Reproduce: ``.venv/bin/python benchmarks/bench_gpu.py --size full`` (under 4 minutes on one
GPU; prints the markdown table that ``benchmarks/README.md`` quotes, and ``--json PATH`` saves
the figures). ``--size smoke`` (the default) takes seconds and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data
from _engine_harness import MmapGather, TypicalVlen, collate_fn, pad, write_corpus
from torch import nn

import fastload

NO_CUDA = "no CUDA"
DEMANDS = (30_000, 60_000, 100_000, 130_000)  # samples/s the GPU step can take
_WEIGHT_MODULUS = 65_521  # checksum weights 1..65521 by flat position: a moved element shows


class Size(NamedTuple):
    samples: int
    rows: int  # rows a batch in the GPU-idle runs
    batches: int  # batches a GPU-idle run
    train_rows: int
    train_steps: int
    rounds: int
    copy_mib: int
    model_dim: int  # the smoke run trains a toy on the CPU: its figures mean nothing
    vocab: int


SIZES = {
    "smoke": Size(samples=2_000, rows=32, batches=4, train_rows=16, train_steps=2, rounds=1, copy_mib=8, model_dim=8, vocab=32),
    "full": Size(samples=200_000, rows=256, batches=300, train_rows=64, train_steps=300, rounds=2, copy_mib=256, model_dim=128, vocab=1024),
}


# -- the reference ------------------------------------------------------------------------------


class Reference:
    """The corpus in RAM, and what each batch of a plan must hold: its padded width, the
    position-weighted sum of its tokens and the sum of its lengths."""

    def __init__(self, path: Path) -> None:
        import h5py

        with h5py.File(path, "r") as f:
            self.values, self.offsets = f["tokens/values"][:], f["tokens/offsets"][:]
        self._expected: dict[tuple[int, ...], tuple[int, int, int]] = {}  # every run has the same plan

    def expected(self, rows: list[int]) -> tuple[int, int, int]:
        key = tuple(rows)
        if key not in self._expected:
            self._expected[key] = self._compute(rows)
        return self._expected[key]

    def _compute(self, rows: list[int]) -> tuple[int, int, int]:
        idx = np.asarray(rows, dtype=np.int64)
        starts, lengths = self.offsets[idx], np.diff(self.offsets)[idx]
        width = int(lengths.max())
        tokens = np.concatenate([self.values[s : s + n] for s, n in zip(starts, lengths, strict=True)])
        row = np.repeat(np.arange(idx.size, dtype=np.int64), lengths)
        column = np.arange(tokens.size, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        weights = (row * width + column) % _WEIGHT_MODULUS + 1
        return width, int((tokens.astype(np.int64) * weights).sum()), int(lengths.sum())

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        return pad([self.values[self.offsets[i] : self.offsets[i + 1]] for i in rows])


class Checker:
    """Queues each batch's checksum where the batch is (no wait), and compares them all with
    the reference once the run is over."""

    def __init__(self, device: torch.device, batches: int, rows: int) -> None:
        self.weights = torch.arange(rows * 2048, device=device, dtype=torch.int64) % _WEIGHT_MODULUS + 1
        self.sums = torch.zeros((batches, 2), dtype=torch.int64, device=device)
        self.shapes: list[tuple[int, ...]] = []

    def add(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        i = len(self.shapes)
        flat = tokens.reshape(-1)
        self.sums[i, 0] = (flat.to(torch.int64) * self.weights[: flat.numel()]).sum()
        self.sums[i, 1] = lengths.to(torch.int64).sum()
        self.shapes.append(tuple(tokens.shape))

    def mismatches(self, reference: Reference, plan: list[list[int]]) -> list[int]:
        """The batches that differ from the reference; every batch of ``plan`` must have come."""
        sums = self.sums.cpu().tolist()
        bad = [i for i in range(len(self.shapes), len(plan))]  # never arrived
        for i, shape in enumerate(self.shapes):
            width, weighted, lengths = reference.expected(plan[i])
            if shape != (len(plan[i]), width) or sums[i] != [weighted, lengths]:
                bad.append(i)
        return sorted(bad)


# -- the loaders --------------------------------------------------------------------------------


class Loader(NamedTuple):
    name: str
    make: Callable[[Path, list[list[int]]], Iterable[Any]]
    copies: bool  # the loop copies each batch to the device itself (non_blocking)


def loaders(cuda: bool, torch_workers: int, fast_workers: int) -> list[Loader]:
    pinned = ", pinned" if cuda else ""

    def per_sample(path: Path, plan: list[list[int]]) -> Iterable[Any]:
        return torch.utils.data.DataLoader(
            TypicalVlen(path), batch_sampler=plan, num_workers=torch_workers, collate_fn=pad, pin_memory=cuda
        )

    def getitems(path: Path, plan: list[list[int]]) -> Iterable[Any]:
        return torch.utils.data.DataLoader(
            MmapGather(path), batch_sampler=plan, num_workers=torch_workers, collate_fn=_first, pin_memory=cuda
        )

    def on_device(path: Path, plan: list[list[int]]) -> Iterable[Any]:
        dataset = fastload.HDF5Dataset(path, fields=["tokens"])
        device = "cuda" if cuda else None
        return fastload.DataLoader(dataset, batch_sampler=plan, num_workers=fast_workers, collate_fn=collate_fn(), device=device)

    def own_copy(path: Path, plan: list[list[int]]) -> Iterable[Any]:
        dataset = fastload.HDF5Dataset(path, fields=["tokens"])
        return fastload.DataLoader(dataset, batch_sampler=plan, num_workers=fast_workers, collate_fn=collate_fn(), pin_memory=cuda)

    return [
        Loader(f"torch, per-sample h5py, {torch_workers} workers{pinned}", per_sample, True),
        Loader(f"torch, `__getitems__` from a memory map, {torch_workers} workers{pinned}", getitems, True),
        Loader(f"fastload, {fast_workers} workers, " + ('`device="cuda"`' if cuda else "host (no CUDA)"), on_device, False),
        Loader(f"fastload, {fast_workers} workers, `pin_memory=True` + own `non_blocking` copy", own_copy, True),
    ]


def _first(batch: Any) -> Any:
    return batch


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# -- 1. copies ----------------------------------------------------------------------------------


def copy_rates(mib: int) -> dict[str, float]:
    """GB/s of one host-to-device copy of ``mib`` MiB from pinned and from pageable memory."""
    n = mib * 2**20
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, source in (("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()), ("pageable", torch.ones(n, dtype=torch.uint8))):
        target.copy_(source, non_blocking=True)  # warm: the first copy maps the pages
        seconds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        rates[name] = n / float(np.median(seconds)) / 1e9
    return rates


# -- 2. GPU idle at a fixed step ----------------------------------------------------------------


def sleep_cycles_per_ms() -> float:
    """What ``torch.cuda._sleep`` spins per millisecond on this GPU (CUDA events)."""
    torch.cuda._sleep(1_000_000)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


class Run(NamedTuple):
    rate: float  # samples/s (tokens/s in training) after the first batch(es), the caller's clock
    gpu_idle: float | None  # share of the GPU's time between steps; None without CUDA
    mismatches: list[int]
    batches: int


def drive(loader: Loader, path: Path, plan: list[list[int]], reference: Reference, step_cycles: int | None) -> Run:
    """One run of ``loader`` over ``plan``: each batch (copied by the loop where the loader
    leaves it on the host) checked, then the GPU step; without CUDA, no step."""
    cuda = step_cycles is not None
    device = torch.device("cuda" if cuda else "cpu")
    checker = Checker(device, len(plan), max(len(rows) for rows in plan))
    marks: list[tuple[Any, Any]] = []
    samples = first_samples = 0
    first_at = 0.0
    batches = loader.make(path, plan)
    for batch in batches:
        if cuda and loader.copies:
            batch = to_device(batch, device)
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        checker.add(batch["tokens"], batch["lengths"])
        if cuda:
            assert step_cycles is not None
            torch.cuda._sleep(step_cycles)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            marks.append((start, end))
        samples += int(batch["lengths"].shape[0])
        if not first_at:
            first_at, first_samples = time.perf_counter(), samples
        del batch
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - first_at
    del batches
    gc.collect()
    idle = None
    if cuda and len(marks) > 1:
        gaps = sum(max(0.0, marks[i - 1][1].elapsed_time(marks[i][0])) for i in range(1, len(marks)))
        idle = gaps / marks[0][1].elapsed_time(marks[-1][1])
    return Run((samples - first_samples) / max(seconds, 1e-9), idle, checker.mismatches(reference, plan), len(plan))


# -- 3. training --------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Next-token model whose step is short: an embedding, two residual per-token MLP blocks
    and an output layer over ``vocab`` ids (the corpus' ids taken modulo it)."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids % self.vocab)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def train(
    batches: Iterable[Any], plan: list[list[int]], reference: Reference, device: torch.device, copies: bool, size: Size
) -> Run:
    """Real tokens/s of :class:`TinyLM` steps over ``batches`` (the first two steps, start-up
    and kernel loading, before the clock), each batch checked as it arrives."""
    torch.manual_seed(0)
    model = TinyLM(size.model_dim, size.vocab).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    checker = Checker(device, len(plan), max(len(rows) for rows in plan))
    lengths = np.diff(reference.offsets)
    real = 0
    started = 0.0
    for i, batch in enumerate(batches):
        if copies and device.type == "cuda":
            batch = to_device(batch, device)
        ids, rows = batch["tokens"], batch["lengths"]
        checker.add(ids, rows)
        mask = torch.arange(ids.shape[1], device=device) < rows.to(device).unsqueeze(1)
        labels = torch.where(mask, ids % size.vocab, -100)
        logits = model(ids)
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, size.vocab), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        elif i > 1:
            real += int(lengths[plan[i]].sum())
        del batch, ids, rows
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return Run(real / max(seconds, 1e-9), None, checker.mismatches(reference, plan), len(plan))


# -- the run ------------------------------------------------------------------------------------


def make_plan(samples: int, batches: int, rows: int, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(samples)
    if batches * rows > samples:  # a small corpus: visit it again, reshuffled
        order = np.concatenate([np.random.default_rng(seed + k).permutation(samples) for k in range(-(-batches * rows // samples))])
    return [order[i * rows : (i + 1) * rows].tolist() for i in range(batches)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="smoke")
    parser.add_argument("--json", type=Path, help="also save the figures here")
    parser.add_argument("--dir", type=Path, help="where to write the corpus (default: a temporary folder)")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    cuda = torch.cuda.is_available()
    cores = os.cpu_count() or 2
    torch_workers = min(8, max(2, cores - 2)) if cuda else 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "corpus.h5"
        write_corpus(path, size.samples)
        reference = Reference(path)
        rows, figures = measure(path, reference, size, cuda, torch_workers, fast_workers=2)
    machine = torch.cuda.get_device_name() if cuda else f"no CUDA, {cores} cores (host runs only)"
    checked = sum(f["batches"] for f in figures)
    bad = {f["configuration"]: f["mismatches"] for f in figures if f["mismatches"]}
    print(f"\nbench_gpu --size {args.size}: {machine}, torch {torch.__version__}; "
          f"{checked} batches compared with the reference, {len(bad)} configurations differ\n")
    print(markdown(("measure", "configuration", "demand (samples/s)", "result", "GPU idle", "batches = reference"), rows))
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"size": args.size, "cuda": cuda, "machine": machine, "figures": figures,
             "batches_checked": checked, "mismatches": bad, "rows": rows}, indent=2))
    if bad:
        print(f"\nBATCHES DIFFER FROM THE REFERENCE: {bad}", file=sys.stderr)
        return 1
    return 0


def measure(
    path: Path, reference: Reference, size: Size, cuda: bool, torch_workers: int, fast_workers: int
) -> tuple[list[tuple[str, ...]], list[dict[str, Any]]]:
    rows: list[tuple[str, ...]] = []
    figures: list[dict[str, Any]] = []

    def record(measure_: str, configuration: str, demand: str, result: str, run: Run | None) -> None:
        idle = "-"
        if run is not None and measure_.startswith("GPU idle"):
            idle = NO_CUDA if run.gpu_idle is None else f"{run.gpu_idle:.2%}"
        check = "-" if run is None else f"{run.batches - len(run.mismatches)}/{run.batches}"
        rows.append((measure_, configuration, demand, result, idle, check))
        figures.append({"measure": measure_, "configuration": configuration, "demand": demand, "result": result,
                        "gpu_idle": None if run is None else run.gpu_idle,
                        "batches": 0 if run is None else run.batches,
                        "mismatches": [] if run is None else run.mismatches})

    # 1. copies
    rates = copy_rates(size.copy_mib) if cuda else {}
    for kind in ("pinned", "pageable"):
        result = f"{rates[kind]:.1f} GB/s" if cuda else NO_CUDA
        record(f"host-to-device copy, {size.copy_mib} MiB", f"{kind} memory", "-", result, None)

    # 2. GPU idle: every loader at every demand, rounds interleaved, medians
    plan = make_plan(size.samples, size.batches, size.rows, seed=1)
    cycles = sleep_cycles_per_ms() if cuda else None
    demands: tuple[int | None, ...] = DEMANDS if cuda else (None,)
    runs: dict[tuple[str, int | None], list[Run]] = {}
    for _ in range(size.rounds):
        for demand in demands:
            for loader in loaders(cuda, torch_workers, fast_workers):
                step = None if demand is None or cycles is None else int(cycles * 1e3 * size.rows / demand)
                runs.setdefault((loader.name, demand), []).append(drive(loader, path, plan, reference, step))
    for demand in demands:
        for loader in loaders(cuda, torch_workers, fast_workers):
            got = runs[(loader.name, demand)]
            rate = float(np.median([r.rate for r in got]))
            idles = [r.gpu_idle for r in got if r.gpu_idle is not None]
            merged = Run(rate, float(np.median(idles)) if idles else None,
                         sorted({m for r in got for m in r.mismatches}), sum(r.batches for r in got))
            if demand is None:
                record("GPU idle (no GPU step: the loader on the host)", loader.name, NO_CUDA,
                       f"{rate:,.0f} samples/s (host)", merged)
            else:
                record(f"GPU idle, batch {size.rows}, step {1e3 * size.rows / demand:.2f} ms", loader.name,
                       f"{demand:,}", f"{rate:,.0f} samples/s", merged)

    # 3. training
    device = torch.device("cuda" if cuda else "cpu")
    train_plan = make_plan(size.samples, size.train_steps + 2, size.train_rows, seed=2)
    resident = [to_device(reference.batch(r), device) for r in train_plan]
    if cuda:
        torch.cuda.synchronize()
    ceiling = train(resident, train_plan, reference, device, False, size)
    del resident
    name = f"training tokens/s, {TinyLM.__name__}({size.model_dim}, {size.vocab}), batch {size.train_rows}"
    record(name, "batches already on the GPU (the ceiling)", "-", f"{ceiling.rate:,.0f} tokens/s" if cuda else NO_CUDA, ceiling)
    for loader in loaders(cuda, torch_workers, fast_workers):
        trained = train(loader.make(path, train_plan), train_plan, reference, device, loader.copies, size)
        result = f"{trained.rate:,.0f} tokens/s ({trained.rate / ceiling.rate:.2f}x)" if cuda else NO_CUDA
        record(name, loader.name, "-", result, trained)
        gc.collect()
    return rows, figures


def markdown(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
