"""``fastload inspect PATH``: what a fastload HDF5 file holds, how its lengths are spread, how
much padding batches would carry (and, with ``--pack N``, how full packed rows of ``N`` tokens
would be), and whether the layout is valid.

The cheap checks (always run) read attributes, shapes, dtypes and the first and last offsets.
``--verify`` also reads every offset and length, and every token id where the vocabulary is
recorded, in blocks of :data:`VERIFY_ROWS`, so memory stays bounded whatever the file size.

Any other PATH the readers take (a folder of shards, Arrow IPC files and streams, Feather,
Parquet, a Hugging Face ``save_to_disk`` folder) is opened with its reader, which checks what it
checks at construction; HDF5 shards in the fastload layout get the cheap checks above too, and
``--verify`` reads every sample through the reader.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import h5py
import numpy as np
import numpy.typing as npt

import fastload
from fastload._apps._convert._convert_options import LENGTHS_NAME
from fastload.errors import DataFileNotFoundError, DataFormatError, UsageError

#: Elements read per step by ``--verify``.
VERIFY_ROWS = 1 << 20
#: Width of the histogram's longest bar, in characters.
BAR_WIDTH = 40
HDF5_SUFFIXES = (".h5", ".hdf5")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".parquet")


@dataclass
class Layout:
    """The fields found in a file; ``problems`` lists what breaks the layout."""

    samples: int
    ragged: dict[str, h5py.Group] = field(default_factory=dict)
    fixed: dict[str, h5py.Dataset] = field(default_factory=dict)
    lengths: h5py.Dataset | None = None
    primary: str | None = None
    problems: list[str] = field(default_factory=list)


def _storage(dataset: h5py.Dataset) -> str:
    if dataset.compression:
        return f"{dataset.compression}, chunked"
    return "chunked" if dataset.chunks else "contiguous"


def _check_ragged(name: str, group: h5py.Group, samples: int, problems: list[str]) -> None:
    values, offsets = group.get("values"), group.get("offsets")
    if not isinstance(values, h5py.Dataset) or not isinstance(offsets, h5py.Dataset):
        problems.append(f"/{name}: a ragged field needs datasets 'values' and 'offsets'")
        return
    if values.ndim != 1 or values.dtype.kind not in "iuf":
        problems.append(
            f"/{name}/values: expected a 1-D numeric array, got {values.dtype} {values.shape}"
        )
    if offsets.dtype != np.int64 or offsets.shape != (samples + 1,):
        problems.append(
            f"/{name}/offsets: expected int64 [{samples + 1}], got {offsets.dtype} {offsets.shape}"
        )
        return
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        problems.append(f"/{name}/offsets: offsets[0] is {first}, expected 0")
    if last != values.shape[0]:
        problems.append(
            f"/{name}/offsets: the last offset is {last} but values has {values.shape[0]} elements"
        )


def read_layout(f: h5py.File) -> Layout:
    """The structure of ``f`` and its problems, from metadata and two offsets per field."""
    attrs = f.attrs
    problems = []
    if attrs.get("fastload_format") != 1:
        problems.append(
            f"root attribute fastload_format is {attrs.get('fastload_format')!r}, expected 1"
        )
    samples = attrs.get("num_samples")
    if samples is None or not np.issubdtype(type(samples), np.integer) or int(samples) < 0:
        problems.append(f"root attribute num_samples is {samples!r}, expected a count")
        samples = f[LENGTHS_NAME].shape[0] if isinstance(f.get(LENGTHS_NAME), h5py.Dataset) else 0
    layout = Layout(int(samples), problems=problems)
    for name, item in f.items():
        if name == LENGTHS_NAME:
            continue
        if isinstance(item, h5py.Group):
            layout.ragged[name] = item
            _check_ragged(name, item, layout.samples, problems)
        elif item.ndim == 0 or item.shape[0] != layout.samples:
            problems.append(f"/{name}: expected {layout.samples} rows, got shape {item.shape}")
        else:
            layout.fixed[name] = item
    lengths = f.get(LENGTHS_NAME)
    layout.primary = next(iter(layout.ragged), None)
    if isinstance(lengths, h5py.Dataset):
        layout.lengths = lengths
        named = lengths.attrs.get("field")
        if named is not None:
            layout.primary = named.decode() if isinstance(named, bytes) else str(named)
        if lengths.dtype != np.int64 or lengths.shape != (layout.samples,):
            problems.append(
                f"/lengths: expected int64 [{layout.samples}], got {lengths.dtype} {lengths.shape}"
            )
    elif layout.ragged:
        problems.append("/lengths is missing (the loader groups batches by it)")
    if layout.primary is not None and layout.primary not in layout.ragged:
        problems.append(f"/lengths describes {layout.primary!r}, which is not a ragged field")
    return layout


def _blocks(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, VERIFY_ROWS):
        yield start, min(n, start + VERIFY_ROWS)


def _verify_offsets(
    name: str, group: h5py.Group, lengths: h5py.Dataset | None, problems: list[str]
) -> None:
    offsets = group["offsets"]
    previous = int(offsets[0])
    for start, stop in _blocks(offsets.shape[0] - 1):
        ends = offsets[start + 1 : stop + 1]
        steps = np.diff(ends, prepend=previous)
        if (steps < 0).any():
            problems.append(
                f"/{name}/offsets: decreasing at sample {start + int(np.argmax(steps < 0))}"
            )
            return
        if lengths is not None:
            stored = lengths[start:stop]
            if not np.array_equal(stored, steps):
                bad = start + int(np.argmax(stored != steps))
                problems.append(
                    f"/lengths[{bad}] is {stored[bad - start]} but /{name}/offsets gives {steps[bad - start]}"
                )
                return
        previous = int(ends[-1])


def _verify_ids(f: h5py.File, layout: Layout, problems: list[str]) -> None:
    """Token ids within the recorded vocabulary; the vocabulary file unchanged."""
    tokenizer = json.loads(f.attrs.get("tokenizer", "{}"))
    vocab_size = tokenizer.get("vocab_size")
    if layout.primary is None or vocab_size is None:
        return
    values = layout.ragged[layout.primary]["values"]
    for start, stop in _blocks(values.shape[0]):
        block = values[start:stop]
        if block.size and (block.min() < 0 or block.max() >= vocab_size):
            problems.append(
                f"/{layout.primary}/values: ids outside the vocabulary of {vocab_size} near element {start}"
            )
            return
    vocab_file = tokenizer.get("vocab_file")
    if vocab_file:
        path = Path(f.filename).with_name(vocab_file)
        if not path.is_file():
            problems.append(f"vocabulary file {path} is missing")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != tokenizer.get("vocab_sha256"):
            problems.append(
                f"vocabulary file {path} does not match the one this file was written with"
            )


def check_fully(f: h5py.File, layout: Layout) -> list[str]:
    """Full checks, in bounded memory; returns the problems found."""
    problems: list[str] = []
    for name, group in layout.ragged.items():
        _verify_offsets(name, group, layout.lengths if name == layout.primary else None, problems)
    if not problems:
        _verify_ids(f, layout, problems)
    return problems


def length_stats(lengths: npt.NDArray[np.int64]) -> dict[str, float]:
    q = np.percentile(lengths, [50, 90, 99])
    return {
        "min": float(lengths.min()),
        "median": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": float(lengths.max()),
        "mean": float(lengths.mean()),
    }


def histogram(lengths: npt.NDArray[np.int64]) -> list[str]:
    """Counts in power-of-two bins ([0,1), [1,2), [2,4), ...), one text bar each, from the
    first non-empty bin to the last."""
    bins = np.zeros(int(lengths.max()).bit_length() + 1, dtype=np.int64)
    np.add.at(
        bins,
        np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + 1, 0),
        1,
    )
    peak = int(bins.max())
    used = np.flatnonzero(bins)
    lines = []
    for b in range(int(used[0]), int(used[-1]) + 1):
        count = int(bins[b])
        low, high = (0, 1) if b == 0 else (1 << (b - 1), 1 << b)
        bar = "#" * max(1 if count else 0, round(BAR_WIDTH * count / peak))
        lines.append(f"  [{low:>7,}, {high:>7,})  {count:>10,}  {bar}")
    return lines


def padding_efficiency(
    lengths: npt.NDArray[np.int64], batches: list[npt.NDArray[np.int64]]
) -> float:
    """Real tokens / padded tokens when every batch is padded to its longest sample."""
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(int(lengths[b].max()) * len(b) for b in batches if len(b))
    return real / padded if padded else 1.0


def random_batches(n: int, batch_size: int) -> list[npt.NDArray[np.int64]]:
    order = np.random.default_rng(0).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def grouped_batches(lengths: npt.NDArray[np.int64], batch_size: int) -> list[npt.NDArray[np.int64]]:
    """The batches fastload's length-grouped sampler makes for one epoch (seed 0, one rank)."""
    sampler = fastload.LengthGroupedBatchSampler(
        lengths, batch_size=batch_size, seed=0, num_replicas=1, rank=0
    )
    return [np.asarray(b, dtype=np.int64) for b in sampler]


def packing_efficiency(lengths: npt.NDArray[np.int64], seq_len: int, rows: int) -> float:
    """Real tokens / rows × ``seq_len`` of one epoch of fastload's packed batches (seed 0, one
    rank, the default window; samples longer than ``seq_len`` split)."""
    sampler = fastload.PackedBatchSampler(
        lengths, seq_len=seq_len, rows=rows, seed=0, num_replicas=1, rank=0
    )
    return sampler.efficiency()


def _describe_fields(layout: Layout) -> list[str]:
    lines = ["fields:"]
    for name, group in layout.ragged.items():
        values = group["values"]
        mark = "  (primary: /lengths)" if name == layout.primary else ""
        lines.append(
            f"  {name:<20} ragged  {values.dtype!s:<8} {values.shape[0]:>14,} values  {_storage(values)}{mark}"
        )
    for name, dataset in layout.fixed.items():
        shape = "x".join(map(str, dataset.shape[1:])) or "scalar"
        lines.append(
            f"  {name:<20} fixed   {dataset.dtype!s:<8} {shape:>14} per sample  {_storage(dataset)}"
        )
    return lines


def _print_lengths(
    lengths: npt.NDArray[np.int64],
    primary: str | None,
    batch_size: int,
    pack: int | None,
    write: Callable[[str], None],
) -> None:
    stats = "  ".join(
        f"{k} {v:,.1f}" if k == "mean" else f"{k} {v:,.0f}"
        for k, v in length_stats(lengths).items()
    )
    write(f"lengths of {primary}: {stats}  total {int(lengths.sum()):,}")
    write("length histogram (samples per power-of-two bin):")
    for line in histogram(lengths):
        write(line)
    write(f"padding efficiency at batch size {batch_size} (real tokens / padded tokens):")
    shuffled = padding_efficiency(lengths, random_batches(lengths.shape[0], batch_size))
    write(f"  random batches          {shuffled:7.1%}")
    grouped = grouped_batches(lengths, batch_size)
    if grouped is None:
        write(
            "  length-grouped batches  not computed: this fastload has no LengthGroupedBatchSampler"
        )
    else:
        write(f"  length-grouped batches  {padding_efficiency(lengths, grouped):7.1%}")
    if pack is not None:
        longer = int(np.count_nonzero(lengths > pack))
        write(
            f"packing efficiency at seq_len {pack:,}, {batch_size} rows a batch (real tokens / "
            "rows x seq_len):"
        )
        note = f"  ({longer:,} samples longer than {pack:,} split)" if longer else ""
        write(f"  packed batches          {packing_efficiency(lengths, pack, batch_size):7.1%}{note}")


def run_inspect(
    path: Path, *, batch_size: int, verify: bool, out: TextIO, pack: int | None = None
) -> int:
    """Print the report to ``out``; returns 0 for a valid file and 1 for an invalid one.
    ``pack``: also the packing efficiency at that ``seq_len``, ``batch_size`` rows a batch."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if pack is not None and pack < 1:
        raise UsageError(f"--pack must be >= 1 (tokens per packed row), got {pack}")
    if not path.exists():
        raise DataFileNotFoundError(f"{path}: no such file or directory", path)

    def write(line: str) -> None:
        print(line, file=out)

    if path.is_dir() or (path.suffix.lower() not in HDF5_SUFFIXES and not h5py.is_hdf5(path)):
        return _inspect_with_reader(path, batch_size, verify, pack, write)
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataFormatError(f"{path}: not an HDF5 file ({exc})") from exc
    if "fastload_format" not in f.attrs:
        f.close()  # plain HDF5 arrays, which HDF5Dataset reads too: its reader describes them
        return _inspect_with_reader(path, batch_size, verify, pack, write)

    with f:
        layout = read_layout(f)
        size_mb = path.stat().st_size / 1e6
        write(
            f"{path}: fastload format {f.attrs.get('fastload_format')}, {layout.samples:,} samples, {size_mb:,.1f} MB"
        )
        if "num_shards" in f.attrs:
            write(f"shard {int(f.attrs['shard_index'])} of {int(f.attrs['num_shards'])} (0-based)")
        for line in _describe_fields(layout):
            write(line)
        for key in ("tokenizer", "source"):
            if key in f.attrs:
                write(f"{key}: {f.attrs[key]}")
        if layout.lengths is not None and layout.samples and not layout.problems:
            _print_lengths(layout.lengths[:], layout.primary, batch_size, pack, write)
        problems = list(layout.problems)
        if verify and not problems:
            problems += check_fully(f, layout)
    scope = (
        "every offset, length and id checked"
        if verify
        else "structure checked; --verify checks every offset"
    )
    return _verdict(problems, scope, write)


def _verdict(problems: list[str], scope: str, write: Callable[[str], None]) -> int:
    if problems:
        write(f"verdict: INVALID ({len(problems)} problem(s))")
        for problem in problems:
            write(f"  - {problem}")
        return 1
    write(f"verdict: OK ({scope})")
    return 0


def open_reader(path: Path) -> Any:
    """The reader a loader would use for ``path``: ``HDF5Dataset`` for HDF5 files or a folder
    holding some, ``ArrowDataset`` for Arrow IPC files and streams, Feather, Parquet and any
    other folder; a :class:`UsageError` for another kind of file."""
    if path.is_dir():
        if any(p.suffix.lower() in HDF5_SUFFIXES for p in path.iterdir()):
            return fastload.HDF5Dataset(path)
        return fastload.ArrowDataset(path)
    if path.suffix.lower() in ARROW_SUFFIXES:
        return fastload.ArrowDataset(path)
    if h5py.is_hdf5(path):
        return fastload.HDF5Dataset(path)
    raise UsageError(
        f"{path}: unknown file type {path.suffix or '(no extension)'}; fastload inspect takes "
        f"{', '.join(HDF5_SUFFIXES + ARROW_SUFFIXES)} files and folders of them"
    )


def _inspect_with_reader(
    path: Path, batch_size: int, verify: bool, pack: int | None, write: Callable[[str], None]
) -> int:
    """The report for a folder or a non-HDF5 file, from the reader that would load it."""
    dataset = open_reader(path)
    try:
        files = dataset.files
        size_mb = sum(Path(f).stat().st_size for f in files) / 1e6
        write(
            f"{path}: {type(dataset).__name__}, {len(dataset):,} samples in {len(files):,} "
            f"file(s), {size_mb:,.1f} MB"
        )
        write("fields:")
        for name, spec in dataset.fields.items():
            shape = "x".join(map(str, spec.shape)) or "scalar"
            mark = "  (primary: lengths)" if name == dataset.length_field else ""
            write(f"  {name:<20} {spec.kind:<7} {spec.dtype!s:<8} {shape:>14}{mark}")
        problems = _shard_problems(files, verify) if isinstance(dataset, fastload.HDF5Dataset) else []
        if verify and not problems:
            problems += _read_every_sample(dataset)
        if dataset.length_field is not None and len(dataset) and not problems:
            lengths = np.asarray(dataset.lengths, dtype=np.int64)
            _print_lengths(lengths, dataset.length_field, batch_size, pack, write)
    finally:
        dataset.close()
    scope = "every sample read" if verify else "opened by its reader; --verify reads every sample"
    return _verdict(problems, scope, write)


def _shard_problems(files: list[str], verify: bool) -> list[str]:
    """The cheap (and with ``verify`` the full) layout checks of each HDF5 shard in the
    fastload layout, each problem prefixed with its file."""
    problems: list[str] = []
    for file in files:
        with h5py.File(file, "r") as f:
            if "fastload_format" not in f.attrs:
                continue  # plain HDF5 arrays: the reader's own checks are all there are
            layout = read_layout(f)
            found = list(layout.problems)
            if verify and not found:
                found = check_fully(f, layout)
        problems += [f"{file}: {problem}" for problem in found]
    return problems


def _read_every_sample(dataset: Any) -> list[str]:
    """Read every sample through the reader, in blocks; the first error as a problem."""
    step = max(1, VERIFY_ROWS // 64)
    for start in range(0, len(dataset), step):
        try:
            dataset.read_batch(np.arange(start, min(len(dataset), start + step)))
        except DataFormatError as exc:
            return [f"samples {start:,} to {min(len(dataset), start + step) - 1:,}: {exc}"]
    return []
