"""Every decision fastload takes about the host's scheduler, behind one switch.

On the fast path the loader's own CPU time is the bottleneck on small machines, so a few
mechanisms arrange where and when its processes and threads run. Each is kept only because a
paired measurement showed it paying (the figures are in ``benchmarks/README.md``):

* **Workers off the consumer's CPU**, with a trial that gives them every CPU back when the
  consumer starves (``_cores.ConsumerCore``; fast path only).
* **Leaving workers at nice 19 on any CPU**: their exit (the kernel taking apart the address
  space fork copied) does not compete with the consumer.
* **The main process builds a batch no worker has started** while ``next()`` would wait
  (``_claims.py``; fast path only, and only where the ``_atomic`` extension was built).

``HostPolicy.resolve`` turns all of them on or off: the loader's ``host_tuning=`` option, else
the environment variable ``FASTLOAD_HOST_TUNING`` (``0``, ``false``, ``off`` or ``no``: off),
else on. Off, fastload leaves scheduling to the operating system and every batch to a worker;
the batches and their order are the same either way.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from fastload._engine import _claims as claims
from fastload._engine._cores import ConsumerCore

ENV = "FASTLOAD_HOST_TUNING"
_OFF = frozenset({"0", "false", "off", "no"})


@dataclass(frozen=True)
class WorkerHost:
    """What a worker applies to itself (pickled into its spec): ``tuned`` says whether the
    policy is on; ``cpus`` the CPUs to start on (``None``: any)."""

    tuned: bool = False
    cpus: frozenset[int] | None = None

    def enter(self) -> None:
        """In a new worker, before ``worker_init_fn`` (which may choose otherwise)."""
        if self.tuned and self.cpus is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.cpus)

    def leave(self) -> None:
        """In a worker that is about to exit: lowest priority, on any CPU."""
        if not self.tuned:
            return
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps the allowed ones


@dataclass(frozen=True)
class HostPolicy:
    """The switch and what it decides, for one iterator (see the module text)."""

    tuned: bool

    @classmethod
    def resolve(cls, option: bool | None) -> HostPolicy:
        """``option`` (the loader's ``host_tuning``) when given, else the environment's word."""
        if option is not None:
            return cls(bool(option))
        return cls(os.environ.get(ENV, "1").strip().lower() not in _OFF)

    @property
    def main_builds(self) -> bool:
        """Whether the main process may build a batch no worker has started."""
        return self.tuned and claims.available()

    def consumer_core(self) -> ConsumerCore | None:
        """The fast path's placement of its workers (``None``: they run anywhere)."""
        return ConsumerCore() if self.tuned else None

    def worker(self, core: ConsumerCore | None) -> WorkerHost:
        """What the next worker started applies to itself, with ``core``'s placement now."""
        return WorkerHost(self.tuned, None if core is None else core.worker_cpus)


__all__ = ["ENV", "HostPolicy", "WorkerHost"]
