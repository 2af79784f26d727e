"""Does each host-tuning mechanism pay? fastload with every mechanism on, against every one on
but the one measured (``_engine/_host.py``: workers off the consumer's CPU, main-process builds,
leaving workers at nice 19), and against all of them off.

What it isolates: the same fresh-loader runs as ``bench_engine.py``'s fastload row (a plan of
batches of 64 from 200,000 token sequences, ``num_workers=2``), paired: each pair runs both
settings back to back in alternating order, and the figure is the median of the per-pair
ratios "without / with" (below 1: the mechanism pays), with its quartiles. Two measures: the
samples/s of a whole fresh run, and, for the exiting workers' priority, the time of the next
epoch's start and of an epoch's last ``next()`` when epochs follow each other.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_host.py -s -p no:cacheprovider --size full``
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _engine_harness import LOADERS, batch_plan, checksum, run, write_corpus

from fastload._engine._host import HostPolicy, WorkerHost

SIZES = {"smoke": (8_000, 40, 1), "full": (200_000, 1_000, 24)}  # samples, batches, pairs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, bench_size: str) -> tuple[Path, list[list[int]], int]:
    samples, batches, pairs = SIZES[bench_size]
    path = tmp_path_factory.mktemp("host") / "corpus.h5"
    write_corpus(path, samples)
    return path, batch_plan(samples, batches), pairs


@contextlib.contextmanager
def _without(mechanism: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every host-tuning mechanism on but ``mechanism`` ("all": every one off)."""
    with monkeypatch.context() as patch:
        if mechanism == "placement":
            patch.setattr(HostPolicy, "consumer_core", lambda self: None)
        elif mechanism == "main builds":
            patch.setattr(HostPolicy, "main_builds", property(lambda self: False))
        elif mechanism == "nice on exit":
            patch.setattr(WorkerHost, "leave", lambda self: None)
        elif mechanism == "all":
            patch.setenv("FASTLOAD_HOST_TUNING", "0")
        yield


def _paired(pairs: int, measure: Any) -> list[float]:
    """``measure(without)`` for both settings per pair, in alternating order; the ratios."""
    ratios = []
    for k in range(pairs):
        order = (False, True) if k % 2 else (True, False)
        got = {without: measure(without) for without in order}
        ratios.append(got[True] / got[False])
    return ratios


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


def test_each_host_tuning_mechanism_pays(
    corpus: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bench_size: str
) -> None:
    path, plan, pairs = corpus
    rows: list[list[str]] = []
    result: dict[str, Any] = {}
    for mechanism in ("all", "placement", "main builds"):

        def throughput(without: bool, mechanism: str = mechanism) -> float:
            with _without(mechanism, monkeypatch) if without else contextlib.nullcontext():
                return run(LOADERS["fastload"](path, plan, 2))["samples_per_s"]

        ratios = _paired(pairs, throughput)
        result[mechanism] = ratios
        rows.append([mechanism, "samples/s of a fresh run", _summary(ratios)])

    epochs_plan = plan[: max(10, len(plan) // 5)]
    timings: dict[bool, list[tuple[float, float]]] = {False: [], True: []}

    def ends(without: bool) -> float:
        with _without("nice on exit", monkeypatch) if without else contextlib.nullcontext():
            timings[without].append(_epoch_ends(path, epochs_plan))
        return timings[without][-1][0]

    ratios = _paired(pairs, ends)
    last = [b[1] / a[1] for a, b in zip(timings[False], timings[True], strict=True)]
    result["nice on exit"] = {"start": ratios, "end": last}
    rows.append(["nice on exit", "a later epoch's start", _summary(ratios)])
    rows.append(["nice on exit", "an epoch's last next()", _summary(last)])
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"host-{bench_size}.json").write_text(json.dumps(result, indent=2))
    widths = [max(len(r[i]) for r in [["without", "measure", "without / with"], *rows]) for i in range(3)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    with capsys.disabled():
        print(f"\nhost tuning, paired ratios without / with, median (quartiles), n={pairs} ({bench_size})")
        print("| " + " | ".join(h.ljust(w) for h, w in zip(["without", "measure", "without / with"], widths, strict=True)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        print("\n".join(lines))
