"""The one decision fastload takes about the host's scheduler, behind one switch.

**Leaving workers at nice 19**: a worker's exit (the kernel taking apart the address
space fork copied, 5-9 ms with torch loaded) then does not compete with the consumer and the
next epoch's workers starting. It is kept because a paired measurement showed a later epoch's
start faster with it (``benchmarks/README.md``, "Host tuning"); the other mechanisms once here
(workers held off the consumer's CPU, the main process building batches while it waited) did
not pay beyond noise when measured again, and went.

``HostPolicy.resolve`` turns it on or off: the loader's ``host_tuning=`` option, else the
environment variable ``FASTLOAD_HOST_TUNING`` (``0``, ``false``, ``off`` or ``no``: off), else
on. The batches and their order are the same either way.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

ENV = "FASTLOAD_HOST_TUNING"
_OFF = frozenset({"0", "false", "off", "no"})


@dataclass(frozen=True)
class WorkerHost:
    """What a worker applies to itself (pickled into its spec): ``tuned`` says whether the
    policy is on."""

    tuned: bool = False

    def leave(self) -> None:
        """In a worker that is about to exit: the lowest priority."""
        if self.tuned:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 19)


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

    def worker(self) -> WorkerHost:
        """What each worker started applies to itself."""
        return WorkerHost(self.tuned)


__all__ = ["ENV", "HostPolicy", "WorkerHost"]
