"""Command-line front ends: ``fastload convert``, ``fastload inspect`` and
``scripts/convert_to_hdf5.py`` share these argument definitions.

Exit codes: 0 done; 1 ``inspect`` found the file invalid; 2 a user error (bad option, missing
input, bad input data, unwritable or existing output), reported in one line without a traceback;
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from fastload._apps._convert._convert_options import (
    ENGINES,
    FORMATS,
    INTEGER_DTYPES,
    Compression,
    ConvertOptions,
)
from fastload.errors import FastloadError

CONVERT_DESCRIPTION = """\
Convert text, JSON Lines, JSON, CSV/TSV, Parquet, Arrow IPC, Hugging Face save_to_disk folders
and numpy arrays into the fastload HDF5 layout (with its /lengths index), streaming, with an
atomic write. Inputs may be files, folders (read recursively in sorted order) or globs; text
formats may be gzip- or zstd-compressed."""

CONVERT_EPILOG = """\
compression trade-off: 'none' (the default) stores every dataset contiguously, so the loader
memory-maps it and reads a batch with no decompression and no copy. 'lzf' (fast) and 'gzip'
(smaller, slower) shrink the file 2-4x on text, but every read decompresses whole 64 KiB chunks:
choose them for storage or network-bound data, not for the fastest loading.

examples:
  fastload convert corpus/ -o corpus.h5                          lines of .txt files, byte tokens
  fastload convert data.jsonl.gz -o d.h5 --tokenizer tok.json --label-field label
  fastload convert docs/ --format txt --per-file -o docs.h5 --errors replace
  fastload convert tokens.npy offsets.npy --offsets tokens=offsets -o t.h5
  fastload convert data.jsonl -o s3://bucket/corpus/ --shard-size 100000   converted here, uploaded,
                                                                  fastload-index.json last
  fastload convert corpus/ -o out.h5 --shard-size 100000 --engine ray --ray-address auto
                                                                  the same shards, tokenized on a Ray cluster"""


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _pair(text: str) -> tuple[str, str]:
    values, sep, offsets = text.partition("=")
    if not (sep and values and offsets):
        raise argparse.ArgumentTypeError(f"expected VALUES=OFFSETS, got {text!r}")
    return values, offsets


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, folders or globs")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.h5",
        help="the file to write, or a folder URL (s3://bucket/corpus/, gs://...) to upload shards and their index to",
    )
    reading = parser.add_argument_group("reading")
    reading.add_argument(
        "--format", choices=FORMATS, help="read every input as this format (default: by extension)"
    )
    reading.add_argument(
        "--per-file", action="store_true", help="text: one sample per file instead of per line"
    )
    reading.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the field or column holding the text or token ids (default: text)",
    )
    reading.add_argument(
        "--output-field",
        default="input_ids",
        metavar="NAME",
        help="name of the tokenized field in the output (default: input_ids)",
    )
    reading.add_argument(
        "--fields",
        type=_names,
        default=[],
        metavar="A,B",
        help="more fields to keep under their names: text is tokenized, lists of ints kept as ids, numbers become fixed fields; for numpy inputs, the arrays to keep",
    )
    reading.add_argument(
        "--label-field",
        type=_names,
        action="extend",
        default=[],
        metavar="NAME",
        help="a numeric field kept as a fixed field (CSV values are parsed as numbers)",
    )
    reading.add_argument(
        "--offsets",
        type=_pair,
        action="append",
        default=[],
        metavar="VALUES=OFFSETS",
        help="numpy inputs: array VALUES holds a ragged field whose starts are in OFFSETS (N+1 ints from 0)",
    )
    reading.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="bad records: stop with their file and line (default), or skip and count them",
    )
    reading.add_argument(
        "--errors",
        choices=("strict", "replace"),
        default="strict",
        help="non-UTF-8 bytes: a bad record (default), or replaced by U+FFFD",
    )
    tokens = parser.add_argument_group("tokenization")
    tokens.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="KIND",
        help="bytes (UTF-8 bytes, lossless; default), whitespace (a vocabulary saved as OUT.vocab.txt), a path to a Hugging Face tokenizer.json, or module:function",
    )
    tokens.add_argument(
        "--min-count",
        type=int,
        default=1,
        help="whitespace: keep words seen at least this often (default 1)",
    )
    tokens.add_argument(
        "--max-vocab", type=int, default=None, help="whitespace: keep at most this many words"
    )
    tokens.add_argument(
        "--no-special-tokens",
        dest="special_tokens",
        action="store_false",
        help="tokenizer.json: do not add its special tokens",
    )
    tokens.add_argument("--max-length", type=int, default=None, help="longest sample, in tokens")
    tokens.add_argument(
        "--overlong",
        choices=("truncate", "drop"),
        default="truncate",
        help="what to do with samples over --max-length (default truncate)",
    )
    tokens.add_argument(
        "--min-length",
        type=int,
        default=1,
        help="drop samples with fewer tokens (default 1: empty samples)",
    )
    tokens.add_argument(
        "--dtype",
        choices=INTEGER_DTYPES,
        default=None,
        help="token id dtype (default: the smallest that holds the vocabulary)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--compression",
        default="none",
        metavar="none|lzf|gzip[:LEVEL]",
        help="see the trade-off below (default none)",
    )
    output.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="N",
        help="write OUT-00000.h5, OUT-00001.h5, ... of N samples each",
    )
    output.add_argument("--overwrite", action="store_true", help="replace an existing output")
    output.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="tokenize in N processes (default 0: in this one); the output is the same for any N",
    )
    output.add_argument(
        "--quiet", action="store_true",
        help="no progress (a bar on a terminal, else a line every 5 s on stderr), no summary",
    )
    add_storage_option_argument(output)
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help="local (default): this machine's processes; ray: tokenize over a Ray cluster's CPUs "
        "with Ray Data and write shards in parallel (pip install 'torch-fastload[ray]'); the same output",
    )
    engine.add_argument(
        "--ray-address",
        default=None,
        metavar="auto|ray://HOST:PORT",
        help="the Ray cluster to use (default: start a local Ray instance and stop it at the end)",
    )


def add_storage_option_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an s3:// or gs:// client option (pyarrow.fs.S3FileSystem's or GcsFileSystem's names, "
        "e.g. endpoint_override=http://127.0.0.1:9000); repeatable; numbers and true/false are "
        "parsed; the AWS_* environment variables apply without it",
    )


def options_from_args(args: argparse.Namespace) -> ConvertOptions:
    return ConvertOptions(
        inputs=tuple(args.inputs),
        output=Path(args.output),
        format=args.format,
        per_file=args.per_file,
        text_field=args.text_field,
        output_field=args.output_field,
        fields=tuple(args.fields),
        label_fields=tuple(args.label_field),
        offsets=tuple(args.offsets),
        tokenizer=args.tokenizer,
        min_count=args.min_count,
        max_vocab=args.max_vocab,
        special_tokens=args.special_tokens,
        max_length=args.max_length,
        overlong=args.overlong,
        min_length=args.min_length,
        dtype=args.dtype,
        compression=Compression.parse(args.compression),
        shard_size=args.shard_size,
        workers=args.workers,
        on_error=args.on_error,
        errors=args.errors,
        overwrite=args.overwrite,
        progress=not args.quiet,
        engine=args.engine,
        ray_address=args.ray_address,
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that a conversion unwinds as it does for Ctrl-C
    (its temporary folder removed, its workers shut down); not an ``Exception``, so that no
    handler of the converter's own takes it for a failure."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can be set from the main thread only
        return

    def terminate(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def run_convert(args: argparse.Namespace, prog: str = "fastload convert") -> int:
    """Run the conversion ``args`` describe; SIGTERM cleans up as Ctrl-C does and exits with
    the status a process killed by SIGTERM has (143)."""
    try:
        with _sigterm_unwinds():
            return _run_convert(args, prog)
    except _Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


def _run_convert(args: argparse.Namespace, prog: str) -> int:
    from fastload._remote import is_remote

    if is_remote(args.output):
        return _run_remote_convert(args, prog)
    from fastload._apps._convert._convert import convert

    if args.storage_option:
        print(f"{prog}: error: --storage-option applies to an s3:// or gs:// output, not {args.output}", file=sys.stderr)
        return 2
    try:
        report = convert(options_from_args(args))
    except (FastloadError, OSError) as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(report.summary())
        for note in report.notes():
            print(f"  {note}")
    return 0


def _run_remote_convert(args: argparse.Namespace, prog: str) -> int:
    from fastload._apps._convert._publish import (
        convert_to_store,
        parse_storage_options,
        stderr_echo,
    )

    try:
        report, upload = convert_to_store(
            options_from_args(args),
            args.output,
            parse_storage_options(args.storage_option),
            echo=stderr_echo(args.quiet),
        )
    except (FastloadError, OSError) as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"converted {report.samples:,} samples, {report.tokens:,} tokens in {report.seconds:.2f} s")
        print(upload.summary())
        for note in report.notes():
            print(f"  {note}")
    return 0


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "convert",
        help="convert raw data into the fastload HDF5 layout",
        description=CONVERT_DESCRIPTION,
        epilog=CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_convert_arguments(parser)
    parser.set_defaults(func=run_convert)


def add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "inspect",
        help="describe and check a fastload HDF5 file, a folder of shards or an Arrow/Parquet file",
        description="Fields, sizes, length statistics, padding (and with --pack, packing) efficiency "
        "and a validation verdict.",
    )
    parser.add_argument("file", type=Path, metavar="PATH")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="batch size for the padding figures (default 64)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every offset, length and value, in bounded memory",
    )
    parser.add_argument(
        "--pack",
        type=int,
        default=None,
        metavar="N",
        help="also the packing efficiency of rows of N tokens (--batch-size rows a batch)",
    )

    def run(args: argparse.Namespace) -> int:
        from fastload._apps._convert._inspect import run_inspect

        try:
            return run_inspect(
                args.file,
                batch_size=args.batch_size,
                verify=args.verify,
                out=sys.stdout,
                pack=args.pack,
            )
        except BrokenPipeError:
            raise  # a reader that closed stdout (`| head`): fastload.cli.main ends quietly
        except (FastloadError, OSError) as exc:
            print(f"fastload inspect: error: {_one_line(exc)}", file=sys.stderr)
            return 2

    parser.set_defaults(func=run)


def convert_main(argv: Sequence[str] | None = None) -> int:
    """``scripts/convert_to_hdf5.py``: the same options as ``fastload convert``."""
    parser = argparse.ArgumentParser(
        prog="convert_to_hdf5.py",
        description=CONVERT_DESCRIPTION,
        epilog=CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_convert_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_convert(args, prog=parser.prog)
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
