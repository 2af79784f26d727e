"""Sequence packing against length-grouped padding and random batches, at one token budget.

What it isolates, on the issue's lognormal set (median 200, sigma 0.75, clipped 8..2048), rows
of ``seq_len = 2048`` tokens, 8 rows a batch, against a budget of ``max_tokens = 16384`` for
the padded batches (8 × 2048, so that random batches of 8 rows never exceed it either):

1. **plan time**: a fresh ``PackedBatchSampler`` and its first ``len()`` (which plans the epoch)
   against a fresh ``LengthGroupedBatchSampler(max_tokens=16384)`` and its first ``len()``, on
   10 million lengths;
2. **efficiency**: the planned packing efficiency (real tokens / rows × seq_len) at packing
   windows of 1, 10 and 100 batches and the whole epoch, beside the padding efficiency (real /
   padded tokens) of length-grouped batches and of random batches of 8 rows, and for all of
   them the real share of the token budget;
3. **loader tokens/s**: ``fastload.DataLoader`` over an HDF5 file of token sequences (uint16
   ids, none of them 0, so the pad value 0 tells padding apart), ``num_workers=2``, consumed as
   fast as possible, a fresh loader per round: ``pack_length=2048, batch_size=8`` against
   ``max_tokens=16384`` (the length-grouped fast path, int64 ids and a bool mask), and packed
   with the narrow outputs: ``PackCollate(position_dtype=torch.int32)`` (24 bytes a token
   instead of 28), and with ``device_labels=True`` too (16 bytes a token: no ``labels`` in the
   slots; the consumer's loader builds them from the ids with torch, as it does on the GPU
   after the copy with ``device="cuda"``). Each epoch's ids are summed and counted, so every
   token is checked to arrive exactly once;
4. **training tokens/s**: the same loaders, plus random batches of 8 (``batch_size=8,
   shuffle=True``, ``PadCollate``), feeding a small next-token model on the CPU whose cost is
   proportional to rows × width (an embedding, two per-token MLP blocks, an output layer; Adam):
   real tokens trained per second.

Every figure is a median of interleaved rounds run in this one process, and the table gives it
as a ratio against its baseline measured alongside it.

Sizes: ``--size smoke`` (the default, run by the test suite) plans 1 M lengths and loads a file
of 20,000 samples — seconds, and the numbers mean nothing; ``--size full`` is what
``benchmarks/README.md`` quotes (10 M lengths, 200,000 samples; about a minute on 2 cores).

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_packing.py -s -p no:cacheprovider
--size full``, or ``.venv/bin/python benchmarks/bench_packing.py --size full``.
"""

from __future__ import annotations

import gc
import itertools
import json
import resource
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np
import numpy.typing as npt
import pytest
import torch
from bench_sampling import interleaved_medians, lognormal_lengths, table
from torch import nn

import fastload
from fastload import LengthGroupedBatchSampler, PackedBatchSampler

# The full size plans ten million lengths a dozen times: more than the suite's default timeout.
pytestmark = pytest.mark.timeout(900)

SEQ_LEN = 2048
ROWS = 8
MAX_TOKENS = SEQ_LEN * ROWS
WORKERS = 2


class Size(NamedTuple):
    plan_lengths: int
    plan_rounds: int
    efficiency_samples: int
    file_samples: int
    loader_rounds: int
    train_batches: int
    train_rounds: int


SIZES = {
    "smoke": Size(1_000_000, 2, 50_000, 20_000, 2, 3, 1),
    "full": Size(10_000_000, 5, 200_000, 200_000, 5, 24, 5),
}


@pytest.fixture(scope="module")
def size(bench_size: str) -> Size:
    return SIZES[bench_size]


def report(name: str, payload: dict[str, Any], text: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    with capsys.disabled():
        print(text)


# -- 1. plan time ----------------------------------------------------------------------------


def test_plan_time_against_the_length_grouped_plan(
    size: Size, bench_size: str, benchmark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = lognormal_lengths(size.plan_lengths)
    planned: dict[str, int] = {}

    def packed() -> None:
        planned["packed"] = len(PackedBatchSampler(lengths, seq_len=SEQ_LEN, rows=ROWS))

    def grouped() -> None:
        planned["grouped"] = len(LengthGroupedBatchSampler(lengths, max_tokens=MAX_TOKENS))

    names = {
        "LengthGroupedBatchSampler(max_tokens=16384) (baseline)": grouped,
        f"PackedBatchSampler(seq_len={SEQ_LEN}, rows={ROWS})": packed,
    }
    medians = interleaved_medians(names, repeats=size.plan_rounds)
    baseline = medians["LengthGroupedBatchSampler(max_tokens=16384) (baseline)"]
    # Both plans hold every token once: at least as many batches as the tokens fill.
    assert planned["packed"] * MAX_TOKENS >= int(lengths.sum())
    assert planned["grouped"] * MAX_TOKENS >= int(lengths.sum())
    rows = [
        (name, f"{seconds:.3f} s", f"{seconds / baseline:.2f}x")
        for name, seconds in medians.items()
    ]
    report(
        f"packing-plan-{bench_size}",
        {"seconds": medians, "batches": planned, "lengths": size.plan_lengths},
        table(
            f"construction + first plan, {size.plan_lengths:,} lengths, median of "
            f"{size.plan_rounds} (target: packed about the length-grouped plan)",
            ("sampler", "median", "vs length-grouped"),
            rows,
        ),
        capsys,
    )
    benchmark.extra_info.update({k: round(v, 4) for k, v in medians.items()})
    benchmark.pedantic(packed, rounds=1, iterations=1)


# -- 2. efficiency ---------------------------------------------------------------------------


def random_budget_batches(lengths: npt.NDArray[np.int64], rows: int, seed: int = 1) -> list[npt.NDArray[np.int64]]:
    """Random batches of ``rows`` samples (torch's ``BatchSampler`` over a shuffle): with
    ``rows = max_tokens // longest sample`` no batch exceeds the budget."""
    order = np.random.default_rng(seed).permutation(lengths.size)
    return [order[i : i + rows] for i in range(0, lengths.size, rows)]


def padded_figures(lengths: npt.NDArray[np.int64], batches: Iterable[Any]) -> tuple[float, float]:
    """Real over padded tokens, and real over the tokens of the budgets the batches took."""
    real = padded = count = 0
    for batch in batches:
        picked = lengths[np.asarray(batch, dtype=np.int64)]
        real += int(picked.sum())
        padded += picked.size * int(picked.max())
        count += 1
    return real / padded, real / (count * MAX_TOKENS)


def test_packing_efficiency_by_window(
    size: Size, bench_size: str, benchmark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = lognormal_lengths(size.efficiency_samples)
    assert int(lengths.max()) <= SEQ_LEN  # so random batches of ROWS rows fit the budget
    random_padding, random_budget = padded_figures(lengths, random_budget_batches(lengths, ROWS))
    grouped_padding, grouped_budget = padded_figures(
        lengths, LengthGroupedBatchSampler(lengths, max_tokens=MAX_TOKENS)
    )
    rows = [
        (f"random batches of {ROWS} rows (baseline)", f"{random_padding:.3f}", f"{random_budget:.3f}", "1.00x"),
        (
            "length-grouped, max_tokens=16384",
            f"{grouped_padding:.3f}",
            f"{grouped_budget:.3f}",
            f"{grouped_budget / random_budget:.2f}x",
        ),
    ]
    efficiency: dict[str, float] = {}
    for window in (1, 10, 100, None):
        sampler = PackedBatchSampler(lengths, seq_len=SEQ_LEN, rows=ROWS, window=window)
        planned = sampler.efficiency()
        # The plan's own figure, recounted from the batches it yields.
        batches = list(sampler)
        real = sum(batch.num_tokens for batch in batches)
        assert real == int(lengths.sum())
        assert planned == pytest.approx(real / (len(batches) * MAX_TOKENS))
        label = "None" if window is None else str(window)
        efficiency[label] = planned
        rows.append(
            (
                f"packed, window={label}" + (" (default)" if window == 100 else ""),
                f"{planned:.4f}",
                f"{planned:.4f}",
                f"{planned / random_budget:.2f}x",
            )
        )
    report(
        f"packing-efficiency-{bench_size}",
        {
            "packing_efficiency": efficiency,
            "grouped": [grouped_padding, grouped_budget],
            "random": [random_padding, random_budget],
        },
        table(
            f"real tokens at seq_len {SEQ_LEN}, {ROWS} rows / 16,384 tokens a batch, "
            f"{lengths.size:,} lognormal samples (target: packed >= 0.99 at the default window)",
            ("batches", "real / padded", "real / budget", "vs random"),
            rows,
        ),
        capsys,
    )
    benchmark.extra_info.update({f"window {k}": round(v, 5) for k, v in efficiency.items()})
    benchmark.pedantic(
        lambda: PackedBatchSampler(lengths, seq_len=SEQ_LEN, rows=ROWS).efficiency(), rounds=1
    )
    assert efficiency["100"] >= 0.99


# -- 3. loader tokens/s ----------------------------------------------------------------------


class Corpus(NamedTuple):
    path: Path
    lengths: npt.NDArray[np.int64]
    id_sum: int


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, size: Size) -> Corpus:
    """The lognormal set as uint16 token ids 1..31999 in the fastload layout."""
    lengths = lognormal_lengths(size.file_samples)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.random.default_rng(4).integers(1, 32_000, int(offsets[-1]), dtype=np.uint16)
    path = tmp_path_factory.mktemp("packing") / "tokens.h5"
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = lengths.size
        f.create_dataset("tokens/values", data=values)
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("lengths", data=lengths)
    return Corpus(path, lengths, int(values.sum(dtype=np.int64)))


def packed_loader(path: Path, **options: Any) -> fastload.DataLoader[Any]:
    dataset = fastload.HDF5Dataset(path, fields=["tokens"])
    return fastload.DataLoader(dataset, pack_length=SEQ_LEN, batch_size=ROWS, **options)


def narrow_loader(path: Path, **options: Any) -> fastload.DataLoader[Any]:
    collate = fastload.PackCollate(SEQ_LEN, rows=ROWS, position_dtype=torch.int32)
    return packed_loader(path, collate_fn=collate, **options)


def narrow_labels_loader(path: Path, **options: Any) -> fastload.DataLoader[Any]:
    collate = fastload.PackCollate(SEQ_LEN, rows=ROWS, position_dtype=torch.int32, device_labels=True)
    return packed_loader(path, collate_fn=collate, **options)


def grouped_loader(path: Path, **options: Any) -> fastload.DataLoader[Any]:
    dataset = fastload.HDF5Dataset(path, fields=["tokens"])
    collate = fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)
    return fastload.DataLoader(dataset, max_tokens=MAX_TOKENS, collate_fn=collate, **options)


def random_loader(path: Path, **options: Any) -> fastload.DataLoader[Any]:
    dataset = fastload.HDF5Dataset(path, fields=["tokens"])
    collate = fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)
    return fastload.DataLoader(dataset, batch_size=ROWS, shuffle=True, collate_fn=collate, **options)


class Epoch(NamedTuple):
    seconds: float
    first_batch_s: float
    real_tokens: int
    total_tokens: int
    id_sum: int
    cpu_s: float = 0.0  # this process's and its reaped children's CPU time (see cpu_seconds)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have exited (a loader's workers,
    once it is closed): less swayed than wall time by what else runs on a shared machine."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def consume(loader: Iterable[Any]) -> Epoch:
    """One epoch as fast as it comes; each batch's ids are counted and summed (a pass over
    every byte, as a copy to the device would make)."""
    real = total = id_sum = 0
    first = 0.0
    start = time.perf_counter()
    for batch in loader:
        ids = batch["tokens"].numpy()
        if not first:
            first = time.perf_counter() - start
        real += int(np.count_nonzero(ids))
        total += ids.size
        id_sum += int(ids.sum())
        del batch, ids
    return Epoch(time.perf_counter() - start, first, real, total, id_sum)


def test_loader_tokens_per_second_packed_against_padded(
    corpus: Corpus,
    size: Size,
    bench_size: str,
    benchmark: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU per token counts the workers only once this process has reaped them: each
    # round's workers are forked here and leave with their loader (not the worker server's
    # children, not parked for the next loader).
    monkeypatch.setenv("FASTLOAD_WORKER_SERVER", "0")
    monkeypatch.setenv("FASTLOAD_PARK_S", "0")
    makers = {
        "length-grouped padding, max_tokens=16384 (baseline)": grouped_loader,
        f"packed, pack_length={SEQ_LEN}, batch_size={ROWS}": packed_loader,
        "packed, int32 position_ids": narrow_loader,
        "packed, int32 position_ids, device_labels": narrow_labels_loader,
    }
    epochs: dict[str, list[Epoch]] = {name: [] for name in makers}
    efficiency: dict[str, float | None] = {}
    for round_number in range(size.loader_rounds):
        shift = round_number % len(makers)
        names = list(makers)
        for name in names[shift:] + names[:shift]:
            cpu_before = cpu_seconds()
            loader = makers[name](corpus.path, num_workers=WORKERS)
            epoch = consume(loader)
            # Every token exactly once: the count and the sum of the file's ids.
            assert (epoch.real_tokens, epoch.id_sum) == (int(corpus.lengths.sum()), corpus.id_sum), name
            stats = loader.stats()
            efficiency[name] = stats.packing_efficiency or stats.padding_efficiency
            del loader
            gc.collect()  # the workers exit and are reaped: their CPU time counts
            epochs[name].append(epoch._replace(cpu_s=cpu_seconds() - cpu_before))
    baseline = "length-grouped padding, max_tokens=16384 (baseline)"

    def median(name: str, figure: Callable[[Epoch], float]) -> float:
        return float(np.median([figure(e) for e in epochs[name]]))

    real_rate = {n: median(n, lambda e: e.real_tokens / e.seconds) for n in makers}
    total_rate = {n: median(n, lambda e: e.total_tokens / e.seconds) for n in makers}
    # Ratios taken round by round, then the median: a drift between rounds cancels out.
    paired = {
        n: float(np.median([p.real_tokens / p.seconds / (b.real_tokens / b.seconds)
                            for p, b in zip(epochs[n], epochs[baseline], strict=True)]))
        for n in makers
    }
    rows = [
        (
            name,
            f"{real_rate[name] / 1e6:.1f} M",
            f"{real_rate[name] / real_rate[baseline]:.2f}x",
            f"{paired[name]:.2f}x",
            f"{total_rate[name] / 1e6:.1f} M",
            f"{total_rate[name] / total_rate[baseline]:.2f}x",
            f"{efficiency[name]:.3f}",
            f"{median(name, lambda e: e.first_batch_s) * 1e3:.0f} ms",
            f"{median(name, lambda e: e.cpu_s / e.real_tokens) * 1e9:.1f}",
        )
        for name in makers
    ]
    report(
        f"packing-loader-{bench_size}",
        {"real_tokens_per_s": real_rate, "total_tokens_per_s": total_rate, "paired": paired,
         "cpu_ns_per_token": {n: median(n, lambda e: e.cpu_s / e.real_tokens) * 1e9 for n in makers},
         "efficiency": efficiency, "samples": int(corpus.lengths.size), "rounds": size.loader_rounds},
        table(
            f"loader tokens/s, {corpus.lengths.size:,} samples ({int(corpus.lengths.sum()):,} "
            f"tokens) an epoch, {WORKERS} workers, median of {size.loader_rounds} fresh loaders "
            "(target: packed >= 0.9x padded)",
            ("loader", "real tokens/s", "vs padded", "per round", "rows x width /s", "vs padded",
             "real / width", "first batch", "CPU ns / real token"),
            rows,
        ),
        capsys,
    )
    benchmark.extra_info.update({f"{k} real tokens/s": round(v) for k, v in real_rate.items()})
    benchmark.pedantic(lambda: consume(packed_loader(corpus.path, num_workers=WORKERS)), rounds=1)


# -- 4. training tokens/s --------------------------------------------------------------------


class TokenMLP(nn.Module):
    """A next-token model whose cost is proportional to rows × width: an embedding, two
    residual per-token MLP blocks and an output layer (about 0.03 MFLOP per token forward, so
    that a step of 16,384 tokens takes a fraction of a second on this 2-core machine)."""

    VOCAB = 256

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(2)
        )
        self.head = nn.Linear(dim, self.VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids % self.VOCAB)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class TrainStep:
    """Forward, backward and an Adam step on one batch; the loss is next-token cross entropy
    over the real tokens (packed: ``labels``, which ignore padding and each document's first
    token; padded: the ids where the mask is set)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TokenMLP()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def __call__(self, batch: dict[str, torch.Tensor]) -> float:
        ids = batch["tokens"]
        if "labels" in batch:
            labels = batch["labels"] % TokenMLP.VOCAB
            labels[batch["labels"] < 0] = -100
        else:
            labels = torch.where(batch["attention_mask"], ids % TokenMLP.VOCAB, -100)
        logits = self.model(ids)
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, TokenMLP.VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def train(loader: Iterable[Any], batches: int) -> tuple[float, int, int]:
    """Seconds, real tokens and rows × width of ``batches`` training steps (the first batch,
    start-up, is fetched before the clock starts)."""
    step = TrainStep()
    it = iter(loader)
    first = next(it)
    real = total = 0
    # One thread: the step leaves the other core to the workers instead of fighting them for
    # it, which made the rates of one configuration vary threefold between runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for batch in itertools.chain([first], itertools.islice(it, batches - 1)):
            loss = step(batch)
            assert np.isfinite(loss)
            real += int(torch.count_nonzero(batch["tokens"]))
            total += batch["tokens"].numel()
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    del it, first
    return seconds, real, total


def test_training_tokens_per_second_packed_grouped_random(
    corpus: Corpus, size: Size, bench_size: str, benchmark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = f"random batches of {ROWS}, PadCollate (baseline)"
    makers = {
        baseline: random_loader,
        "length-grouped padding, max_tokens=16384": grouped_loader,
        f"packed, pack_length={SEQ_LEN}, batch_size={ROWS}": packed_loader,
    }
    runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in makers}
    for round_number in range(size.train_rounds):
        shift = round_number % len(makers)
        names = list(makers)
        for name in names[shift:] + names[:shift]:
            loader = makers[name](corpus.path, num_workers=WORKERS)
            runs[name].append(train(loader, size.train_batches))
            del loader
    real_rate = {n: float(np.median([r / s for s, r, _ in v])) for n, v in runs.items()}
    total_rate = {n: float(np.median([t / s for s, _, t in v])) for n, v in runs.items()}
    share = {n: float(np.median([r / t for _, r, t in v])) for n, v in runs.items()}
    # Ratios taken round by round, then the median: the host's speed drifts between rounds.
    paired = {
        n: float(np.median([(r / s) / (rb / sb) for (s, r, _), (sb, rb, _) in
                            zip(v, runs[baseline], strict=True)]))
        for n, v in runs.items()
    }
    rows = [
        (
            name,
            f"{real_rate[name]:,.0f}",
            f"{real_rate[name] / real_rate[baseline]:.2f}x",
            f"{paired[name]:.2f}x",
            f"{total_rate[name]:,.0f}",
            f"{share[name]:.3f}",
        )
        for name in makers
    ]
    report(
        f"packing-train-{bench_size}",
        {"real_tokens_per_s": real_rate, "total_tokens_per_s": total_rate, "real_share": share,
         "paired": paired, "batches": size.train_batches, "rounds": size.train_rounds},
        table(
            f"training a per-token model on the CPU, {size.train_batches} steps, {WORKERS} "
            f"workers, median of {size.train_rounds}",
            ("batches", "real tokens trained/s", "vs random", "per round", "rows x width /s",
             "real / width"),
            rows,
        ),
        capsys,
    )
    benchmark.extra_info.update({f"{k} real tokens/s": round(v) for k, v in real_rate.items()})
    benchmark.pedantic(
        lambda: train(packed_loader(corpus.path, num_workers=0), 1), rounds=1, iterations=1
    )
    # Packing trains on real tokens only, where random batches spend most of theirs on padding.
    # Checked on the batches, not the clock: which trains faster is what the table measures (a
    # smoke run's three steps are a timing race on a shared host).
    assert share[f"packed, pack_length={SEQ_LEN}, batch_size={ROWS}"] > 0.99 > 0.5 > share[baseline]


if __name__ == "__main__":
    # As a script: the same run, tables printed (e.g. ``--size full``).
    sys.exit(pytest.main([__file__, "-s", "-p", "no:cacheprovider", *sys.argv[1:]]))
