"""The worker process: receive tasks, build batches, send back results.

A worker never decides anything: it builds what it is told, in the order it is told, and sends
one :class:`~fastload._engine._messages.Reply` per task back on its own pipe. It exits when its
task pipe is closed (end-of-file), when its parent dies (checked between tasks, at least every
``_POLL_S``), or when the result pipe breaks. See the shutdown NOTE in ``_pool.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pickle
import queue
import random
import select
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterDataPipe, graph_settings
from torch.utils.data._utils import worker as torch_worker

from fastload._capabilities import DatasetCapabilities, resolve_dataset
from fastload._engine._builder import SlotBuilder
from fastload._engine._fetch import IterableFetcher, make_fetcher
from fastload._engine._host import WorkerHost
from fastload._engine._messages import EXHAUSTED, FAILED, OK, Kind, Reply, Resume, WorkerFailure
from fastload._engine._slots import task_seq
from fastload._engine._transport import dumps, take_frames, write_frame
from fastload._threads import start_own_thread

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection

_POLL_S = 0.2


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled once when it starts (the dataset included: fastload's
    readers pickle as paths and options)."""

    dataset: Any
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    worker_id: int
    num_workers: int
    main_pid: int
    epoch: int
    builder: Any = None  # the fast path's batch builder; None for the generic path
    host: WorkerHost = field(default_factory=WorkerHost)  # what the host policy has it do
    readahead: bool = False  # hint the kernel about the queued tasks' byte ranges
    #: Send the worker's state after each batch built (for a loader's resume: ``snapshot``).
    snapshot_rng: bool = False
    #: With it, the state of the iterable dataset's replica (it has ``state_dict``).
    snapshot_dataset: bool = False
    #: States to start from, per worker id, after ``worker_init_fn`` (a resumed epoch: each
    #: worker continues where it stood after its last batch received before the checkpoint);
    #: a worker not listed keeps its seeds.
    resume_rng: dict[int, Any] | None = None
    #: The dataset's capabilities as the loader resolved them (None: resolved in the worker).
    capabilities: DatasetCapabilities | None = None

    @property
    def dataset_capabilities(self) -> DatasetCapabilities:
        return self.capabilities if self.capabilities is not None else resolve_dataset(self.dataset)


def _seed(spec: WorkerSpec) -> int:
    """torch's rule: every RNG of worker ``i`` starts from ``base_seed + i`` (numpy's from a hash
    of both, as torch computes it)."""
    seed = spec.base_seed + spec.worker_id
    random.seed(seed)
    if torch.version.cuda is not None:
        torch.manual_seed(seed)  # also queues the CUDA generators' seeding, should CUDA start
    else:  # a CPU build: the same, less a queued CUDA seeding that can never run (its stack
        torch.default_generator.manual_seed(seed)  # capture slowed every worker's start)
    generate: Callable[[int, int], list[int]] = torch_worker._generate_state  # torch's, untyped
    np.random.seed(generate(spec.base_seed, spec.worker_id))
    return seed


def rng_states() -> tuple[bytes, Any, Any]:
    """This process's torch, ``random`` and numpy random states (what a dataset's or a
    collate's augmentation draws from)."""
    return torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state()


def set_rng_states(states: tuple[bytes, Any, Any]) -> None:
    """Restore what :func:`rng_states` returned."""
    torch_state, python_state, numpy_state = states
    torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def snapshot(spec: WorkerSpec) -> tuple[tuple[bytes, Any, Any], Any]:
    """The worker's state after a batch: its random states, and its iterable dataset
    replica's own state where the loader keeps it (``None`` otherwise)."""
    # A copy: a dataset may hand out the same mutable object each time.
    dataset = copy.deepcopy(spec.dataset.state_dict()) if spec.snapshot_dataset else None
    return rng_states(), dataset


def restore(spec: WorkerSpec, state: tuple[tuple[bytes, Any, Any], Any]) -> None:
    """Start from what :func:`snapshot` returned."""
    rng, dataset = state
    set_rng_states(rng)
    if dataset is not None:
        spec.dataset.load_state_dict(dataset)


class _Snapshots:
    """What a worker sends of its state after each batch: the state where it changed since the
    last one sent, else ``()``, so that a dataset that draws no random numbers costs no
    transfer (11 KB a batch halved the generic path's batches/s on small batches)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self._last = snapshot(spec)  # after worker_init_fn and any restored state

    def after_batch(self) -> Any:
        now = snapshot(self._spec)
        if _same(now, self._last):
            return ()
        self._last = now
        return now


def _same(a: tuple[tuple[bytes, Any, Any], Any], b: tuple[tuple[bytes, Any, Any], Any]) -> bool:
    (torch_a, python_a, numpy_a), dataset_a = a
    (torch_b, python_b, numpy_b), dataset_b = b
    if torch_a != torch_b or python_a != python_b or numpy_a[2:] != numpy_b[2:]:
        return False
    if not np.array_equal(numpy_a[1], numpy_b[1]):
        return False
    try:
        return bool(dataset_a == dataset_b)
    except Exception:  # a state whose comparison is not a truth value (arrays): count it changed
        return False


def _parent_alive(spec: WorkerSpec, ppid: int | None) -> bool:
    """Whether the main process is alive: the parent this worker started with (``ppid``; ``None``
    for a worker the worker server started, whose parent is the server) and ``spec.main_pid``."""
    if ppid is not None and os.getppid() != ppid:
        return False
    try:
        os.kill(spec.main_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker_main(
    spec: WorkerSpec,
    tasks: Connection,
    results: Connection,
    progress: Any,
    finished: Any,
    parent_ends: tuple[int, ...] = (),
    served: bool = False,
) -> None:
    """Entry point of a worker process (a module-level function, so spawn can import it).
    ``progress[worker_id]`` tells the main process which task this worker is building,
    ``finished[worker_id]`` how many tasks it has finished (replied to, or dropped), counted
    just before the reply is written.
    ``parent_ends``: the main process's ends of this worker's own pipes, which a forked worker
    inherits and closes, so that the main process closing them is an end-of-file here.
    ``served``: started by the worker server (``_zygote.py``), whose death is no reason to stop:
    the main process's is (its pipes' end of file, or its pid gone)."""
    for fd in parent_ends:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and stops us
    ppid = None if served else os.getppid()
    torch.set_num_threads(1)
    seed = _seed(spec)
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=spec.worker_id, num_workers=spec.num_workers, seed=seed, dataset=spec.dataset
    )
    init_failure: WorkerFailure | None = None
    fetcher: Any = None
    try:
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(spec.worker_id)
        if spec.resume_rng is not None and spec.worker_id in spec.resume_rng:
            restore(spec, spec.resume_rng[spec.worker_id])
        fetcher = _new_fetcher(spec)
    except Exception as exc:
        init_failure = _failure(exc, spec, index=None)
    snapshots = _Snapshots(spec) if spec.snapshot_rng and init_failure is None else None

    exhausted = False
    capabilities = spec.dataset_capabilities
    storage_counts = spec.dataset.storage_counts if capabilities.storage_counts else None
    if storage_counts is not None and storage_counts() is None:
        storage_counts = None  # a local dataset
    # The fast path's builder reads and writes its per-batch messages in a binary form of its
    # own; everything else is pickled (results with the pickler that moves arrays through
    # shared memory).
    builder = spec.builder
    direct = _direct(builder) if snapshots is None and storage_counts is None and not spec.readahead else None
    inbox = _Inbox(
        tasks.fileno(),
        pickle.loads if builder is None else builder.task_message if direct is None else direct,
        on_queued=_readahead(spec) if spec.readahead else None,
    )
    encode = dumps if builder is None else builder.result_bytes
    results_fd = results.fileno()
    wid = spec.worker_id
    try:
        while True:
            msg = inbox.next(_POLL_S)  # EOFError: the main process closed the pipe
            if type(msg) is bytes:  # a task to answer directly: NOTE [direct replies]
                if not exhausted and init_failure is None:
                    progress[wid] = task_seq(msg)
                    data = builder.direct_reply(msg)
                    if data is not None:
                        finished[wid] += 1  # counted before the reply can arrive
                        write_frame(results_fd, data)
                        progress[wid] = -1
                        continue
                msg = builder.task_message(msg)  # the general way: it builds, or says why not
            if msg is _NOTHING:
                if not _parent_alive(spec, ppid):
                    return
                continue
            if msg is None:
                return
            if isinstance(msg, Resume):
                exhausted = False
                if msg.base_seed is not None:  # another iterator's: NOTE [parked workers]
                    spec = dataclasses.replace(spec, base_seed=msg.base_seed)
                    torch_worker._worker_info = torch_worker.WorkerInfo(
                        id=spec.worker_id, num_workers=spec.num_workers, seed=_seed(spec), dataset=spec.dataset
                    )
                if msg.shared_seed is not None and isinstance(spec.dataset, IterDataPipe):
                    shared = torch.Generator()
                    shared.manual_seed(msg.shared_seed)
                    graph_settings.apply_random_seed(spec.dataset, shared)
                if init_failure is None:
                    fetcher = _new_fetcher(spec)
                continue
            task_epoch, seq, index = msg  # a TaskMessage
            if exhausted:
                finished[spec.worker_id] += 1
                continue  # the main process dropped this worker's tasks when it was told
            if init_failure is not None:  # reported with the first task, as torch does
                failure = dataclasses.replace(init_failure, index=index)
                reply = Reply(task_epoch, seq, FAILED, failure, 0.0, None)
                init_failure = None
            else:
                progress[spec.worker_id] = seq
                started = time.perf_counter()
                before = storage_counts() if storage_counts is not None else None
                kind, payload = _build(spec, fetcher, index)
                busy_s = time.perf_counter() - started
                storage = None if before is None or storage_counts is None else storage_counts() - before
                rng = snapshots.after_batch() if snapshots is not None and kind is OK else None
                reply = Reply(task_epoch, seq, kind, payload, busy_s, getattr(fetcher, "last_read_s", None), storage, rng)
                exhausted = kind == EXHAUSTED
            try:
                data = encode(reply)
            except Exception as exc:  # an unpicklable batch fails that batch, not the worker
                data = dumps(Reply(task_epoch, seq, FAILED, _failure(exc, spec, index), 0.0, None))
            del reply
            # Counted before the reply can arrive: whoever holds a reply sees it in the count.
            finished[spec.worker_id] += 1
            write_frame(results_fd, data)  # Connection's framing, without its per-call checks
            progress[spec.worker_id] = -1
            del data
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return  # the main process is gone or closed our pipe
    finally:
        spec.host.leave()
        results.close()  # the goodbye: nothing of the main process's is touched after this


_NOTHING = object()  # _Inbox.next: no message within the timeout


class _Inbox:
    """The task pipe, read raw and without blocking: one read takes every message waiting, and
    a poll happens only when the pipe is empty (``Connection.recv_bytes`` costs a poll and two
    reads per message; a worker with its next task queued now makes one read for it)."""

    def __init__(
        self,
        fd: int,
        decode: Callable[[bytes], Any],
        on_queued: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self._fd = fd
        self._on_queued = on_queued  # called with the messages queued behind the next one
        os.set_blocking(fd, False)  # this worker's own read end: nobody else reads it
        self._decode = decode
        self._buffer = bytearray()
        self._messages: list[Any] = []
        self._poll = select.poll()  # one poll object for the worker's life
        self._poll.register(fd, select.POLLIN)

    def next(self, timeout_s: float) -> Any:
        """The next message, or ``_NOTHING`` when none arrived within ``timeout_s``; raises
        ``EOFError`` once the main process has closed the pipe."""
        while not self._messages:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                if not self._poll.poll(timeout_s * 1000):
                    return _NOTHING
                continue
            if not chunk:
                raise EOFError
            self._buffer += chunk
            self._messages = take_frames(self._buffer, self._decode)
            if self._on_queued is not None and len(self._messages) > 1:
                self._on_queued(self._messages[1:])
            self._messages.reverse()
        return self._messages.pop()


def _readahead(spec: WorkerSpec) -> Callable[[list[Any]], None] | None:
    """What tells the kernel about the byte ranges of queued tasks: the dataset's ``willneed``
    (``fastload._protocols``) of each task's indices, called by a thread of its own so that
    the build of the current task does not wait for the hints; ``None`` where the dataset has
    no ``willneed``."""
    if not spec.dataset_capabilities.willneed:
        return None
    willneed = spec.dataset.willneed
    queued: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run() -> None:
        while True:
            index = queued.get()
            # Only a hint: what it finds wrong, the task's read raises, naming the sample.
            with contextlib.suppress(IndexError, OSError, TypeError, ValueError):
                willneed(getattr(index, "indices", index))

    start_own_thread(run, "fastload-readahead")

    def hint(messages: list[Any]) -> None:
        for message in messages:
            if isinstance(message, tuple) and len(message) == 3:  # a TaskMessage
                queued.put(message[2])

    return hint


def _direct(builder: Any) -> Callable[[bytes], Any] | None:
    """NOTE [direct replies] — The fast path's common task, a binary task whose batch a
    one-call build writes into a regular slot, is built and answered straight from its bytes
    (``SlotBuilder.direct_reply``): no task, reply or descriptor objects on the way, and none
    of the per-message steps that cannot apply to it. The workers' CPU per batch, the build
    included, went from 54.1 to 46.5 µs here, 2 workers (benchmarks/README.md, "Direct
    replies"). The inbox hands such a task over as its bytes and decodes every other message;
    a task the direct build declines goes the general way, which builds it or says what is
    wrong, so the two cannot differ in what they deliver or how they fail. Only where
    the worker sends nothing else per batch: no random-state snapshots, no storage counts, no
    read-ahead hints (those read the decoded queue). Returns the inbox's decoder, or ``None``
    where direct replies do not apply."""
    if not isinstance(builder, SlotBuilder):
        return None
    task_message = builder.task_message

    def decode(data: bytes) -> Any:
        return data if data[:1] == b"T" else task_message(data)

    return decode


def _new_fetcher(spec: WorkerSpec) -> Any:
    if spec.builder is not None:
        return spec.builder
    return make_fetcher(spec.dataset, spec.auto_collation, spec.collate_fn, spec.drop_last, spec.dataset_capabilities)


def _build(spec: WorkerSpec, fetcher: Any, index: Any) -> tuple[Kind, Any]:
    """``(kind, payload)`` for one task."""
    try:
        if spec.builder is not None:
            return OK, fetcher.build(index)
        return OK, fetcher.fetch(index)
    except StopIteration as exc:
        if isinstance(fetcher, IterableFetcher):
            return EXHAUSTED, None
        return FAILED, _failure(exc, spec, index)  # re-raised in next(): ends the epoch, as in torch
    except Exception as exc:
        return FAILED, _failure(exc, spec, index)


def _failure(exc: BaseException, spec: WorkerSpec, index: Any) -> WorkerFailure:
    exc_type: type[BaseException] = type(exc)
    try:
        pickle.loads(pickle.dumps(exc_type))
    except Exception:  # a class defined in a function, say: re-raised as RuntimeError
        exc_type = RuntimeError
    return WorkerFailure(
        exc_type=exc_type,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
        worker_id=spec.worker_id,
        pid=os.getpid(),
        index=index,
    )
