"""The conversion, start to end: discover inputs, fix the fields, stream chunks through the
encoders into the spool writer, write the shards, publish them atomically.

A sharded output (``--shard-size``) also gets ``fastload-index.json`` beside its shards, naming
this run's shards only and renamed into place after them; a single-file output gets none (a
single file needs no index to be planned; ``fastload index`` indexes a folder of them).

User errors surface as FastloadError subclasses (UsageError, DataFormatError) or as the OSError
that fits (FileNotFoundError, FileExistsError, PermissionError), each with a one-line message;
the command-line layer prints them without a traceback.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import fastload
from fastload._apps._convert._convert_options import ConvertOptions
from fastload._apps._convert._crash_safe import TempArea, remove_stale_temps
from fastload._apps._convert._discover import ARRAY_FORMATS, InputFile, discover
from fastload._apps._convert._encode import (
    ChunkEncoder,
    EncodePlan,
    WordCounter,
    apply_length_limits,
)
from fastload._apps._convert._engines import Engine, open_engine
from fastload._apps._convert._inputs import ReadOptions, record_chunks
from fastload._apps._convert._model import ChunkStats, Encoded
from fastload._apps._convert._numpy_inputs import numpy_blocks, plan_numpy
from fastload._apps._convert._plans import infer_plans
from fastload._apps._convert._progress import Progress
from fastload._apps._convert._tokenize import (
    build_vocab,
    describe,
    make_tokenizer,
    parse_tokenizer,
    write_vocab,
)
from fastload._apps._convert._writer import OutputField, SpoolWriter, smallest_int_dtype
from fastload._formats._indexing import index_of, write_index
from fastload._remote import INDEX_NAME
from fastload.errors import DataFormatError, UsageError

#: Most bytes of file names recorded in the ``source`` attribute (HDF5 keeps attributes small).
SOURCE_NAMES_BYTES = 32 << 10


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def shard_path(dest: Path, index: int) -> Path:
    return dest.with_name(f"{dest.stem}-{index:05d}{dest.suffix}")


def vocab_path(dest: Path) -> Path:
    return dest.with_name(f"{dest.stem}.vocab.txt")


def index_path(dest: Path) -> Path:
    """Where a sharded output's index goes: beside its shards."""
    return dest.with_name(INDEX_NAME)


def existing_shards(dest: Path) -> list[Path]:
    """Shard files of ``dest`` already on disk (``OUT-00000.h5``...)."""
    pattern = re.compile(rf"{re.escape(dest.stem)}-(\d{{5,}}){re.escape(dest.suffix)}")
    return sorted(p for p in dest.parent.iterdir() if pattern.fullmatch(p.name))


@dataclass
class ConvertReport:
    """What a conversion did; ``tokens`` counts the primary field's elements."""

    outputs: tuple[Path, ...]
    vocab_file: Path | None
    samples: int
    tokens: int
    input_bytes: int
    output_bytes: int
    seconds: float
    stats: ChunkStats
    ignored_files: int
    removed_temps: tuple[Path, ...] = ()
    index_file: Path | None = None
    dtypes: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """The one-line summary: samples, tokens, bytes, seconds."""
        if len(self.outputs) == 1:
            target = str(self.outputs[0])
        else:
            target = f"{len(self.outputs)} shards {self.outputs[0]} .. {self.outputs[-1].name}"
        rate = self.input_bytes / max(self.seconds, 1e-9)
        return (
            f"wrote {target}: {self.samples:,} samples, {self.tokens:,} tokens, "
            f"{human_bytes(self.input_bytes)} read, {human_bytes(self.output_bytes)} written, "
            f"{self.seconds:.2f} s ({human_bytes(rate)}/s)"
        )

    def notes(self) -> list[str]:
        """One line per thing the user should know: skipped, dropped, truncated, ignored."""
        s = self.stats
        lines = [
            f"skipped {count:,} record{'s' if count > 1 else ''}: {reason} (first: {s.first_skip[reason]})"
            for reason, count in sorted(s.skipped.items())
        ]
        if s.dropped_empty:
            lines.append(
                f"dropped {s.dropped_empty:,} empty samples (blank lines or no tokens; "
                "--min-length 0 keeps them)"
            )
        if s.dropped_short:
            lines.append(f"dropped {s.dropped_short:,} samples shorter than --min-length")
        if s.dropped_long:
            lines.append(f"dropped {s.dropped_long:,} samples longer than --max-length")
        if s.truncated:
            lines.append(f"truncated {s.truncated:,} samples to --max-length")
        if self.vocab_file is not None:
            lines.append(f"vocabulary written to {self.vocab_file}")
        if self.index_file is not None:
            lines.append(f"index written to {self.index_file}")
        if self.ignored_files:
            lines.append(
                f"ignored {self.ignored_files:,} files with unknown extensions in input folders (--format reads them)"
            )
        if self.removed_temps:
            lines.append(
                f"removed {len(self.removed_temps)} temporary folder(s) left by an interrupted run"
            )
        return lines


def _check_destination(options: ConvertOptions, *, vocab: bool) -> tuple[Path, ...]:
    """Fail early if the output cannot be written; returns the existing files it replaces."""
    dest = options.output
    if dest.is_dir():
        raise UsageError(f"-o {dest} is a folder; give a file name, e.g. {dest / 'data.h5'}")
    parent = dest.parent
    if not parent.exists():
        raise FileNotFoundError(f"output folder does not exist: {parent}")
    if not parent.is_dir():
        raise NotADirectoryError(f"output folder is not a folder: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"output folder is not writable: {parent}")
    existing = (
        existing_shards(dest)
        if options.shard_size is not None
        else ([dest] if dest.exists() else [])
    )
    if options.shard_size is not None and index_path(dest).exists():
        existing.append(index_path(dest))
    if vocab and vocab_path(dest).exists():
        existing.append(vocab_path(dest))
    if existing and not options.overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise FileExistsError(f"{existing[0]} exists{more}; pass --overwrite to replace it")
    return tuple(existing)


def _source_attr(options: ConvertOptions, files: tuple[InputFile, ...]) -> str:
    names: list[str] = []
    size = 0
    for f in files:
        size += len(f.display) + 4
        if size > SOURCE_NAMES_BYTES:
            break
        names.append(f.display)
    return json.dumps({"inputs": list(options.inputs), "files": names, "num_files": len(files)})


def _record_fields(
    plan: EncodePlan, vocab_size: int | None, override: np.dtype | None
) -> list[OutputField]:
    fields = []
    for p in plan.fields:
        if p.kind == "scalar":
            fields.append(OutputField(p.name, "fixed", np.dtype(np.float64), numbers=True))
            continue
        known = vocab_size if p.kind == "text" else None
        spool = override or (
            smallest_int_dtype(0, known - 1) if known is not None else np.dtype(np.int64)
        )
        fields.append(OutputField(p.name, "ragged", spool, vocab_size=known))
    return fields


@dataclass
class _Run:
    """The state of one conversion between reading and publishing."""

    options: ConvertOptions
    files: tuple[InputFile, ...]
    area: TempArea
    engine: Engine
    stats: ChunkStats = field(default_factory=ChunkStats)
    tokenizer: dict[str, object] = field(default_factory=lambda: {"kind": "none"})
    vocab: Path | None = None
    vocab_sha256: str = ""
    writer: SpoolWriter | None = None

    def progress(self, description: str) -> Progress:
        total = sum(f.size for f in self.files)
        return Progress(description=description, total_bytes=total, enabled=self.options.progress)

    def read_options(self) -> ReadOptions:
        o = self.options
        return ReadOptions(block_bytes=o.block_bytes, per_file=o.per_file, errors=o.errors)

    def pump(self, blocks: Iterator[Encoded], writer: SpoolWriter) -> None:
        self.writer = writer
        with self.progress("converting") as bar:
            for encoded in blocks:
                self.stats.merge(encoded.stats)
                writer.append(encoded)
                bar.advance(
                    input_bytes=encoded.stats.input_bytes,
                    records=encoded.stats.records,
                    status=self.engine.status(),
                )

    def records(self) -> SpoolWriter:
        o = self.options
        if o.offsets:
            raise UsageError("--offsets applies to .npy/.npz inputs only")
        spec = parse_tokenizer(o.tokenizer, errors=o.errors, special_tokens=o.special_tokens)
        if spec.kind in ("hf", "callable"):
            make_tokenizer(spec)  # fail on an unloadable tokenizer before reading anything
        read = self.read_options()
        plans = infer_plans(self.files, o, read)
        plan = EncodePlan(plans, spec, o.on_error, o.errors, o.min_length, o.max_length, o.overlong)
        texts = any(p.kind == "text" for p in plans)
        if texts and spec.kind == "whitespace":
            plan = replace(plan, tokenizer=replace(spec, vocab=self._vocabulary(plan, read)))
        vocab_size = make_tokenizer(plan.tokenizer).vocab_size if texts else None
        if texts:
            self.tokenizer = describe(plan.tokenizer, vocab_size)
            if self.vocab is not None:
                self.tokenizer |= {
                    "vocab_file": vocab_path(o.output).name,
                    "vocab_sha256": self.vocab_sha256,
                }
        fields = _record_fields(plan, vocab_size, o.dtype_override)
        writer = SpoolWriter(
            self.area.path,
            fields,
            primary=plan.primary,
            shard_size=o.shard_size,
            dtype_override=o.dtype_override,
        )
        chunks = record_chunks(self.files, plans, read)
        self.pump(self.engine.map(ChunkEncoder, plan, chunks), writer)
        return writer

    def _vocabulary(self, plan: EncodePlan, read: ReadOptions) -> tuple[str, ...]:
        counts: Counter[str] = Counter()
        with self.progress("counting words") as bar:
            chunks = record_chunks(self.files, plan.fields, read)
            for chunk_counts, input_bytes in self.engine.map(WordCounter, plan, chunks):
                counts.update(chunk_counts)
                bar.advance(input_bytes=input_bytes, records=0, status=self.engine.status())
        words = build_vocab(
            counts, min_count=self.options.min_count, max_vocab=self.options.max_vocab
        )
        self.vocab = self.area.path / vocab_path(self.options.output).name
        self.vocab_sha256 = write_vocab(self.vocab, words)
        return words

    def arrays(self) -> SpoolWriter:
        o = self.options
        misplaced = [
            flag
            for flag, used in (
                ("--label-field", o.label_fields),
                ("--per-file", o.per_file),
                ("--tokenizer", o.tokenizer != "bytes"),
            )
            if used
        ]
        if misplaced:
            raise UsageError(
                f"{misplaced[0]} does not apply to .npy/.npz inputs (arrays are stored as they are)"
            )
        plan = plan_numpy(self.files, fields=o.fields, offsets=o.offsets)
        writer = SpoolWriter(
            self.area.path,
            list(plan.fields),
            primary=plan.primary,
            shard_size=o.shard_size,
            dtype_override=o.dtype_override,
        )

        def limited() -> Iterator[Encoded]:
            for encoded in numpy_blocks(plan, block_bytes=o.block_bytes, on_error=o.on_error):
                if encoded.num_samples:
                    apply_length_limits(
                        encoded,
                        plan.primary,
                        min_length=o.min_length,
                        max_length=o.max_length,
                        overlong=o.overlong,
                    )
                yield encoded

        self.pump(limited(), writer)
        return writer


def convert(options: ConvertOptions) -> ConvertReport:
    """Convert ``options.inputs`` into ``options.output`` (or its shards); see the module doc."""
    started = time.monotonic()
    found = discover(options.inputs, options.format)
    files = found.files
    replaced = _check_destination(options, vocab=options.tokenizer == "whitespace")
    removed = tuple(remove_stale_temps(options.output))
    with TempArea(options.output) as area, open_engine(options) as engine:
        run = _Run(options, files, area, engine)
        try:
            writer = run.arrays() if files[0].format in ARRAY_FORMATS else run.records()
        finally:
            if run.writer is not None:
                run.writer.close()
        samples = sum(s.num_samples for s in writer.shards)
        if samples == 0:
            s = run.stats
            raise DataFormatError(
                f"no samples to write: {s.records:,} records read, {sum(s.skipped.values()):,} skipped, "
                f"{s.dropped_empty:,} empty, "
                f"{s.dropped_short + s.dropped_long:,} dropped by --min-length/--max-length"
            )
        dest = options.output
        finals = (
            [shard_path(dest, i) for i in range(len(writer.shards))]
            if options.shard_size is not None
            else [dest]
        )
        temporaries = [area.path / p.name for p in finals]
        attrs = {
            "fastload_version": fastload.__version__,
            "source": _source_attr(options, files),
            "tokenizer": json.dumps(run.tokenizer),
            "options": json.dumps(options.recorded()),
            "counts": json.dumps(_counts(run.stats, samples)),
        }
        shard_counts = writer.finish(
            temporaries, attrs, compression=options.compression, run=engine.write_shards
        )
        published = [(t, f) for t, f in zip(temporaries, finals, strict=True)]
        if run.vocab is not None:
            published.insert(0, (run.vocab, vocab_path(dest)))  # before the data that refers to it
        if options.shard_size is not None:
            # Renamed last, so that no index ever names a shard not yet in place; built from
            # the temporaries, so it names this run's shards only, by their final names.
            index = index_of(area.path, "hdf5", temporaries)
            published.append((write_index(area.path, index), index_path(dest)))
        kept = {f for _, f in published} | {vocab_path(dest)}
        area.commit(published, obsolete=[p for p in replaced if p not in kept])
    primary = writer.primary
    return ConvertReport(
        outputs=tuple(finals),
        vocab_file=vocab_path(dest) if run.vocab is not None else None,
        samples=samples,
        tokens=sum(c.tokens.get(primary, 0) for c in shard_counts) if primary else 0,
        input_bytes=sum(f.size for f in files),
        output_bytes=sum(p.stat().st_size for p in finals),
        seconds=time.monotonic() - started,
        stats=run.stats,
        ignored_files=found.ignored,
        removed_temps=removed,
        dtypes={f.name: str(writer.stored_dtype(f)) for f in writer.fields},
        index_file=index_path(dest) if options.shard_size is not None else None,
    )


def _counts(stats: ChunkStats, samples: int) -> dict[str, object]:
    return {
        "records_read": stats.records,
        "samples_written": samples,
        "skipped": dict(sorted(stats.skipped.items())),
        "dropped_empty": stats.dropped_empty,
        "dropped_shorter_than_min_length": stats.dropped_short,
        "dropped_longer_than_max_length": stats.dropped_long,
        "truncated_to_max_length": stats.truncated,
    }
