"""Does each host-tuning mechanism pay? fastload as it ships against fastload without the one
mechanism measured: a leaving worker's nice 19 (``_engine/_host.py``), and the pump's engine
thread for a slow consumer and its inline driver for a fast one (``_engine/_pump.py``). (The
engine thread's wake-up written while holding the GIL, through ``ctypes``, was measured here
too, at a 2 ms step's stall: 1.16, quartiles 0.83-1.88, n = 12; it went.)

What it isolates: the same fresh-loader runs as ``bench_engine.py``'s fastload row (a plan of
batches of 64 from 200,000 token sequences, ``num_workers=2``), paired: each pair runs both
settings back to back in alternating order, and the figure is the median of the per-pair
ratios "without / with" with its quartiles (throughput: below 1, the mechanism pays; times and
stalls: above 1, it pays), beside the medians of each setting.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_host.py -s -p no:cacheprovider --size full``
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _engine_harness import LOADERS, batch_plan, checksum, run, stall_as_users_loop, write_corpus

from fastload._engine import _pump
from fastload._engine._host import WorkerHost

SIZES = {"smoke": (8_000, 40, 1), "full": (200_000, 1_000, 24)}  # samples, batches, pairs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, bench_size: str) -> tuple[Path, list[list[int]], int]:
    samples, batches, pairs = SIZES[bench_size]
    path = tmp_path_factory.mktemp("host") / "corpus.h5"
    write_corpus(path, samples)
    return path, batch_plan(samples, batches), pairs


@contextlib.contextmanager
def _without(mechanism: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """fastload as it ships but ``mechanism``."""
    with monkeypatch.context() as patch:
        if mechanism == "nice on exit":
            patch.setattr(WorkerHost, "leave", lambda self: None)
        elif mechanism == "engine thread":  # next() drives, however slow the step
            patch.setattr(_pump, "FAST_STEP_S", float("inf"))
            patch.setattr(_pump, "SLOW_STEP_S", float("inf"))
        elif mechanism == "inline driver":  # the thread drives, however fast the step
            patch.setattr(_pump, "FAST_STEP_S", -1.0)
            patch.setattr(_pump, "SLOW_STEP_S", -1.0)
        yield


def _paired(pairs: int, measure: Callable[[bool], float]) -> tuple[list[float], dict[bool, list[float]]]:
    """``measure(without)`` for both settings per pair, in alternating order: the ratios
    without / with, and each setting's figures."""
    ratios: list[float] = []
    seen: dict[bool, list[float]] = {False: [], True: []}
    for k in range(pairs):
        order = (False, True) if k % 2 else (True, False)
        got = {without: measure(without) for without in order}
        ratios.append(got[True] / got[False])
        for without, value in got.items():
            seen[without].append(value)
    return ratios, seen


def _summary(ratios: list[float]) -> str:
    low, mid, high = np.percentile(ratios, [25, 50, 75])
    return f"{mid:.2f} ({low:.2f}-{high:.2f})"


def _epoch_ends(path: Path, plan: list[list[int]]) -> tuple[float, float]:
    """Three epochs of one loader: the mean time of a later epoch's start (iter and its first
    batch, while the last epoch's workers exit) and of an epoch's last ``next()``."""
    loader = LOADERS["fastload"](path, plan, 2)
    starts, ends = [], []
    for epoch in range(3):
        t = time.perf_counter()
        it = iter(loader)
        next(it)
        if epoch:
            starts.append(time.perf_counter() - t)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                ends.append(time.perf_counter() - t)
                break
            checksum(batch)
            del batch
    return float(np.mean(starts)), float(np.mean(ends))


@pytest.mark.timeout(1800)  # the full size runs for minutes
def test_each_host_tuning_mechanism_pays(
    corpus: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bench_size: str
) -> None:
    path, plan, pairs = corpus
    rows: list[list[str]] = []
    result: dict[str, Any] = {}

    def add(mechanism: str, measure: str, unit: str, ratios: list[float], seen: dict[bool, list[float]]) -> None:
        result[f"{mechanism}: {measure}"] = {"ratios": ratios, "without": seen[True], "with": seen[False]}
        rows.append(
            [mechanism, measure, _summary(ratios), f"{np.median(seen[True]):{unit}}", f"{np.median(seen[False]):{unit}}"]
        )

    def throughput(mechanism: str) -> Callable[[bool], float]:
        def measure(without: bool) -> float:
            with _without(mechanism, monkeypatch) if without else contextlib.nullcontext():
                return run(LOADERS["fastload"](path, plan, 2))["samples_per_s"]

        return measure

    def stall(mechanism: str, step_s: float) -> Callable[[bool], float]:
        sub = plan[: max(10, min(len(plan), int(1.0 / step_s)))] if bench_size == "full" else plan[:10]

        def measure(without: bool) -> float:
            with _without(mechanism, monkeypatch) if without else contextlib.nullcontext():
                return stall_as_users_loop(LOADERS["fastload"](path, sub, 2), step_s)["stall"]

        return measure

    add("inline driver", "samples/s of a fresh run", ",.0f", *_paired(pairs, throughput("inline driver")))
    stall_pairs = max(1, pairs // 2)
    add("engine thread", "stall, 10 ms step", ".2%", *_paired(stall_pairs, stall("engine thread", 0.010)))

    epochs_plan = plan[: max(10, len(plan) // 5)]
    timings: dict[bool, list[tuple[float, float]]] = {False: [], True: []}

    def ends(without: bool) -> float:
        with _without("nice on exit", monkeypatch) if without else contextlib.nullcontext():
            timings[without].append(_epoch_ends(path, epochs_plan))
        return timings[without][-1][0]

    ratios, seen = _paired(pairs, ends)
    add("nice on exit", "a later epoch's start, s", ".4f", ratios, seen)
    last = {w: [t[1] for t in timings[w]] for w in (False, True)}
    add("nice on exit", "an epoch's last next(), s", ".4f", [b / a for a, b in zip(last[False], last[True], strict=True)], last)

    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"host-{bench_size}.json").write_text(json.dumps(result, indent=2))
    header = ["without", "measure", "without / with", "without", "with"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    with capsys.disabled():
        print(f"\nhost tuning, paired ratios without / with, median (quartiles), n={pairs} ({bench_size})")
        print(line(header))
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        print("\n".join(line(r) for r in rows))
