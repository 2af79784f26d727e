"""fastload's own threads (layer 0: imports nothing of ours).

Every thread the library starts is made by :func:`own_thread`, so that code which may run on
any thread can tell whether it runs on one of ours (:func:`on_own_thread`). That matters for
one kind of code: a finalizer. The cyclic garbage collector runs wherever an allocation
crosses its threshold, so an iterator dropped in a reference cycle (a loop ended by an
exception the caller kept, say) may be finalized on the engine's own thread, in the middle of
a step, with the engine's lock held. Closing the iterator there would wait for that lock
forever, and the collector with it: no cycle in the process would be collected again (NOTE
[closing from a finalizer] in ``_loader/_iterators.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

_OWN: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def own_thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread named ``name`` running ``target(*args)``, known as fastload's own; not
    started."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _OWN.add(thread)
    return thread


def start_own_thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """:func:`own_thread`, started."""
    thread = own_thread(target, name, args)
    thread.start()
    return thread


def on_own_thread() -> bool:
    """Whether the calling thread is one fastload started."""
    return threading.current_thread() in _OWN


__all__ = ["on_own_thread", "own_thread", "start_own_thread"]
