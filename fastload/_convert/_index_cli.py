"""``fastload index FOLDER``: write the index of a folder of shards written by another tool (the
converter writes its own)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastload.errors import FastloadError


def add_index_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "index",
        help="write the index of a folder of shards (fastload-index.json)",
        description=(
            "Read every HDF5 or Arrow/Parquet shard under FOLDER (recursively, sorted) as a "
            "dataset would, and write FOLDER/fastload-index.json: the shards, their sample "
            "counts, sizes and SHA-256, and every sample's length. A dataset of the folder, "
            "local or uploaded as it is, then plans epochs from the index alone."
        ),
    )
    parser.add_argument("folder", type=Path, metavar="FOLDER")

    def run(args: argparse.Namespace) -> int:
        from fastload._formats._indexing import build_index, write_index

        try:
            index = build_index(args.folder)
            written = write_index(args.folder, index)
        except (FastloadError, OSError) as exc:
            print(f"fastload index: error: {exc}", file=sys.stderr)
            return 2
        print(
            f"{written}: {len(index.shards)} {index.kind} shards, {index.num_samples:,} samples, "
            f"{index.total_bytes:,} bytes"
        )
        return 0

    parser.set_defaults(func=run)


__all__ = ["add_index_parser"]
