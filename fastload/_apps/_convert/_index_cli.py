"""``fastload index FOLDER|URL``: write the index of a folder of shards written by another tool
(the converter writes its own), on local disk or on object storage (``_remote_index``)."""

from __future__ import annotations

import argparse
import sys

from fastload._apps._convert._cli import add_storage_option_argument
from fastload.errors import FastloadError, UsageError


def add_index_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "index",
        help="write the index of a folder of shards (fastload-index.json), local or s3://, gs://",
        description=(
            "Read every HDF5 or Arrow/Parquet shard under FOLDER (recursively, sorted) as a "
            "dataset would, and write FOLDER/fastload-index.json: the shards, their sample "
            "counts, sizes and SHA-256, and every sample's length. A dataset of the folder, "
            "local or uploaded as it is, then plans epochs from the index alone. FOLDER may be "
            "an s3:// or gs:// URL: it is listed once, each shard downloaded to a temporary "
            "folder, read and deleted in turn (the disk needs room for the largest shard), and "
            "the index written with one PUT."
        ),
    )
    parser.add_argument("folder", metavar="FOLDER")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    add_storage_option_argument(parser)

    def run(args: argparse.Namespace) -> int:
        from fastload._remote import is_remote

        try:
            if is_remote(args.folder):
                from fastload._apps._convert._publish import parse_storage_options, stderr_echo
                from fastload._apps._convert._remote_index import index_url

                options = parse_storage_options(args.storage_option)
                written, index, store = index_url(args.folder, options, echo=stderr_echo(args.quiet))
                requests = f", {store.stats().requests} requests"
            else:
                if args.storage_option:
                    raise UsageError(f"--storage-option applies to an s3:// or gs:// folder, not {args.folder}")
                from fastload._formats._indexing import build_index, write_index

                index = build_index(args.folder)
                written, requests = str(write_index(args.folder, index)), ""
        except (FastloadError, OSError) as exc:
            print(f"fastload index: error: {exc}", file=sys.stderr)
            return 2
        print(
            f"{written}: {len(index.shards)} {index.kind} shards, {index.num_samples:,} samples, "
            f"{index.total_bytes:,} bytes{requests}"
        )
        return 0

    parser.set_defaults(func=run)


__all__ = ["add_index_parser"]
