"""The engine of ``fastload bench``: for each configuration, a short training-like loop over
``fastload.DataLoader`` and, on the same data and the same batch plan, over torch's
``DataLoader`` as the baseline.

Every configuration loads the same :class:`~fastload._apps._bench._data.BatchPlan` (as
``batch_sampler=``) and collates with the same ``PadCollate`` (packed plans: the dataset read
through ``PackedSource`` and collated by the same ``PackCollate``); torch's DataLoader reads
each batch with the dataset's ``__getitems__`` (one vectorized read per batch, the best a torch
user can do with these readers). The loop is timed by a :class:`StallMeter` — the first wait
includes creating the iterator, so worker start-up is in ``first_batch_s``; the process tree's
memory is read once, untimed, after the last step (see ``_bench_memory``).

Order: for each step, for each worker count, fastload at every prefetch depth, then torch at
the first prefetch depth (torch's default, 2, unless ``--prefetch`` says otherwise). Running
them interleaved spreads the machine's noise over both loaders alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.utils.data

import fastload
from fastload._apps._bench._data import BatchPlan
from fastload._apps._bench._memory import tree_pss_bytes
from fastload._metrics._meter import StallMeter
from fastload._metrics._stats import LoaderStats
from fastload.errors import UsageError


@dataclass(frozen=True)
class BenchOptions:
    """What to sweep; validated at construction (a :class:`UsageError` names the option).

    ``workers`` and ``prefetch`` are the values of ``num_workers`` and ``prefetch_factor`` to
    try (``prefetch`` applies only with workers); ``step_ms`` the simulated step times, or
    ``model="tiny"`` for a real small model instead; ``batches`` the batches per configuration.
    """

    workers: tuple[int, ...] = (0, 1, 2, 4)
    prefetch: tuple[int, ...] = (2, 4)
    step_ms: tuple[float, ...] = (2.0, 10.0, 50.0)
    model: str | None = None
    batches: int = 100

    def __post_init__(self) -> None:
        _check_list("--workers", self.workers, minimum=0)
        _check_list("--prefetch", self.prefetch, minimum=1)
        if self.model is None:
            _check_list("--step-ms", self.step_ms, minimum=0)
            if any(not math.isfinite(s) for s in self.step_ms):
                raise UsageError(f"--step-ms: every value must be finite; got {self.step_ms}")
        elif self.model != "tiny":
            raise UsageError(f"--model must be 'tiny'; got {self.model!r}")
        if self.batches < 1:
            raise UsageError(f"--batches must be >= 1; got {self.batches}")


@dataclass(frozen=True)
class BenchRow:
    """One configuration's result. ``wait_s`` and ``step_s`` are the loop's totals without the
    first batch (start-up, in ``first_batch_s``); ``stall_fraction = wait_s / (wait_s +
    step_s)``, in [0, 1]. Times in seconds unless ``_ms``. ``prefetch`` is ``None`` without
    workers; ``pss_bytes`` is the process tree's memory after the last step (``None`` without
    psutil)."""

    loader: str
    workers: int
    prefetch: int | None
    step: str
    batches: int
    samples: int
    samples_per_s: float
    wait_s: float
    step_s: float
    stall_fraction: float
    p50_wait_ms: float | None
    p99_wait_ms: float | None
    first_batch_s: float | None
    pss_bytes: int | None
    padding_efficiency: float | None
    diagnosis: str
    #: Packed batches: real tokens / rows * seq_len, in place of ``padding_efficiency``.
    packing_efficiency: float | None = None
    #: The run started with the dataset's files evicted from the page cache (``--cold``).
    cold: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Step = Callable[[Any], None]


def configurations(options: BenchOptions) -> list[tuple[str, int, int | None]]:
    """``(loader, workers, prefetch)`` in the order they run, for one step."""
    runs: list[tuple[str, int, int | None]] = []
    for workers in options.workers:
        depths: Sequence[int | None] = options.prefetch if workers else (None,)
        runs.extend(("fastload", workers, depth) for depth in depths)
        runs.append(("torch", workers, depths[0]))
    return runs


def make_collate(dataset: Any, plan: BatchPlan) -> fastload.PadCollate | fastload.PackCollate:
    """What both loaders collate ``plan``'s batches with: ``PadCollate`` padding to each
    batch's longest row, or for a packed plan ``PackCollate`` into rows of its length."""
    if plan.pack_length is None:
        return fastload.PadCollate(primary=dataset.length_field)
    return fastload.PackCollate(plan.pack_length, rows=plan.rows[0], primary=dataset.length_field)


def make_loader(
    loader: str,
    dataset: Any,
    plan: BatchPlan,
    collate: fastload.PadCollate | fastload.PackCollate,
    *,
    workers: int,
    prefetch: int | None,
    device: torch.device,
) -> Iterable[Any]:
    """fastload's or torch's DataLoader over ``plan``; fastload copies batches to a CUDA
    ``device`` itself, torch pins them for the step's copy (what a torch user writes). Packed
    plans read ``dataset`` through ``PackedSource``, which both loaders hand the packed
    batches."""
    batch_sampler: list[Any] = list(plan.batches)
    if plan.pack_length is not None:
        from fastload._collate import PackedSource

        dataset = PackedSource(dataset, seq_len=plan.pack_length, rows=plan.rows[0])
    if loader == "fastload":
        return fastload.DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=workers,
            prefetch_factor=prefetch,
            collate_fn=collate,
            device=device if device.type == "cuda" else None,
        )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        prefetch_factor=prefetch,
        collate_fn=collate,
        pin_memory=device.type == "cuda",
    )


def measure(
    loader: Iterable[Any], plan: BatchPlan, step: Step, *, workers: int
) -> tuple[LoaderStats, int | None]:
    """Run ``step`` on every batch of ``loader``; return its stats and the process tree's PSS
    after the last step. Rows and tokens are counted from ``plan`` (the batches arrive in the
    plan's order)."""
    meter = StallMeter()
    meter.packing = plan.pack_length is not None
    pss: int | None = None
    meter.begin_wait()
    batches = iter(loader)  # inside the first wait: worker start-up is start-up
    for index in range(len(plan) + 1):
        if index == len(plan):
            # The last step is closed and the wait still open is never counted: an untimed
            # moment with the workers alive, to read the memory.
            pss = tree_pss_bytes()
        try:
            batch = next(batches)
        except StopIteration:
            break
        if index == len(plan):
            raise RuntimeError(f"the loader yielded more than the plan's {len(plan)} batches")
        meter.end_wait(*plan.counts(index))
        step(batch)
        meter.begin_wait()
    stats = meter.snapshot(num_workers=workers)
    if stats.batches != len(plan):
        raise RuntimeError(f"the loader yielded {stats.batches} batches; the plan has {len(plan)}")
    return stats, pss


def run_configuration(
    loader: str,
    workers: int,
    prefetch: int | None,
    *,
    dataset: Any,
    plan: BatchPlan,
    collate: fastload.PadCollate | fastload.PackCollate,
    step: Step,
    step_name: str,
    device: torch.device,
    cold: bool = False,
) -> BenchRow:
    batches = make_loader(
        loader, dataset, plan, collate, workers=workers, prefetch=prefetch, device=device
    )
    stats, pss = measure(batches, plan, step, workers=workers)
    return BenchRow(
        loader=loader,
        workers=workers,
        prefetch=prefetch,
        step=step_name,
        batches=stats.batches,
        samples=stats.samples,
        samples_per_s=stats.samples_per_s,
        wait_s=stats.wait_s,
        step_s=stats.step_s,
        stall_fraction=stats.stall_fraction,
        p50_wait_ms=stats.p50_wait_ms,
        p99_wait_ms=stats.p99_wait_ms,
        first_batch_s=stats.first_batch_s,
        pss_bytes=pss,
        padding_efficiency=stats.padding_efficiency,
        diagnosis=stats.diagnosis,
        packing_efficiency=stats.packing_efficiency,
        cold=cold,
    )


def _check_list(option: str, values: Sequence[float], *, minimum: float) -> None:
    if not values:
        raise UsageError(f"{option}: expected at least one value")
    low = min(values)
    if low < minimum:
        raise UsageError(f"{option}: every value must be >= {minimum:g}; got {low:g}")
