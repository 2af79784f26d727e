"""The worker server: one process per loading process, started on first use, that forks the
fast path's workers, so that the training process itself never forks.

Why. ``fork`` copies the caller's page tables and write-protects every page it has, so its cost
grows with the caller: 5-6 ms per worker from the benchmark's process here, about 50 ms from one
holding 4 GB (a model, a cache), paid on the consumer's thread with the GIL held, for every
worker of every fresh iterator; and afterwards the caller takes a copy-on-write fault on each
page it writes for the first time. The server is a fresh interpreter with fastload (so torch)
imported and nothing of the caller's: starting two workers costs the caller 2-3 ms whatever its
size. ``benchmarks/README.md`` ("The worker server") has the measurements.

When. :func:`worker_server` is asked as a fast-path iterator starts its workers, where fork
would be used (no ``multiprocessing_context`` given, fork the default) and a batch cannot depend
on the process that builds it (``_runner.same_in_any_worker``: a reader and a collate that
declare it, no ``worker_init_fn``). The first request starts the server in the background and
those workers are forked as before; later iterators use it once it is ready. A spec is pickled
for it, which fork never does: so the server takes only specs whose every class and function is
fastload's, torch's, numpy's, h5py's, pyarrow's or the standard library's (never ``__main__``'s
or a user's module's, whose state at the time of the fork the user may rely on). The worker
takes on what a forked one would inherit from the caller as it is at that moment: environment,
working directory, ``sys.path``, standard output and error, CPU affinity, niceness,
open-files limit. A spec
refused, a server that died or stopped reading: the worker is forked here, as before.
``FASTLOAD_WORKER_SERVER=0`` turns the server off.

The protocol, over one socket pair (no name in the file system). The caller sends a header (the
payload's length) with the worker's descriptors attached (its task pipe's read end, its result
pipe's write end, the counters' memory, a socket for the server's reply, the write end of a
status pipe, standard output and error), then the pickled payload. The server hands it to a
*spare* (a child forked ahead, named ``fastload-spare``, blocked on a socket of its own), else
forks a child for it; replies with the child's pid and a pidfd for it (the caller's sentinel:
readable once the worker has exited, even if the server died first; signals go through it);
and, when it reaps the child, writes the wait status into the status pipe. Spares are forked
only once the caller has been quiet for ``_QUIET_S``, never while a loader starts. The server
exits when the caller's end of the socket closes (the caller exiting, however it exits), its
spares with it; its workers stop as forked ones do, when the caller closes their pipes or is
gone, and not for the server's death (a worker outliving its server goes on serving).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from fastload._engine._arena import anonymous_file

ENV = "FASTLOAD_WORKER_SERVER"
_OFF = frozenset({"0", "false", "off", "no"})
_HEADER = struct.Struct("<8sQ")
_MAGIC = b"fl-work1"
_READY = b"R"
_INT = struct.Struct("<q")
_REPLY_S = 10.0  # the longest the caller waits for the server's word on a worker
#: Top-level packages whose classes a worker's spec may use besides the standard library's.
_KNOWN = frozenset({"fastload", "torch", "numpy", "h5py", "pyarrow"})


class SharedCounters:
    """The pool's ``progress`` and ``finished`` counters (``n`` int64 each) in one shared memory
    file, which a forked worker inherits and a worker the server started maps from the
    descriptor it is sent: :attr:`progress` and :attr:`finished` are views of it, indexed as a
    ``multiprocessing.RawArray('q')`` is."""

    def __init__(self, n: int, fd: int | None = None) -> None:
        size = 16 * max(n, 1)
        self.fd = anonymous_file(size, "fastload-counters") if fd is None else fd
        view = memoryview(mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)).cast("q")
        self.progress, self.finished = view[:n], view[n : 2 * n]

    def close_fd(self) -> None:
        """Close the descriptor (no worker will be started on it again); the views stay."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close_fd()


class Refused(Exception):
    """This worker's spec may not go through the server (see the module text)."""


class _SpecPickler(pickle.Pickler):
    """Pickles a spec and notes the module of every class and function in it."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: set[str] = set()

    def persistent_id(self, obj: Any) -> None:
        module = getattr(obj, "__module__", None) if isinstance(obj, type) or callable(obj) else None
        if module is None:
            module = type(obj).__module__
        if module:
            self.modules.add(module)
        return None


def _payload(args: tuple[Any, ...]) -> tuple[bytes, list[str]]:
    """``args`` pickled, and the modules to import before unpickling them; :class:`Refused`
    where one of those is not fastload's, torch's, numpy's, h5py's, pyarrow's or the
    standard library's, or the spec does not pickle."""
    buffer = io.BytesIO()
    pickler = _SpecPickler(buffer)
    try:
        pickler.dump(args)
    except Exception as exc:
        raise Refused(f"the spec does not pickle: {exc}") from exc
    stdlib: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    imports = []
    for module in sorted(pickler.modules):
        top = module.partition(".")[0]
        if top in _KNOWN:
            imports.append(module)
        elif top not in stdlib and top != "builtins":
            raise Refused(f"the spec uses {module}, which the server does not import")
    return buffer.getvalue(), imports


class ServedWorker:
    """A worker the server forked, with the parts of ``multiprocessing.Process`` the pool and
    the reaper use: ``pid``, ``sentinel``, ``join``, ``exitcode``, ``is_alive``, ``terminate``,
    ``kill``, ``close``.

    The server sends the worker's pid with a pidfd for it (opened before the server could reap
    it, so it names this process and no later one with the same pid): the sentinel, readable
    once the worker has exited (even if the server died first), and what signals go through.
    The exit status comes on the status pipe, written by the server as it reaps the worker."""

    def __init__(
        self, name: str, pid_sock: socket.socket, status_fd: int, server_gone: Callable[[], bool]
    ) -> None:
        self.name = name
        self.daemon = True
        self._server_gone = server_gone
        self._asking = threading.Lock()  # the pump's thread and the consumer's may both ask
        self._answered = False
        self._joining = threading.Lock()  # the reaper's thread and the consumer's may both join
        self._pid_fd = pid_sock.detach()  # a descriptor: nothing unclosed for the collector
        self._status_fd = status_fd
        self._pidfd = -1
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._closed = False

    def _receive_pid(self) -> None:
        if self._answered:
            return
        with self._asking:
            if not self._answered:  # else another thread had the answer first
                self._receive_pid_once()
                self._answered = True

    def _receive_pid_once(self) -> None:
        fd, self._pid_fd = self._pid_fd, -1
        if fd < 0:
            return  # released unasked
        sock = socket.socket(fileno=fd)
        data: bytes = b""
        fds: list[int] = []
        try:
            deadline = time.monotonic() + _REPLY_S
            # In slices: a server that died with the request unread never answers, and its
            # end of this socket may outlive it for a while (in flight with that request).
            while time.monotonic() < deadline:
                if select.select([sock], [], [], 0.05)[0]:
                    data, fds, _, _ = socket.recv_fds(sock, _INT.size, 1)
                    break
                if self._server_gone():
                    break
        except OSError:
            pass
        finally:
            sock.close()
        if len(data) == _INT.size and len(fds) == 1:
            self._pid, self._pidfd = _INT.unpack(data)[0], fds[0]
        else:  # the server died first: a sentinel already at end of file, no process
            for fd in fds:
                os.close(fd)
            read_end, write_end = os.pipe()
            os.close(write_end)
            self._pidfd = read_end
            self._exitcode = 255

    @property
    def pid(self) -> int | None:
        """The worker's pid (sent by the server right after its fork, and waited for here the
        first time it is asked); ``None`` if the server died first."""
        self._receive_pid()
        return self._pid

    @property
    def sentinel(self) -> int:
        self._receive_pid()
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the worker's exit. Safe from several threads at once (the
        reaper's and the consumer's), as ``multiprocessing.Process.join`` is."""
        self._receive_pid()
        if self._exitcode is not None or self._closed:
            return
        try:
            exited = bool(select.select([self._pidfd], [], [], timeout)[0])
        except (OSError, ValueError):
            exited = True  # closed meanwhile by a thread that joined it: the status is known
        if not exited:
            return
        with self._joining:
            if self._exitcode is not None or self._closed:
                return
            # Exited: the server reaps it at once (its SIGCHLD) and sends the status.
            data = _read_exactly(self._status_fd, _INT.size, timeout_s=_REPLY_S)
            self._exitcode = os.waitstatus_to_exitcode(_INT.unpack(data)[0]) if data is not None else 255

    def is_alive(self) -> bool:
        self.join(0)
        return self._exitcode is None

    def _signal(self, signum: int) -> None:
        self._receive_pid()
        if self._exitcode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signum)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        if self._closed:
            return
        if self.is_alive():
            raise ValueError("Cannot close a process while it is still running")
        with self._joining:
            if not self._closed:
                self._release()

    def _release(self, close: Callable[[int], None] = os.close) -> None:
        self._closed = True
        for fd in (self._pid_fd, self._pidfd, self._status_fd):
            if fd >= 0:
                try:  # noqa: SIM105  (from __del__ at interpreter exit: no module globals)
                    close(fd)
                except OSError:
                    pass
        self._pid_fd = self._pidfd = self._status_fd = -1

    def __del__(self) -> None:
        try:  # (no module globals: at interpreter exit they may be gone already)
            if not self._closed:
                self._release()
        except Exception:
            pass


def _read_exactly(fd: int, n: int, timeout_s: float) -> bytes | None:
    """``n`` bytes from ``fd`` within ``timeout_s``; ``None`` on end of file or timeout."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


#: What the server's interpreter runs: the caller's ``sys.path``, then :func:`serve`.
_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from fastload._engine._zygote import serve; serve(int(sys.argv[2]))"
)


class WorkerServer:
    """The caller's side: the server process and the socket to it (see the module text)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        flags: list[str] = getattr(subprocess, "_args_from_interpreter_flags", list)()
        command = [
            sys.executable,
            *flags,  # the caller's -O, -X, -W ...
            "-c",
            _BOOT,
            _json_path(),
            str(theirs.fileno()),
        ]
        self._proc = subprocess.Popen(
            command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True
        )
        theirs.close()
        ours.settimeout(_REPLY_S)  # a server that stopped reading: fork instead, never hang
        self._sock = ours
        self._lock = threading.Lock()
        self._ready = False
        self._dead = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def was_ready(self) -> bool:
        """Whether it ever said it was ready."""
        return self._ready

    def ready(self) -> bool:
        """Whether the server has imported what it needs and takes requests (never waits)."""
        if self._ready or self._dead:
            return self._ready
        with self._lock:
            if not self._ready and not self._dead and select.select([self._sock], [], [], 0)[0]:
                try:
                    said = self._sock.recv(1)
                except OSError:
                    said = b""
                self._ready = said == _READY
                self._dead = not self._ready
        return self._ready

    @property
    def dead(self) -> bool:
        return self._dead or self._proc.poll() is not None

    def start(self, name: str, args: tuple[Any, ...], fds: list[int]) -> ServedWorker:
        """Have the server start worker ``name`` from ``args`` (its spec, and how many
        counters each of the pool's two ranges holds) over ``fds`` (its task pipe's read end,
        its result pipe's write end, the counters' memory); the caller keeps its copies of
        ``fds``. :class:`Refused` if this spec may not go through the server; ``OSError`` if
        the server is gone or stopped reading."""
        payload, imports = _payload((name, args, _inherited()))
        payload = pickle.dumps((payload, imports, sys.path), protocol=pickle.HIGHEST_PROTOCOL)
        pid_ours, pid_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        status_r, status_w = os.pipe()
        sent = [*fds, pid_theirs.fileno(), status_w, 1, 2]
        try:
            with self._lock:
                if self.dead:
                    raise OSError("the worker server is gone")
                try:
                    socket.send_fds(self._sock, [_HEADER.pack(_MAGIC, len(payload))], sent)
                    self._sock.sendall(payload)
                except OSError:
                    self._dead = True  # and stuck or gone: the next loader starts another
                    raise
        except BaseException:
            pid_ours.close()
            os.close(status_r)
            raise
        finally:
            pid_theirs.close()
            os.close(status_w)
        return ServedWorker(name, pid_ours, status_r, lambda: self.dead)

    def close(self, timeout_s: float = 2.0) -> None:
        """Close the socket (the server exits on end of file) and wait for it; then SIGKILL."""
        with self._lock:
            self._dead = True
            with contextlib.suppress(OSError):
                self._sock.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def forget(self) -> None:
        """In a forked child: drop the caller's end of the socket without telling the server
        (kept referenced: a collected ``Popen`` of a process that is not this one's child
        would warn that it still runs)."""
        self._dead = True
        with contextlib.suppress(OSError):
            self._sock.close()
        _forgotten.append(self)


def _inherited() -> dict[str, Any]:
    """What a forked worker would inherit from this process as it is now, and the server's
    worker is given: environment, working directory, ``sys.path``, CPU affinity, niceness,
    the limit on open files."""
    import resource

    return {
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "path": list(sys.path),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
    }


def _take_on(inherited: dict[str, Any]) -> None:
    """In the server's worker: become what :func:`_inherited` says (what the kernel refuses,
    a lower niceness say, is left as the server had it)."""
    import resource

    os.environ.clear()
    os.environ.update(inherited["environ"])
    sys.path[:] = inherited["path"]
    steps: list[Callable[[], object]] = [
        lambda: os.chdir(inherited["cwd"]),
        lambda: os.sched_setaffinity(0, inherited["affinity"]),
        lambda: os.setpriority(os.PRIO_PROCESS, 0, inherited["nice"]),
        lambda: resource.setrlimit(resource.RLIMIT_NOFILE, inherited["nofile"]),
    ]
    for step in steps:
        with contextlib.suppress(OSError, ValueError):
            step()


def _json_path() -> str:
    import json

    return json.dumps([p for p in sys.path if isinstance(p, str)])


_server: WorkerServer | None = None
_server_lock = threading.Lock()
_forgotten: list[WorkerServer] = []  # a forked child's copies of its parent's server
#: Servers that died before they were ready; at this many the process forks its workers
#: itself from then on, rather than start an interpreter per iterator that cannot run one.
_MAX_EARLY_DEATHS = 3
_early_deaths = 0


def enabled() -> bool:
    """The switch: ``FASTLOAD_WORKER_SERVER`` (``0``, ``false``, ``off``, ``no``: off), and a
    platform with what the server needs (Linux: ``/proc``, ``memfd``, descriptor passing)."""
    if os.environ.get(ENV, "1").strip().lower() in _OFF:
        return False
    import multiprocessing

    if multiprocessing.current_process().daemon:
        return False  # a worker: its loaders may not start processes, as in torch
    needs = (hasattr(socket, "send_fds"), hasattr(os, "pidfd_open"), hasattr(signal, "pidfd_send_signal"))
    return sys.platform.startswith("linux") and bool(sys.executable) and all(needs)


def worker_server(start: bool = True) -> WorkerServer | None:
    """The process's worker server if it is ready; else ``None`` (starting it first, in the
    background, where ``start`` and it was never started or has died)."""
    global _server, _early_deaths
    if not enabled():
        return None
    server = _server
    if server is not None and not server.dead:
        return server if server.ready() else None
    if not start:
        return None
    with _server_lock:
        if _server is None or _server.dead:
            if _server is not None:
                _early_deaths += not _server.was_ready
                _server.close(0.1)
            if _early_deaths >= _MAX_EARLY_DEATHS:
                _server = None
                return None
            try:
                _server = WorkerServer()
            except OSError:
                _server = None
                return None
    return None


def server_pid() -> int | None:
    """The pid of this process's worker server, if one was started and has not been stopped."""
    server = _server
    return None if server is None else server.pid


def warm(timeout_s: float = 60.0) -> WorkerServer | None:
    """Start the server if needed and wait until it is ready (for tests: a loader never
    waits for it)."""
    worker_server()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server = worker_server(start=False)
        if server is not None:
            return server
        if _server is None or _server.dead:
            return None
        time.sleep(0.01)
    return None


def shutdown() -> None:
    """Stop the server (at exit; and tests)."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.close()


def _forget_in_child() -> None:
    global _server, _server_lock
    _server_lock = threading.Lock()
    server, _server = _server, None
    if server is not None:
        server.forget()


os.register_at_fork(after_in_child=_forget_in_child)

import atexit  # noqa: E402  (registered here: after the reaper's handler, so run before it)

atexit.register(shutdown)


# -- the server's side ------------------------------------------------------------------------


#: How the server's children are named (``/proc/<pid>/comm``), before and after a request.
SPARE_NAME = b"fastload-spare"
WORKER_NAME = b"fastload-worker"
#: Workers forked ahead and waiting for a request (at least this many, more after a larger
#: start: as many as the last burst of requests asked for, up to ``_MAX_SPARES``).
_MIN_SPARES = 2
_MAX_SPARES = 16
#: Spares are forked once no request came for this long: not while a loader starts.
_QUIET_S = 0.2
#: Requests closer than this to the one before belong to one burst (one loader starting).
_BURST_S = 0.05


def serve(fd: int) -> None:
    """The server's main loop (``python -c`` runs it; see the module text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    sock = socket.socket(fileno=fd)
    import numpy.random  # noqa: F401  (torch and the rest, once, before any fork; numpy's

    import fastload  # noqa: F401  random module is not imported by numpy, and every worker
    from fastload._engine import _worker  # noqa: F401  (seeds it: 5-8 ms each otherwise)

    server = _Server(sock)
    try:
        server.loop()
    finally:
        server.finish()
        os._exit(0)


class _Server:
    """The server's state: its children, spare and working, and when the caller last asked.

    A *spare* is a child forked ahead of any request, blocked on a socket of its own; a request
    goes to the oldest spare (it starts building at once: a fork from here takes 6-11 ms from
    the call to the child's first line while a loader starts, a spare about 0.2 ms), else to a
    child forked for it. Spares are forked only once the caller has been quiet for ``_QUIET_S``,
    so that their forks do not compete with a loader starting; a request that needs modules
    the spares lack (a reader's first use) drops them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.statuses: dict[int, int] = {}  # a worker's pid -> the write end of its status pipe
        self.spares: list[tuple[int, socket.socket]] = []
        self.wanted = _MIN_SPARES
        self.last_request = 0.0
        self.burst = 0
        self.freeze()

    @staticmethod
    def freeze() -> None:
        # What is imported now is every worker's: out of the collector's way in each of them,
        # so that a full collection there neither walks it nor writes to (and copies) its pages.
        gc.collect()
        gc.freeze()

    def own_fds(self) -> list[int]:
        """Every descriptor of the server's that a child must close."""
        return [self.sock.fileno(), self.wake_r, self.wake_w, *self.statuses.values(), *(s.fileno() for _, s in self.spares)]

    def loop(self) -> None:
        self.sock.sendall(_READY)
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            quiet = time.monotonic() - self.last_request
            short = len(self.spares) < self.wanted
            timeout_ms = max(1, int((_QUIET_S - quiet) * 1000) + 1) if short else 1000
            try:
                events = poller.poll(timeout_ms)
            except InterruptedError:
                events = []
            with contextlib.suppress(OSError):
                while os.read(self.wake_r, 4096):
                    pass
            self.reap()
            if events and any(fd == self.sock.fileno() for fd, _ in events):
                request = _receive(self.sock)
                if request is None:
                    return  # the caller closed its end
                self.serve_one(*request)
            elif short and time.monotonic() - self.last_request >= _QUIET_S:
                self.add_spare()

    def serve_one(self, data: bytes, fds: list[int]) -> None:
        now = time.monotonic()
        self.burst = self.burst + 1 if now - self.last_request < _BURST_S else 1
        self.wanted = min(_MAX_SPARES, max(self.wanted, self.burst))
        self.last_request = now
        task_r, result_w, counters, pid_w, status_w, out, err = fds
        worker_fds = [task_r, result_w, counters, out, err]
        _, imports, path = pickle.loads(data)
        fresh = [m for m in imports if m not in sys.modules]
        if fresh:
            sys.path[:] = path  # the caller's, as it is now
            for module in fresh:
                with contextlib.suppress(Exception):  # the child reports what fails to unpickle
                    importlib.import_module(module)
            self.freeze()
            self.drop_spares()  # they lack what was just imported
        pid = None
        while self.spares and pid is None:
            pid, spare = self.spares.pop(0)
            try:
                socket.send_fds(spare, [_HEADER.pack(_MAGIC, len(data))], worker_fds)
                spare.sendall(data)
            except OSError:
                pid = None  # a spare that died: the next one, or a fork
            spare.close()
        if pid is None:
            pid = self.fork(lambda: _become_worker(data, worker_fds))
        self.statuses[pid] = status_w
        # Its pid, and a pidfd opened before this loop can reap it (it names this process).
        with contextlib.suppress(OSError), socket.socket(fileno=pid_w) as reply:
            pidfd = os.pidfd_open(pid)
            try:
                socket.send_fds(reply, [_INT.pack(pid)], [pidfd])
            finally:
                os.close(pidfd)
        for fd in worker_fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def add_spare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        def wait_for_a_request() -> int:
            ours.close()
            _name_process(SPARE_NAME)
            request = _receive(theirs)
            if request is None:
                return 0  # the server dropped this spare, or is gone
            theirs.close()
            return _become_worker(*request)

        pid = self.fork(wait_for_a_request, keep=theirs.fileno())
        theirs.close()
        self.spares.append((pid, ours))

    def drop_spares(self) -> None:
        for _, spare in self.spares:
            spare.close()  # it reads end of file and exits; reap() collects it
        self.spares = []

    def fork(self, run: Any, keep: int = -1) -> int:
        """Fork a child that closes the server's descriptors (but ``keep``), then runs ``run()``
        and exits with what it returns (1 and a traceback where it raises)."""
        own = [fd for fd in self.own_fds() if fd != keep]
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            for fd in own:
                with contextlib.suppress(OSError):
                    os.close(fd)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = run()
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            status_w = self.statuses.pop(pid, None)
            if status_w is not None:  # a worker (not a spare dropped)
                with contextlib.suppress(OSError):
                    os.write(status_w, _INT.pack(status))
                    os.close(status_w)

    def finish(self) -> None:
        self.drop_spares()
        self.reap()
        for status_w in self.statuses.values():
            with contextlib.suppress(OSError):
                os.close(status_w)


def _receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One request (the framing of :meth:`WorkerServer.start`): its bytes and descriptors;
    ``None`` at end of file."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 16)
    if not header:
        return None
    while len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            return None
        header += more
    magic, size = _HEADER.unpack(header)
    if magic != _MAGIC:
        raise RuntimeError("fastload worker server: a request it does not understand")
    payload = bytearray()
    while len(payload) < size:
        chunk = sock.recv(min(size - len(payload), 1 << 20))
        if not chunk:
            return None
        payload += chunk
    return bytes(payload), fds


def _name_process(name: bytes) -> None:
    """Name this process as ``ps`` and ``/proc/<pid>/comm`` show it (Linux, at most 15 bytes)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME


def _become_worker(data: bytes, fds: list[int]) -> int:
    """In a child: take the caller's standard output and error, and run the worker."""
    _name_process(WORKER_NAME)
    task_r, result_w, counters, out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    payload, _, _ = pickle.loads(data)
    return _run_worker(payload, task_r, result_w, counters)


def _run_worker(payload: bytes, task_r: int, result_w: int, counters_fd: int) -> int:
    from multiprocessing.connection import Connection

    from fastload._engine._worker import worker_main

    name, args, inherited = pickle.loads(payload)
    _take_on(inherited)
    spec, slots = args
    counters = SharedCounters(slots, fd=counters_fd)
    import multiprocessing

    me = multiprocessing.current_process()
    me.name = name  # as a forked worker's Process is named
    me.daemon = True  # and, like it, may start no processes of its own
    worker_main(
        spec,
        Connection(task_r, writable=False),
        Connection(result_w, readable=False),
        counters.progress,
        counters.finished,
        (),
        served=True,
    )
    return 0


__all__ = [
    "ENV",
    "SPARE_NAME",
    "WORKER_NAME",
    "Refused",
    "ServedWorker",
    "SharedCounters",
    "WorkerServer",
    "enabled",
    "server_pid",
    "warm",
    "worker_server",
]
