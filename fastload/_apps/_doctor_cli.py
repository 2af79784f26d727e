"""``fastload doctor [DATA] [--workers N] [--batch-size B]``: the checks of
``fastload.doctor(loader)`` for a loader over DATA (or, without DATA, the machine alone: kernels,
shared memory, limits, memory). Exit code 0 when nothing needs changing, 1 when a warning or an
error was found, 2 for bad arguments."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine and a dataset before a run: shared memory, limits, memory, "
        "kernels, workers",
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )
    p.add_argument("data", nargs="?", default=None, help="a dataset path or URL (HDF5, Arrow, Parquet, a folder)")
    p.add_argument("--workers", type=int, default=2, help="num_workers of the planned loader (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="batch_size of the planned loader (default 32)")
    p.add_argument("--length-grouped", action="store_true", help="plan length-grouped batches")
    p.set_defaults(func=run)


class _Machine:
    """A loader-shaped plan with no dataset: what ``fastload doctor`` checks without DATA."""

    def __init__(self, workers: int, batch_size: int) -> None:
        self.dataset: Any = None
        self.num_workers = workers
        self.batch_size = batch_size
        self.batch_sampler = None
        self.collate_fn = None
        self.prefetch_factor = 2 if workers else None
        self.multiprocessing_context = None
        self.pin_memory = False
        self.device = None

    def __len__(self) -> int:
        return self.num_workers


def run(args: argparse.Namespace) -> int:
    import fastload
    from fastload._apps._bench._data import open_dataset
    from fastload._doctor import doctor
    from fastload.errors import FastloadError

    if args.workers < 0:
        print(f"fastload doctor: error: --workers must be >= 0; got {args.workers}", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(f"fastload doctor: error: --batch-size must be >= 1; got {args.batch_size}", file=sys.stderr)
        return 2
    loader: Any
    if args.data is None:
        loader = _Machine(args.workers, args.batch_size)
    else:
        try:
            dataset = open_dataset(args.data)
            loader = fastload.DataLoader(
                dataset,
                batch_size=args.batch_size,
                num_workers=args.workers,
                length_grouped=args.length_grouped,
            )
        except (FastloadError, OSError, ValueError) as exc:
            print(f"fastload doctor: error: {exc}", file=sys.stderr)
            return 2
    report = doctor(loader)
    print(report)
    return 0 if report.ok else 1


__all__ = ["add_doctor_parser", "run"]
