"""Does the GPU wait on the loader? fastload's engine against torch's DataLoader, same batches.

What it isolates: the loader alone — reading, padding and moving batches of 64 variable-length
token sequences (int64 output, padded to the batch maximum) from one HDF5 file to the consumer,
with ``num_workers=2`` on this 2-core machine. Every figure is a median over rounds run in this
one process, reported as a ratio against a baseline measured alongside it; every loader's
output is checked against the in-RAM reference. Each round makes a new fastload loader, as it
makes new torch ones; its workers are the ones the round before parked (NOTE [parked workers]
in ``fastload/_engine/_parking.py``), except in the first round or two of the process.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_engine.py -s --size full``
(``--size smoke``, the default, is what the test suite runs so the benchmark never rots).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _engine_harness import (
    LOADERS,
    PeakPss,
    batch_plan,
    in_ram_limit,
    in_ram_per_sample,
    run,
    stall_as_users_loop,
    write_corpus,
)

SIZES = {"smoke": (8_000, 40, 1), "full": (200_000, 1_000, 5)}  # samples, batches, rounds


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, bench_size: str) -> tuple[Path, list[list[int]], int]:
    samples, batches, rounds = SIZES[bench_size]
    path = tmp_path_factory.mktemp("engine") / "corpus.h5"
    write_corpus(path, samples)
    return path, batch_plan(samples, batches), rounds


def _table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([f"\n{title}", line(header), sep, *map(line, rows)])


def _report(name: str, payload: dict[str, Any], capsys: pytest.CaptureFixture[str], text: str) -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    with capsys.disabled():
        print(text)


# Slow baselines get a prefix of the plan, so each run lasts about a second at their speed.
_PREFIX = {"typical": 8, "flat": 25}
_CONFIGS = [
    ("typical", 2),
    ("flat", 2),
    ("mmap_getitems", 0),
    ("mmap_getitems", 2),
    ("fastload", 2),
]


def test_throughput_against_torch_dataloader(corpus: Any, benchmark: Any, capsys: Any, bench_size: str) -> None:
    path, plan, rounds = corpus
    results: dict[str, list[float]] = {}
    steady: dict[str, list[float]] = {}

    def record(name: str, got: dict[str, float]) -> None:
        results.setdefault(name, []).append(got["samples_per_s"])
        steady.setdefault(name, []).append(got["steady_samples_per_s"])

    for _ in range(rounds):  # interleaved rounds: noise hits every loader alike
        ref = run(in_ram_limit(path, plan))
        record("in-RAM gather + pad, fastload kernel, no loader (the limit)", ref)
        per_sample = run(in_ram_per_sample(path, plan))
        assert per_sample["checksum"] == ref["checksum"], "the two in-RAM references disagree"
        record("in-RAM per-sample dicts + PadCollate, no loader", per_sample)
        for name, workers in _CONFIGS:
            sub = plan[: _PREFIX.get(name, len(plan)) * (5 if bench_size == "full" else 1)]
            got = run(LOADERS[name](path, sub, workers))
            expected = ref["checksum"] if sub is plan else run(in_ram_limit(path, sub))["checksum"]
            assert got["checksum"] == expected, f"{name} returned different batches"
            record(f"{name}, {workers} workers", got)
    med = {k: float(np.median(v)) for k, v in results.items()}
    med_steady = {k: float(np.median(v)) for k, v in steady.items()}
    fast, fast_steady = med["fastload, 2 workers"], med_steady["fastload, 2 workers"]
    # The same ratio taken round by round (each round runs every loader back to back), then the
    # median: a drift of the machine's speed between rounds cancels out of it.
    paired = {
        k: float(np.median(np.asarray(results["fastload, 2 workers"]) / np.asarray(v)))
        for k, v in results.items()
    }
    rows = [
        [
            k,
            f"{v:,.0f}",
            f"{fast / v:.2f}x",
            f"{paired[k]:.2f}x",
            f"{med_steady[k]:,.0f}",
            f"{fast_steady / med_steady[k]:.2f}x",
        ]
        for k, v in med.items()
    ]
    _report(
        f"throughput-{bench_size}",
        {
            "samples_per_s": med,
            "steady_samples_per_s": med_steady,
            "paired_ratio": paired,
            "batches": len(plan),
            "rounds": rounds,
        },
        capsys,
        _table(
            f"samples/s ({bench_size}, {len(plan)} batches, median of {rounds})",
            ["loader", "samples/s", "fastload is", "per round", "after 1st batch", "fastload is"],
            rows,
        ),
    )
    benchmark.extra_info.update({k: round(v) for k, v in med.items()})
    benchmark.pedantic(lambda: run(LOADERS["fastload"](path, plan, 2)), rounds=1, iterations=1)


@pytest.mark.parametrize("step_ms", [2, 10, 50])
def test_stall_fraction_at_a_fixed_step(corpus: Any, step_ms: int, capsys: Any, bench_size: str) -> None:
    """The stall in the loop as users write it (the previous batch held through ``next()``,
    let go as ``batch`` is rebound), from the caller's clock
    (``_engine_harness.stall_as_users_loop``)."""
    path, plan, rounds = corpus
    n = max(10, min(len(plan), int(1.5 / (step_ms / 1000)))) if bench_size == "full" else 10
    sub = plan[:n]
    expected = run(in_ram_limit(path, sub))["checksum"]
    stalls: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name in ("mmap_getitems", "fastload"):
            got = stall_as_users_loop(LOADERS[name](path, sub, 2), step_ms / 1000)
            assert got["checksum"] == expected, f"{name} returned different batches"
            stalls.setdefault(name, []).append(got["stall"])
            ends.setdefault(name, []).append(got["end_s"])
    med = {k: float(np.median(v)) for k, v in stalls.items()}
    rows = [
        [k, f"{v:.2%}", f"{min(stalls[k]):.2%}-{max(stalls[k]):.2%}", f"{np.median(ends[k]) * 1e3:.1f}"]
        for k, v in med.items()
    ]
    _report(
        f"stall-{step_ms}ms-{bench_size}",
        {"stall": med, "rounds_stall": stalls, "end_s": ends, "batches": n, "rounds": rounds},
        capsys,
        _table(
            f"stall fraction, {step_ms} ms step, 2 workers, the user's loop, caller's clock ({bench_size})",
            ["loader", "stall", "range", "epoch's end ms"],
            rows,
        ),
    )


def test_first_batch_and_peak_memory(corpus: Any, capsys: Any, bench_size: str) -> None:
    path, plan, rounds = corpus
    first: dict[str, list[float]] = {}
    peak: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name in ("mmap_getitems", "fastload"):
            with PeakPss() as pss:
                got = run(LOADERS[name](path, plan, 2))
            first.setdefault(name, []).append(got["first_batch_s"])
            peak.setdefault(name, []).append(pss.peak)
    rows = [
        [k, f"{np.median(first[k]):.3f}", f"{np.median(peak[k]) / 2**20:,.0f}"] for k in first
    ]
    ratio = float(np.median(peak["fastload"]) / np.median(peak["mmap_getitems"]))
    _report(
        f"startup-memory-{bench_size}",
        {"first_batch_s": {k: float(np.median(v)) for k, v in first.items()},
         "peak_pss_bytes": {k: float(np.median(v)) for k, v in peak.items()}, "pss_ratio": ratio},
        capsys,
        _table(f"time to first batch and peak PSS, 2 workers ({bench_size}); "
               f"fastload/torch PSS = {ratio:.2f}", ["loader", "first batch s", "peak PSS MiB"], rows),
    )


class _Ready:
    """The floor: a Python iterator whose next() only pops an item already there, as cheap as
    a loader's next() can be. After a long step even this runs from cold caches."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items[::-1]

    def __iter__(self) -> _Ready:
        return self

    def __next__(self) -> Any:
        if not self._items:
            raise StopIteration
        return self._items.pop()


def _next_costs(batches: Any, count: int, step_s: float) -> tuple[list[float], float]:
    """Each steady next() as the caller's clock sees it, and the stall fraction from the same
    clock (time in next() over the time since the first batch)."""
    it = iter(batches)
    waits: list[float] = []
    started = time.perf_counter()
    next(it)  # start-up, reported apart (test_first_batch_and_peak_memory)
    first = time.perf_counter()
    for _ in range(count):
        t0 = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t0)
        del batch
        time.sleep(step_s)
    elapsed = time.perf_counter() - first
    del it, started
    return waits, sum(waits) / elapsed


@pytest.mark.parametrize("step_ms", [2, 10, 50])
def test_next_of_a_ready_batch(corpus: Any, step_ms: int, capsys: Any, bench_size: str) -> None:
    """next() of a batch that is ready when asked for (the step is longer than building it),
    from the caller's clock: the median and 90th percentile per call, the stall that makes, and
    the stall the loader's own meter reports for the same run. The baseline is :class:`_Ready`
    after the same step."""
    path, plan, rounds = corpus
    count = max(20, min(len(plan) - 1, int(1.5 / (step_ms / 1000)))) if bench_size == "full" else 10
    sub = plan[: count + 1]
    medians: dict[str, list[float]] = {}
    p90s: dict[str, list[float]] = {}
    stalls: dict[str, list[float]] = {}
    meter: list[float] = []
    for _ in range(rounds):
        loaders: dict[str, Any] = {
            "floor: an iterator over ready items": _Ready([{"lengths": np.zeros(1)}] * (count + 1)),
            "torch, __getitems__ memmap, 2 workers": LOADERS["mmap_getitems"](path, sub, 2),
            "fastload, 2 workers": LOADERS["fastload"](path, sub, 2),
        }
        for name, loader in loaders.items():
            waits, stall = _next_costs(loader, count, step_ms / 1000)
            medians.setdefault(name, []).append(float(np.median(waits)))
            p90s.setdefault(name, []).append(float(np.percentile(waits, 90)))
            stalls.setdefault(name, []).append(stall)
            if name.startswith("fastload"):
                meter.append(loader.stats("epoch").stall_fraction)
    med = {k: float(np.median(v)) for k, v in medians.items()}
    floor = med["floor: an iterator over ready items"]
    rows = [
        [k, f"{med[k] * 1e6:.0f}", f"{np.median(p90s[k]) * 1e6:.0f}", f"{med[k] / floor:.1f}x",
         f"{np.median(stalls[k]):.2%}"]
        for k in med
    ]
    meter_stall = float(np.median(meter))
    _report(
        f"next-{step_ms}ms-{bench_size}",
        {"median_s": med, "p90_s": {k: float(np.median(v)) for k, v in p90s.items()},
         "stall": {k: float(np.median(v)) for k, v in stalls.items()}, "meter_stall": meter_stall,
         "calls": count, "rounds": rounds},
        capsys,
        _table(
            f"next() of a ready batch after a {step_ms} ms step, caller's clock ({bench_size}, "
            f"{count} calls x {rounds}); fastload's own meter: stall {meter_stall:.2%}",
            ["loader", "median us", "p90 us", "vs floor", "stall"],
            rows,
        ),
    )


def _per_call_s(action: Any, calls: int) -> float:
    """The median over 5 repeats of ``action()``'s seconds per call."""
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            action()
        times.append((time.perf_counter() - started) / calls)
    return float(np.median(times))


def test_where_the_consumers_time_per_batch_goes(corpus: Any, capsys: Any, bench_size: str) -> None:
    """A model of the consuming process's time per batch on the fast path: each piece timed
    alone on real objects (the arena, the codec, a batch a builder wrote, a pipe), beside the
    consumer's whole CPU time per batch in a real 2-worker run at step 0 (the rest is the
    engine's, the pump's and the iterator's Python, and the meter)."""
    import select

    from fastload._engine._arena import SlotArena
    from fastload._engine._builder import SlotBuilder
    from fastload._engine._slots import SlotCodec, decode_reply
    from fastload._engine._transport import write_frame
    from fastload._metrics._meter import StallMeter
    from fastload._types import Counts

    path, plan, _ = corpus
    calls = 2000 if bench_size == "full" else 50
    dataset = LOADERS["fastload"](path, plan[:1], 0).dataset
    collate = LOADERS["fastload"](path, plan[:1], 0).collate_fn
    arena = SlotArena(slot_bytes=1 << 20, slots=8, max_bytes=1 << 28)
    codec = SlotCodec(arena)
    builder = SlotBuilder(dataset, collate, os.getpid())
    indices = plan[0]
    task = codec.task(indices)
    message = codec.task_message(0, 0, task)
    _, _, seen = builder.task_message(message)
    reply = builder.result_bytes((0, 0, 0, builder.build(seen), 0.0, None, None))
    payload = decode_reply(reply).payload
    pieces: dict[str, float] = {}

    def task_and_message() -> None:
        made = codec.task(indices)
        codec.task_message(0, 1, made)
        codec.drop(made)

    pieces["slot for a task, its message (slot bookkeeping)"] = _per_call_s(task_and_message, calls)
    r, w = os.pipe()
    poller = select.poll()
    poller.register(r, select.POLLIN)

    def pipes() -> None:
        write_frame(w, message)
        os.read(r, 1 << 16)
        os.write(w, reply)
        poller.poll(0)
        os.read(r, 1 << 16)

    pieces["sending the task, receiving the reply (system calls)"] = _per_call_s(pipes, calls)
    pieces["decoding the reply"] = _per_call_s(lambda: decode_reply(reply), calls)

    def views() -> None:
        made = codec.task(indices)
        batch, _ = codec.deliver(made, payload)  # the worker counted it (payload.counts)
        del batch  # let go: the slot is taken in by the next task()

    pieces["tensor views of the slot, let go"] = _per_call_s(views, calls) - pieces[
        "slot for a task, its message (slot bookkeeping)"
    ] / 2
    meter = StallMeter()
    counts = Counts(64, 1000, 2000)

    def meter_record() -> None:
        entry = meter.record(time.perf_counter(), *counts)
        entry[0] = time.perf_counter()

    pieces["the meter"] = _per_call_s(meter_record, calls)
    os.close(r)
    os.close(w)
    arena.close()
    # The whole: the consumer's own CPU per batch, at step 0 (its thread only; no checksum).
    whole = []
    for _ in range(3):
        it = iter(LOADERS["fastload"](path, plan, 2))
        next(it)
        cpu0, n = time.thread_time(), 0
        for batch in it:
            n += 1
            del batch
        whole.append((time.thread_time() - cpu0) / max(1, n))
    whole_s = float(np.median(whole))
    rest = whole_s - sum(pieces.values())
    rows = [[k, f"{v * 1e6:.1f}", f"{v / whole_s:.0%}"] for k, v in pieces.items()]
    rows.append(["the rest: engine, pump, iterator (Python)", f"{rest * 1e6:.1f}", f"{rest / whole_s:.0%}"])
    rows.append(["the consumer's CPU per batch, 2 workers, step 0", f"{whole_s * 1e6:.1f}", "100%"])
    _report(
        f"consumer-cost-{bench_size}",
        {"pieces_s": pieces, "whole_s": whole_s},
        capsys,
        _table(f"the consumer's time per batch, fast path ({bench_size})", ["piece", "us", "share"], rows),
    )
