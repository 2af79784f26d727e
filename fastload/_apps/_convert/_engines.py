"""Where the converter's work runs: the seam between the conversion (what to compute, in which
order) and the machinery that computes it.

An engine does two things: an ordered map of a per-chunk function (tokenizing, counting words)
and the writing of finished shards. Both engines return results in input order and write the
same bytes, so the engine changes the speed and never the output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from fastload._apps._convert._convert_options import ConvertOptions
from fastload._apps._convert._parallel import ordered_map
from fastload._apps._convert._shard_file import ShardCounts, ShardJob
from fastload._apps._convert._writer import write_in_order

T = TypeVar("T")
R = TypeVar("R")


class Engine(Protocol):
    def map(
        self, make: Callable[[Any], Callable[[T], R]], argument: Any, items: Iterable[T]
    ) -> Iterator[R]:
        """``make(argument)(item)`` for each item, yielded in input order; an exception raised
        for an item is re-raised at that item's turn."""
        ...

    def write_shards(self, jobs: Sequence[ShardJob]) -> list[ShardCounts]:
        """Write every job's shard; counts in job order. Deletes each shard's spools once its
        shard is written."""
        ...

    def status(self) -> str:
        """A few words for the progress bar (tasks done and left), or ``""``."""
        ...


class LocalEngine:
    """This machine: ``workers`` processes (0: this one) and shards written in order."""

    def __init__(self, *, workers: int) -> None:
        self.workers = workers

    def map(
        self, make: Callable[[Any], Callable[[T], R]], argument: Any, items: Iterable[T]
    ) -> Iterator[R]:
        return ordered_map(make, argument, items, workers=self.workers)

    def write_shards(self, jobs: Sequence[ShardJob]) -> list[ShardCounts]:
        return write_in_order(jobs)

    def status(self) -> str:
        return ""


@contextlib.contextmanager
def open_engine(options: ConvertOptions) -> Iterator[Engine]:
    """The engine ``options.engine`` names, for the duration of one conversion. Ray is imported
    here only, so that ``--engine local`` never needs it."""
    if options.engine == "local":
        yield LocalEngine(workers=options.workers)
        return
    from fastload._apps._convert._ray import ray_engine

    with ray_engine(address=options.ray_address, progress=options.progress) as engine:
        yield engine
