"""``fastload bench DATA``: how fast does fastload feed a training step on this machine and
this data, with how many workers, against torch's DataLoader — and what to set.

Exit codes: 0 done; 2 a user error (missing file, bad option or list), in one line without a
traceback; 130 interrupted (from ``fastload.cli.main``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fastload
from fastload._apps._bench._data import BatchPlan, describe, make_plan, open_dataset
from fastload._apps._bench._loop import (
    BenchOptions,
    BenchRow,
    configurations,
    make_collate,
    run_configuration,
)
from fastload._apps._bench._memory import pss_available
from fastload._apps._bench._pagecache import can_evict, evict, resident_bytes
from fastload._apps._bench._report import (
    rate_unit,
    recommend,
    table_header,
    table_row,
    write_results,
)
from fastload._apps._bench._steps import (
    DEVICES,
    SleepStep,
    TinyModelStep,
    model_field,
    resolve_device,
)
from fastload._metrics._autotune import available_cores
from fastload._remote import is_remote
from fastload.errors import FastloadError, UsageError

DESCRIPTION = """\
Run a short training-like loop over DATA for each configuration (num_workers x prefetch_factor
x step) with fastload's DataLoader, and with torch's DataLoader on the same batches as the
baseline; print samples/s, stall % (the share of the loop's time spent waiting for data), p99
wait, time to the first batch and the memory (PSS) of the process tree with its workers; then
recommend the smallest num_workers/prefetch_factor whose stall is under 2 %."""

EPILOG = """\
The step is simulated (--step-ms: a sleep that uses no CPU, like a GPU step) or a real small
model (--model tiny, on the GPU when there is one). Both loaders read the same length-grouped
batch plan and pad with the same PadCollate (with --pack N: the same packed plan, rows of N
tokens, built by the same PackCollate); torch's DataLoader reads each batch with the dataset's
__getitems__. The first batch of each run is start-up and is not in the stall.

examples:
  fastload bench corpus.h5
  fastload bench corpus.h5 --workers 1,2,4,8 --step-ms 20 --out bench-results
  fastload bench shards/ --max-tokens 16384 --model tiny
  fastload bench corpus.h5 --pack 2048 --batch-size 8    packed rows of 2048 tokens
  fastload bench corpus.h5 --smoke                      a few seconds, to try it out
  fastload bench corpus.h5 --cold --workers 2 --step-ms 10   every run from a cold disk
  fastload bench s3://bucket/corpus/ --storage-option endpoint_override=http://127.0.0.1:9000 \
      --cache-dir /tmp/fl-cache --cache-limit 20GB      a remote corpus through the shard cache"""

#: --smoke: every unset option becomes tiny (explicit options still win).
SMOKE = {"workers": (0, 1), "prefetch": (2,), "step_ms": (1.0,), "batches": 8, "batch_size": 16}
DEFAULT_BATCH_SIZE = 64


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure samples/s and stall for num_workers x prefetch, against torch's DataLoader",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data", metavar="DATA", help=".h5/.hdf5 file, Arrow/Parquet file, or folder")
    parser.add_argument(
        "--workers", metavar="LIST", help="num_workers values (default 0,1,2,4, up to the cores)"
    )
    parser.add_argument("--prefetch", metavar="LIST", help="prefetch_factor values (default 2,4)")
    parser.add_argument("--batch-size", metavar="N", help="rows per batch (default 64)")
    parser.add_argument(
        "--max-tokens", metavar="N", help="batches by token budget (rows * longest row <= N)"
    )
    parser.add_argument(
        "--pack", metavar="N",
        help="packed batches: rows of N tokens (--batch-size rows, or --max-tokens // N)",
    )
    parser.add_argument("--step-ms", metavar="LIST", help="simulated step times (default 2,10,50)")
    parser.add_argument("--model", metavar="tiny", help="train a small real model instead of sleeping")
    parser.add_argument(
        "--device", default="auto", metavar="auto|cpu|cuda",
        help="where batches go and the model runs (default: CUDA when available)",
    )
    parser.add_argument("--batches", metavar="N", help="batches per configuration (default 100)")
    parser.add_argument("--out", metavar="DIR", help="write results.json, results.csv, stall.png")
    parser.add_argument("--smoke", action="store_true", help="everything tiny: a few seconds")
    parser.add_argument(
        "--cold", action="store_true",
        help="before each configuration, evict DATA's files from the page cache (os.sync, then"
        " posix_fadvise DONTNEED: no root needed; pages that other processes map or lock stay,"
        " and the summary says how many) so that every run reads a cold local disk",
    )
    parser.add_argument(
        "--storage-option", metavar="KEY=VALUE", action="append", default=[],
        help="a remote DATA's client option (repeatable), e.g. endpoint_override=http://host:9000;"
        " true/false and numbers are converted",
    )
    parser.add_argument("--cache-dir", metavar="DIR", help="a remote DATA's shard cache directory")
    parser.add_argument(
        "--cache-limit", metavar="SIZE", help="a remote DATA's shard cache limit, e.g. 20GB"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        # Flushed line by line: in a log or a pipe the table still grows as each run ends.
        return bench(args, lambda line: print(line, flush=True))
    except BrokenPipeError:
        raise  # a reader that closed stdout (`| head`): fastload.cli.main ends quietly
    except (FastloadError, OSError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"fastload bench: error: {message}", file=sys.stderr)
        return 2


def options_from_args(args: argparse.Namespace) -> tuple[BenchOptions, int | None, int | None]:
    """The sweep, the batch size (rows, also of packed batches) and the token budget; a
    :class:`UsageError` for a bad value."""
    smoke: dict[str, Any] = SMOKE if args.smoke else {}
    if args.step_ms is not None and args.model is not None:
        raise UsageError("--step-ms and --model are exclusive: a step is either simulated or real")
    default = BenchOptions()
    options = BenchOptions(
        workers=_ints("--workers", args.workers) or smoke.get("workers", default.workers),
        prefetch=_ints("--prefetch", args.prefetch) or smoke.get("prefetch", default.prefetch),
        step_ms=_floats("--step-ms", args.step_ms) or smoke.get("step_ms", default.step_ms),
        model=args.model,
        batches=_int("--batches", args.batches) or smoke.get("batches", default.batches),
    )
    max_tokens = _int("--max-tokens", args.max_tokens)
    batch_size = _int("--batch-size", args.batch_size)
    if batch_size is None and max_tokens is None:
        batch_size = smoke.get("batch_size", DEFAULT_BATCH_SIZE)
    return options, batch_size, max_tokens


def bench(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    options, batch_size, max_tokens = options_from_args(args)
    pack = _int("--pack", args.pack)
    if args.device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}; got {args.device!r}")
    remote = _remote_options(args)
    if args.cold:
        _check_cold(args.data)
    dataset = open_dataset(args.data, remote)
    cold_files: list[str] | None = list(dataset.read_files) if args.cold else None
    plan = make_plan(
        dataset, batches=options.batches, batch_size=batch_size, max_tokens=max_tokens,
        pack_length=pack,
    )
    device = resolve_device(args.device)
    steps: list[tuple[str, Callable[[Any], None]]]
    if options.model is not None:
        name, field = model_field(dataset)
        tiny = TinyModelStep(name, field, device)
        steps = [(tiny.name, tiny)]
    else:
        steps = [(s.name, s) for s in (SleepStep(ms, device) for ms in options.step_ms)]
    collate = make_collate(dataset, plan)
    cores = available_cores()
    unit = rate_unit(plan.pack_length is not None)
    say(_summary(dataset, plan, batch_size, max_tokens, device, cores))
    if args.workers is None and not args.smoke and max(options.workers) > cores:
        # The default list is a sweep, not a request: past the cores only torch's warning
        # about too many workers would be measured.
        options = dataclasses.replace(options, workers=tuple(w for w in options.workers if w <= cores))
        say(f"workers: {','.join(map(str, options.workers))} (the default list, up to the {cores} cores)")
    over = [w for w in options.workers if w > cores]
    if over:
        say(
            f"num_workers={','.join(map(str, over))} exceeds the {cores} cores this process may "
            "use: torch's warning that it may run slowly is silenced for those runs"
        )
    if plan.pack_length is not None:
        say(f"rows/s: packed rows of {plan.pack_length:,} tokens per second, not samples")
    if cold_files is not None:
        say(f"cold: the page cache is emptied of {len(cold_files)} file(s) before each run")
    if not pss_available():
        say("memory not measured: it needs psutil (pip install psutil)")
    say("")
    say(table_header(unit))
    rows: list[BenchRow] = []
    runs = len(steps) * len(configurations(options))
    for step_name, step in steps:
        for loader, workers, prefetch in configurations(options):
            if not sys.stderr.isatty():
                # No terminal to watch the table on (CI, nohup): say what runs now.
                print(
                    f"fastload bench: run {len(rows) + 1} of {runs}: {loader}, num_workers={workers}"
                    f"{'' if prefetch is None else f', prefetch_factor={prefetch}'}, {step_name} step",
                    file=sys.stderr, flush=True,
                )
            if cold_files is not None:
                # A mapped page cannot be evicted: unmap this process's files (a run without
                # workers read through them; the next read maps again) and collect the last
                # run's loader, whose workers may still hold theirs.
                dataset.close()
                gc.collect()
                left = evict_files(cold_files)
                if left:
                    say(f"cold: {left / 1e6:.1f} MB of the files stayed in the page cache")
            with warnings.catch_warnings():
                # Said once above, for every run over the cores, rather than inside the table.
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                row = run_configuration(
                    loader, workers, prefetch, dataset=dataset, plan=plan, collate=collate,
                    step=step, step_name=step_name, device=device, cold=cold_files is not None,
                )
            rows.append(row)
            say(table_row(row))
        say("")
    recommendations = [
        recommend(rows, name, cores=cores, max_workers_tried=max(options.workers), unit=unit)
        for name, _ in steps
    ]
    say("recommendation:")
    for rec in recommendations:
        say(f"  {rec.text}")
    if args.out is not None:
        meta = _meta(args.data, dataset, plan, options, batch_size, max_tokens, device, cores)
        meta["options"]["cold"] = cold_files is not None
        for line in write_results(Path(args.out), rows, recommendations, meta):
            say(line)
    return 0


def _remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reader's keyword arguments for a remote DATA, from the options given."""
    remote: dict[str, Any] = {}
    if args.storage_option:
        remote["storage_options"] = dict(_storage_option(o) for o in args.storage_option)
    if args.cache_dir is not None:
        remote["cache_dir"] = args.cache_dir
    if args.cache_limit is not None:
        remote["cache_limit"] = args.cache_limit
    return remote


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--storage-option: expected KEY=VALUE; got {text!r}")
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return key.strip(), lowered == "true"
    for number in (int, float):
        try:
            return key.strip(), number(value)
        except ValueError:
            pass
    return key.strip(), value


def _check_cold(data: str) -> None:
    """Raise :class:`UsageError` where ``--cold`` cannot evict ``data``'s files."""
    if is_remote(data):
        raise UsageError(
            "--cold evicts local files from the page cache; for a cold remote DATA, give an"
            " empty --cache-dir"
        )
    if not can_evict():
        raise UsageError(f"--cold needs posix_fadvise, which {sys.platform} lacks")


def evict_files(paths: list[str], *, tries: int = 5, pause_s: float = 0.2) -> int:
    """Evict ``paths`` from the page cache; the bytes still resident after (0 where that
    cannot be measured). Tries again while some stay: the last run's workers may still be
    exiting, holding their maps."""
    left = 0
    for attempt in range(tries):
        if attempt:
            time.sleep(pause_s)
        evict(paths)
        left = resident_bytes(paths) or 0
        if not left:
            break
    return left


def _summary(
    dataset: Any, plan: BatchPlan, batch_size: int | None, max_tokens: int | None,
    device: torch.device, cores: int,
) -> str:
    shape = f"up to {max_tokens:,} tokens" if max_tokens is not None else f"{batch_size} rows"
    if max_tokens is not None and batch_size is not None:
        shape += f" and {batch_size} rows"
    padding, packing = plan.padding_efficiency, plan.packing_efficiency
    extra = "" if padding is None else f", padding efficiency {padding * 100:.0f} %"
    if plan.pack_length is not None:
        shape = f"{plan.rows[0]} packed rows of {plan.pack_length:,} tokens"
        extra = "" if packing is None else f", packing efficiency {packing * 100:.1f} %"
    if plan.skipped:
        extra += f", {plan.skipped} samples over the budget skipped"
    return (
        f"fastload bench: {describe(dataset)}, {len(dataset):,} samples; {len(plan)} batches "
        f"of {shape} per run{extra}; device {device}; {cores} cores"
    )


def _meta(
    data: str, dataset: Any, plan: BatchPlan, options: BenchOptions, batch_size: int | None,
    max_tokens: int | None, device: torch.device, cores: int,
) -> dict[str, Any]:
    return {
        "fastload_version": fastload.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "data": data,
        "samples": len(dataset),
        "device": str(device),
        "cores": cores,
        "options": {
            "workers": list(options.workers),
            "prefetch": list(options.prefetch),
            "step_ms": None if options.model else list(options.step_ms),
            "model": options.model,
            "batches": options.batches,
            "batch_size": batch_size,
            "max_tokens": max_tokens,
            "pack_length": plan.pack_length,
        },
        "plan": {
            "batches": len(plan),
            "samples": sum(plan.rows),
            "padding_efficiency": plan.padding_efficiency,
            "packing_efficiency": plan.packing_efficiency,
            "skipped_samples": plan.skipped,
        },
    }


def _int(option: str, text: str | None) -> int | None:
    if text is None:
        return None
    values = _ints(option, text)
    if len(values) != 1:
        raise UsageError(f"{option}: expected one integer; got {text!r}")
    if values[0] < 1:
        raise UsageError(f"{option} must be >= 1; got {values[0]}")
    return values[0]


def _ints(option: str, text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    parts = _parts(option, text)
    try:
        return tuple(sorted({int(part) for part in parts}))
    except ValueError:
        raise UsageError(f"{option}: expected a comma-separated list of integers; got {text!r}") from None


def _floats(option: str, text: str | None) -> tuple[float, ...]:
    if text is None:
        return ()
    parts = _parts(option, text)
    try:
        return tuple(dict.fromkeys(float(part) for part in parts))
    except ValueError:
        raise UsageError(f"{option}: expected a comma-separated list of numbers; got {text!r}") from None


def _parts(option: str, text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise UsageError(f"{option}: empty value in {text!r}; expected e.g. 1,2,4")
    return parts
