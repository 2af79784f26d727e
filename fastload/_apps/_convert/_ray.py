"""``fastload convert --engine ray``: the converter's two parallel stages on a Ray cluster.

What runs where. The driver (the ``fastload convert`` process) discovers and cuts the inputs
into chunks exactly as the local converter does, and keeps everything that fixes the output's
order: it receives each chunk's encoded samples in input order, appends them to the spools
(which decides which shard each sample lands in, from the running sample count alone), and
writes the index last. Ray Data tokenizes the chunks on the cluster's CPUs (``map_batches`` with
``preserve_order``, each result also carrying its chunk number, checked on arrival), and Ray
tasks write the finished shards in parallel. So the shards, their samples, their order, their
attributes and the index are byte for byte those of ``--engine local`` with the same options.

Faults. A task whose worker process dies is retried (:data:`MAX_RETRIES`). Encoding a chunk is
a pure function, so a retry returns the same samples once; a shard task writes a file of its
own name and renames it over the shard's temporary path, so a retried or duplicated task leaves
exactly one whole file. Bad records are not faults: the per-chunk function's exception is
returned as a value and re-raised by the driver at its chunk's turn, naming the file and line as
the local converter does. The driver killed as a whole publishes nothing (the temporary-folder
protocol of ``_crash_safe.py``); the next run removes its temporary folder and starts again.

Shards are written beside the output by the cluster's workers, so on a cluster of several nodes
the output's folder must be on a filesystem every node mounts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fastload._apps._convert._progress import Progress
from fastload._apps._convert._shard_file import ShardCounts, ShardJob, remove_spools, write_shard
from fastload.errors import MissingExtraError, WorkerCrashedError, install_command

T = TypeVar("T")
R = TypeVar("R")

#: Times a task is retried after its worker process died (Ray's ``max_retries``).
MAX_RETRIES = 3
#: Pickled input bytes per Ray task (whole chunks, so at least one chunk): a task costs Ray
#: Data about 20 ms and a 1 MB chunk about 10 ms of bytes tokenization, so tasks carry several
#: chunks (``benchmarks/README.md``, Conversion on Ray).
TASK_BYTES = 8 << 20
#: Tasks per Ray Data execution: bounds what the driver holds (about this many times
#: :data:`TASK_BYTES`) while giving each execution enough tasks to fill a cluster.
WINDOW_TASKS = 32
#: Seconds between checks of the shard tasks (each check also refreshes the progress bar).
POLL_S = 0.5
#: Test hook: a path prefix; the first attempt of chunk 0's task and of shard 0's task each
#: create ``PREFIX.map``/``PREFIX.shard`` and kill their own worker process.
KILL_ONCE_ENV = "_FASTLOAD_RAY_TEST_KILL_ONCE"

#: Per worker process: the function each chunk goes through, by the id of its setup object.
_functions: dict[str, Callable[[Any], Any]] = {}


def import_ray() -> Any:
    """The ``ray`` module with Ray Data, or :class:`MissingExtraError` naming the extra."""
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise MissingExtraError(
            f"--engine ray needs Ray Data ({exc}); install it with {install_command('ray')}", "ray"
        ) from exc
    return ray


def _kill_once(kill: str | None, stage: str, number: int) -> None:
    if kill is None or number != 0:
        return
    marker = Path(f"{kill}.{stage}")
    if not marker.exists():
        marker.touch()
        os._exit(1)


def _function_for(setup: Any) -> Callable[[Any], Any]:
    import ray

    key = setup.hex()
    if key not in _functions:
        make, argument = ray.get(setup)
        _functions.clear()  # one conversion at a time per worker process
        _functions[key] = make(argument)
    return _functions[key]


def _outcome(function: Callable[[Any], Any], item: Any) -> tuple[bool, Any]:
    try:
        return True, function(item)
    except Exception as exc:  # re-raised by the driver at this chunk's turn
        try:
            pickle.dumps(exc)
        except Exception:  # an exception that does not pickle: keep its type's name and text
            return False, RuntimeError(f"{type(exc).__name__}: {exc}")
        return False, exc


def _map_batch(
    batch: dict[str, np.ndarray], *, setup: list[Any], kill: str | None
) -> dict[str, list[Any]]:
    """Ray Data's function: each row's chunks, numbered from ``first``, through the
    conversion's function; outcomes stop at the first failure, which the driver raises."""
    function = _function_for(setup[0])
    results = []
    for first, payload in zip(batch["first"], batch["payload"], strict=True):
        outcomes = []
        for number, item in enumerate(pickle.loads(payload), start=int(first)):
            _kill_once(kill, "map", number)
            outcomes.append(_outcome(function, pickle.loads(item)))
            if not outcomes[-1][0]:
                break
        results.append(pickle.dumps(outcomes, protocol=5))
    return {"first": list(batch["first"]), "result": results}


def _groups(items: Iterable[Any]) -> Iterator[tuple[int, bytes]]:
    """``(number of the first chunk, pickled list of pickled chunks)`` of about
    :data:`TASK_BYTES`; each chunk is pickled once, which also measures it."""
    first = 0
    group: list[bytes] = []
    size = 0
    for item in items:
        group.append(pickle.dumps(item, protocol=5))
        size += len(group[-1])
        if size >= TASK_BYTES:
            yield first, pickle.dumps(group, protocol=5)
            first, group, size = first + len(group), [], 0
    if group:
        yield first, pickle.dumps(group, protocol=5)


def _write_shard_task(job: ShardJob, kill: str | None) -> ShardCounts:
    """Write ``job``'s shard under a name of this attempt's own, then rename it into place:
    retried or duplicated attempts leave one whole file."""
    _kill_once(kill, "shard", job.index)
    part = job.path.with_name(f".{job.path.name}.{uuid.uuid4().hex}.part")
    counts = write_shard(replace(job, path=part))
    os.replace(part, job.path)
    return counts


class RayEngine:
    """The :class:`~fastload._apps._convert._engines.Engine` on a connected Ray cluster."""

    def __init__(self, ray: Any, *, progress: bool) -> None:
        self.ray = ray
        self.progress = progress
        self.kill = os.environ.get(KILL_ONCE_ENV) or None
        self.done = 0
        self.submitted = 0

    def status(self) -> str:
        return f"{self.done:,} Ray tasks done, {self.submitted - self.done:,} queued"

    def map(
        self, make: Callable[[Any], Callable[[T], R]], argument: Any, items: Iterable[T]
    ) -> Iterator[R]:
        setup = [self.ray.put((make, argument))]  # once per conversion, not per task
        groups = _groups(items)
        while window := list(itertools.islice(groups, WINDOW_TASKS)):
            rows = [{"first": first, "payload": payload} for first, payload in window]
            del window
            self.submitted += len(rows)
            yield from self._run_window(rows, setup)

    def _run_window(self, rows: list[dict[str, Any]], setup: list[Any]) -> Iterator[Any]:
        dataset = self.ray.data.from_items(rows, override_num_blocks=len(rows))
        dataset.context.execution_options.preserve_order = True
        dataset.context.enable_progress_bars = False
        with warnings.catch_warnings():
            # Ray Data retries a dead worker's task forever by default; a bounded budget needs
            # the remote-argument form, deprecated (for named parameters not yet offered).
            warnings.simplefilter("ignore", DeprecationWarning)
            dataset = dataset.map_batches(
                _map_batch,
                batch_size=1,
                batch_format="numpy",
                fn_kwargs={"setup": setup, "kill": self.kill},
                max_retries=MAX_RETRIES,
            )
        expected = rows[0]["first"]
        try:
            for row, sent in itertools.zip_longest(dataset.iter_rows(), rows):
                if row is None or sent is None or int(row["first"]) != expected:
                    got = "nothing" if row is None else f"chunk {row['first']}"
                    raise RuntimeError(f"Ray Data returned {got}, expected chunk {expected}")
                self.done += 1
                for ok, value in pickle.loads(row["result"]):
                    if not ok:
                        raise value
                    expected += 1
                    yield value
        except self.ray.exceptions.RayError as exc:
            raise WorkerCrashedError(
                f"a Ray task failed {MAX_RETRIES + 1} times while converting chunk {expected} "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:500]}); see the Ray logs"
            ) from exc

    def write_shards(self, jobs: Sequence[ShardJob]) -> list[ShardCounts]:
        task = self.ray.remote(max_retries=MAX_RETRIES, num_cpus=1)(_write_shard_task)
        pending = {task.remote(job, self.kill): i for i, job in enumerate(jobs)}
        self.submitted += len(pending)
        counts: list[ShardCounts | None] = [None] * len(jobs)
        total = sum(spool.path.stat().st_size for job in jobs for spool in job.values.values())
        with (
            Progress(description="writing shards", total_bytes=total, enabled=self.progress) as bar,
            contextlib.ExitStack() as cleanup,
        ):
            cleanup.callback(lambda: [self.ray.cancel(ref, force=True) for ref in pending])
            while pending:
                ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    index = pending.pop(ref)
                    try:
                        counts[index] = self.ray.get(ref)
                    except self.ray.exceptions.RayError as exc:
                        raise WorkerCrashedError(
                            f"a Ray task failed {MAX_RETRIES + 1} times writing shard {index} "
                            f"to {jobs[index].path.name} ({type(exc).__name__}); see the Ray logs"
                        ) from exc
                    written = sum(s.path.stat().st_size for s in jobs[index].values.values())
                    remove_spools(jobs[index])
                    self.done += 1
                    bar.advance(input_bytes=written, records=0, status=self.status())
        return [c for c in counts if c is not None]


@contextlib.contextmanager
def ray_engine(*, address: str | None, progress: bool) -> Iterator[RayEngine]:
    """Connect to the cluster at ``address``, or start a local Ray instance when it is None; at
    the end disconnect, or stop the instance started here. A driver already connected (``ray.init``
    called by the user) is used as it is, and left connected."""
    ray = import_ray()
    connected_here = not ray.is_initialized()
    if connected_here:
        started = time.monotonic()
        ray.init(
            address="local" if address is None else address,
            include_dashboard=False if address is None else None,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
        if progress:
            where = "a local Ray instance" if address is None else f"Ray at {address}"
            cpus = int(ray.cluster_resources().get("CPU", 0))
            seconds = time.monotonic() - started
            print(f"connected to {where} ({cpus} CPUs) in {seconds:.1f} s", file=sys.stderr)
    # Ray Data logs each execution's start and plan: noise beside the converter's progress.
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    try:
        yield RayEngine(ray, progress=progress)
    finally:
        if connected_here:
            ray.shutdown()
