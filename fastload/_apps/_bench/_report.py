"""What ``fastload bench`` shows and keeps: the table, the recommendation per step, and the
files ``--out DIR`` writes (``results.json``, ``results.csv``, ``stall.png``)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload._apps._bench._loop import BenchRow
from fastload._metrics._stats import STALL_OK
from fastload.errors import install_command

#: (header, width) of each table column.
COLUMNS = (
    ("loader", 8),
    ("workers", 7),
    ("prefetch", 8),
    ("step", 12),
    ("samples/s", 11),
    ("stall %", 7),
    ("p99 wait ms", 11),
    ("first batch s", 13),
    ("PSS MiB", 8),
)
PLOT_HINT = f"stall.png not written: plotting needs matplotlib ({install_command('plot')})"


def rate_unit(packed: bool) -> str:
    """What the throughput column counts: samples, or packed rows (each holding several
    samples, or pieces of them)."""
    return "rows/s" if packed else "samples/s"


def table_header(unit: str = "samples/s") -> str:
    """The table's header; ``unit`` names the throughput column (:func:`rate_unit`)."""
    names = [
        f"{name:<{width}}" if i < 4 else f"{unit if name == 'samples/s' else name:>{width}}"
        for i, (name, width) in enumerate(COLUMNS)
    ]
    return "  ".join(names)


def table_row(row: BenchRow) -> str:
    cells = [
        row.loader,
        str(row.workers),
        "-" if row.prefetch is None else str(row.prefetch),
        row.step,
        f"{row.samples_per_s:,.0f}",
        f"{row.stall_fraction * 100:.1f}",
        "-" if row.p99_wait_ms is None else f"{row.p99_wait_ms:.2f}",
        "-" if row.first_batch_s is None else f"{row.first_batch_s:.2f}",
        "-" if row.pss_bytes is None else f"{row.pss_bytes / 2**20:,.0f}",
    ]
    return "  ".join(
        f"{cell:<{width}}" if i < 4 else f"{cell:>{width}}"
        for i, (cell, (_, width)) in enumerate(zip(cells, COLUMNS, strict=True))
    )


@dataclass(frozen=True)
class Recommendation:
    """For one step: the smallest fastload configuration (fewest workers, then the smallest
    prefetch) whose stall is under :data:`STALL_OK`, or ``None``; the lowest-stall fastload
    configuration; torch's row with the same workers as whichever of the two is reported."""

    step: str
    chosen: BenchRow | None
    best: BenchRow
    baseline: BenchRow | None
    text: str

    def as_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        return {
            "step": self.step,
            "num_workers": None if chosen is None else chosen.workers,
            "prefetch_factor": None if chosen is None else chosen.prefetch,
            "stall_fraction": None if chosen is None else chosen.stall_fraction,
            "samples_per_s": None if chosen is None else chosen.samples_per_s,
            "text": self.text,
        }


def recommend(
    rows: Sequence[BenchRow], step: str, *, cores: int, max_workers_tried: int,
    unit: str = "samples/s",
) -> Recommendation:
    ours = [r for r in rows if r.step == step and r.loader == "fastload"]
    if not ours:
        raise ValueError(f"recommend: no fastload rows for step {step!r}")
    ours.sort(key=lambda r: (r.workers, r.prefetch or 0))
    good = [r for r in ours if r.stall_fraction < STALL_OK]
    chosen = good[0] if good else None
    best = min(ours, key=lambda r: (r.stall_fraction, r.workers, r.prefetch or 0))
    shown = chosen or best
    baseline = next(
        (r for r in rows if r.step == step and r.loader == "torch" and r.workers == shown.workers),
        None,
    )
    versus = ""
    if baseline is not None:
        versus = (
            f"; torch's DataLoader with num_workers={baseline.workers}: stall "
            f"{baseline.stall_fraction * 100:.1f} %, {baseline.samples_per_s:,.0f} {unit}"
        )
    if chosen is not None:
        text = (
            f"{step} step: use {_settings(chosen)} — {_figures(chosen, unit)}{versus}"
        )
    else:
        if max_workers_tried < cores:
            advice = f"try --workers up to {cores} (this machine's cores)"
        else:
            advice = (
                f"the loader cannot keep up with a {step} step on {cores} cores: cut the work "
                "per batch (--max-tokens for less padding, an uncompressed file in fastload's "
                "layout from `fastload convert`) or use more cores"
            )
        text = (
            f"{step} step: no configuration kept the stall under {STALL_OK * 100:.0f} %; the "
            f"lowest, {_settings(best)}, stalls {best.stall_fraction * 100:.1f} % at "
            f"{best.samples_per_s:,.0f} {unit}{versus}. {advice[0].upper()}{advice[1:]}"
        )
    return Recommendation(step, chosen, best, baseline, text)


def _settings(row: BenchRow) -> str:
    if row.workers == 0:
        return "num_workers=0 (loading in the training process)"
    return f"num_workers={row.workers}, prefetch_factor={row.prefetch}"


def _figures(row: BenchRow, unit: str) -> str:
    parts = [f"stall {row.stall_fraction * 100:.1f} %", f"{row.samples_per_s:,.0f} {unit}"]
    if row.p99_wait_ms is not None:
        parts.append(f"p99 wait {row.p99_wait_ms:.2f} ms")
    if row.first_batch_s is not None:
        parts.append(f"first batch {row.first_batch_s:.2f} s")
    return ", ".join(parts)


def write_results(
    out: Path, rows: Sequence[BenchRow], recommendations: Sequence[Recommendation], meta: dict[str, Any]
) -> list[str]:
    """Write ``results.json``, ``results.csv`` and (with matplotlib) ``stall.png`` into
    ``out`` (created if needed); return the lines to print about them."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "rows": [r.as_dict() for r in rows],
        "recommendations": [r.as_dict() for r in recommendations],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    with (out / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(BenchRow)])
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
    written = [str(out / "results.json"), str(out / "results.csv")]
    lines = []
    if importlib.util.find_spec("matplotlib") is None:
        lines.append(PLOT_HINT)
    else:
        plot(rows, out / "stall.png")
        written.append(str(out / "stall.png"))
    return [f"wrote {', '.join(written)}", *lines]


def plot(rows: Sequence[BenchRow], path: Path) -> None:
    """Stall % and samples/s against workers: one colour per step; fastload solid for the
    first prefetch depth and dash-dot for the others; torch dashed with crosses."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    stall_ax, speed_ax = figure.subplots(1, 2)
    steps = list(dict.fromkeys(r.step for r in rows))
    depths = sorted({r.prefetch for r in rows if r.loader == "fastload" and r.prefetch is not None})
    for colour, step in enumerate(steps):
        lines: list[tuple[str, str, list[BenchRow]]] = []
        for k, depth in enumerate(depths or [None]):
            series = [
                r for r in rows
                if r.step == step and r.loader == "fastload" and r.prefetch in (depth, None)
            ]
            lines.append((f"fastload prefetch {depth}, {step}", "-" if k == 0 else "-.", series))
        torch_rows = [r for r in rows if r.step == step and r.loader == "torch"]
        lines.append((f"torch, {step}", "--", torch_rows))
        for label, style, series in lines:
            series = sorted(series, key=lambda r: r.workers)
            if not series:
                continue
            x = [r.workers for r in series]
            marker = "x" if style == "--" else "o"
            stall_ax.plot(x, [r.stall_fraction * 100 for r in series], style, marker=marker,
                          color=f"C{colour}", label=label)
            speed_ax.plot(x, [r.samples_per_s for r in series], style, marker=marker,
                          color=f"C{colour}", label=label)
    workers = sorted({r.workers for r in rows})
    stall_ax.axhline(STALL_OK * 100, color="grey", linewidth=0.8, linestyle=":")
    stall_ax.set(xlabel="num_workers", ylabel="stall %", title="share of the loop waiting for data",
                 xticks=workers)
    unit = rate_unit(any(r.packing_efficiency is not None for r in rows))
    speed_ax.set(xlabel="num_workers", ylabel=unit, title="throughput", xticks=workers)
    speed_ax.legend(fontsize="small")
    figure.savefig(path, dpi=110)
