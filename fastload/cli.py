"""The ``fastload`` command: ``fastload --version``, ``fastload demo`` and the subcommands that
later modules register. Built only on the public API; user errors exit with code 2 and one line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

import fastload


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``, else argparse's usage error naming it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}; got {value}")
        return value

    return parse


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train a tiny model on a generated dataset, with fastload and with torch's DataLoader",
    )
    p.add_argument("--samples", type=_count(1), default=20_000, help="dataset size (default 20000)")
    p.add_argument("--steps", type=_count(1), default=300, help="training steps per loader (default 300)")
    p.add_argument("--batch-size", type=_count(1), default=32)
    p.add_argument("--workers", type=_count(0), default=2, help="num_workers of both loaders")
    p.add_argument("--dir", default=None, help="where to write the dataset (default: a temp dir)")

    def run(args: argparse.Namespace) -> int:
        from fastload._apps._demo import run_demo

        return run_demo(
            samples=args.samples,
            steps=args.steps,
            batch_size=args.batch_size,
            workers=args.workers,
            directory=args.dir,
        )

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastload",
        description="fastload: whole batches from disk to the GPU, with the GPU never waiting.",
    )
    parser.add_argument("--version", action="version", version=f"fastload {fastload.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    from fastload._apps._convert._cli import add_convert_parser, add_inspect_parser

    add_convert_parser(sub)
    add_inspect_parser(sub)
    from fastload._apps._convert._index_cli import add_index_parser

    add_index_parser(sub)
    from fastload._apps._bench._cli import add_bench_parser

    add_bench_parser(sub)
    from fastload._apps._doctor_cli import add_doctor_parser

    add_doctor_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("fastload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """Whoever read stdout stopped (``fastload inspect FILE | head -2``): end quietly with the
    status a command killed by SIGPIPE has, as coreutils do. stdout then points at /dev/null,
    so that the interpreter's last flush at exit finds nothing to fail on."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
