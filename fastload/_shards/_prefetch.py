"""Bringing a remote dataset's shards to the local disk ahead of the step, in the order the
epoch's plan reads them, and making room in a bounded cache the way the plan says.

The loader knows its epoch in advance: the batches its sampler will yield, in order. A
:class:`ShardPrefetcher` in the main process walks them ahead of the consumer and downloads the
shards they read, each once, in order of first use, with a few downloads at a time (threads: the
transfers release the GIL). Where the cache is bounded it makes room as Belady's rule says:
evict the shard whose next use is furthest away (or never), and never one needed sooner than the
shard it makes room for; when no such room can be made, the prefetcher waits for the consumer to
move on. A shard fetched during this epoch (by the prefetcher or a worker) is never evicted while
the epoch still reads it: it would be fetched twice, so only shards the epoch is done with, and
shards cached before it began, make room (with a cache of two shard windows, each shard is then
fetched at most once per epoch). The workers read shards from the cache; one whose shard has not arrived downloads it
itself (the first batch waits for its own shard only), so prefetching is never needed for
correctness, only for speed.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload._shards._remote_source import RemoteSource
from fastload._threads import start_own_thread

_log = logging.getLogger("fastload")

#: Batches of the plan mapped to shards at a time (the walk ahead is lazy, chunk by chunk).
_CHUNK = 512
_IDLE_S = 0.02


@dataclass
class PrefetchStats:
    """What the prefetcher did: shards it downloaded and their bytes and seconds, and shards it
    found in the cache already (a hit: this epoch downloads nothing for them)."""

    downloaded: int = 0
    downloaded_bytes: int = 0
    download_s: float = 0.0
    hits: int = 0


class ShardPrefetcher:
    """Downloads the shards of ``batches`` (sample-index arrays, the rank's epoch from its next
    batch on) ahead of the consumer, whose progress ``consumed()`` gives (batches delivered since
    the prefetcher started), from ``source`` into its cache; ``starts`` are the shards' first
    samples (and the end). ``concurrency`` downloads run at once; ``ahead`` bounds how many
    shards past the consumer's current one are fetched when the cache is unbounded."""

    def __init__(
        self,
        source: RemoteSource,
        starts: npt.NDArray[np.int64],
        batches: Iterator[npt.NDArray[np.int64]],
        consumed: Callable[[], int],
        *,
        concurrency: int = 4,
        ahead: int = 64,
    ) -> None:
        self._source = source
        self._starts = np.asarray(starts)
        self._batches = batches
        self._consumed = consumed
        self._concurrency = max(1, int(concurrency))
        self._ahead = max(1, int(ahead))
        self.stats = PrefetchStats()
        self.error: BaseException | None = None
        # The plan as far as walked: each shard's uses (batch positions), in order.
        self._uses: dict[int, list[int]] = {}
        self._order: list[int] = []  # shards in order of first use
        self._walked = 0  # batches mapped so far
        self._exhausted = False
        self._done: set[int] = set()  # shards known to be in the cache
        # Keys cached before this epoch: the only live shards eviction may take (see the module).
        self._before: set[str] | None = None
        self._flight: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._planner = start_own_thread(self._run, "fastload-prefetch")

    # -- the walk over the plan ------------------------------------------------------------------

    def _walk(self, until: int) -> None:
        """Map batches to shards until ``until`` batches are walked or the plan ends."""
        while not self._exhausted and self._walked < until:
            chunk: list[npt.NDArray[np.int64]] = []
            for batch in self._batches:
                chunk.append(np.asarray(batch, dtype=np.int64))
                if len(chunk) == _CHUNK:
                    break
            else:
                self._exhausted = True
            if not chunk:
                break
            sizes = np.fromiter((b.size for b in chunk), dtype=np.int64, count=len(chunk))
            flat = np.concatenate(chunk) if chunk else np.zeros(0, np.int64)
            shard = np.searchsorted(self._starts, flat, side="right") - 1
            position = np.repeat(np.arange(self._walked, self._walked + len(chunk)), sizes)
            pairs = np.unique(np.stack((position, shard)), axis=1)  # by batch, then shard
            for b, s in zip(pairs[0].tolist(), pairs[1].tolist(), strict=True):
                uses = self._uses.get(s)
                if uses is None:
                    self._uses[s] = [b]
                    self._order.append(s)
                elif uses[-1] != b:
                    uses.append(b)
            self._walked += len(chunk)

    def _next_use(self, shard: int, now: int) -> float:
        uses = self._uses.get(shard)
        if not uses:
            return math.inf
        at = _first_at_or_after(uses, now)
        return math.inf if at is None else float(at)

    # -- the planner thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._step():
                    self._wake.wait(_IDLE_S)
                    self._wake.clear()
        except BaseException as exc:  # the workers download what they need: warn, not raise
            self.error = exc
            _log.warning("fastload: prefetching shards stopped: %s: %s", type(exc).__name__, exc)

    def _step(self) -> bool:
        """Start what can start now; False when there is nothing to do until something changes."""
        if self._before is None:
            self._before = set(self._source.cache().shards())
        now = self._consumed()
        self._walk(now + _CHUNK)
        with self._lock:
            if len(self._flight) >= self._concurrency:
                return False
        limit = self._source.cache_limit
        if limit is not None:
            self._keep_to_limit(now)
        started = False
        candidates = 0
        for shard in self._order:
            if self._stop.is_set():
                return started
            next_use = self._next_use(shard, now)
            if next_use == math.inf:
                continue  # used only by batches already consumed
            with self._lock:
                if shard in self._done or shard in self._flight:
                    continue
            candidates += 1
            if limit is None and candidates > self._ahead:
                break
            if self._source.cached(shard):
                with self._lock:
                    self._done.add(shard)
                self.stats.hits += 1
                continue
            if limit is not None and not self._make_room(shard, next_use, now):
                break  # nothing evictable is needed later than this shard: wait for the consumer
            self._start(shard)
            started = True
            with self._lock:
                if len(self._flight) >= self._concurrency:
                    break
        return started

    def _keep_to_limit(self, now: int) -> None:
        """Over the limit (a worker downloads a shard it needs before the prefetcher may, and a
        cache filled by an earlier epoch may hold more than this plan keeps): evict the shards
        no batch ahead reads, and only those. Shards needed ahead stay even over the limit:
        evicting one would only fetch it again (the limit is exceeded by at most the shards
        the workers read now and next)."""
        source = self._source
        cache = source.cache()
        shards = cache.shards()
        over = sum(shards.values()) - (source.cache_limit or 0)
        if over <= 0:
            return
        ahead = {source.key(s) for s in self._uses if self._next_use(s, now) != math.inf}
        for key in sorted(shards):
            if over <= 0:
                break
            if key not in ahead:
                over -= cache.evict(key) or 0

    def _make_room(self, shard: int, next_use: float, now: int) -> bool:
        """Evict, furthest next use first, only shards needed later than ``shard`` (or never),
        until ``shard`` fits; False (nothing evicted) when that cannot make it fit."""
        source = self._source
        cache = source.cache()
        need = source.index.shards[shard].bytes
        keys = {source.key(s): s for s in self._uses}
        uses = {key: self._next_use(s, now) for key, s in keys.items()}
        before = self._before or set()
        for key, use in uses.items():
            if use != math.inf and key not in before:
                uses[key] = -math.inf  # fetched this epoch and read again: never evicted
        limit = source.cache_limit
        assert limit is not None  # an unbounded cache has room for every shard
        used = cache.usage()
        if used + need <= limit:
            return True
        freeable = sum(
            size for key, size in cache.shards().items() if uses.get(key, math.inf) > next_use
        )
        if used - freeable + need > limit:
            return False
        # Downloads in flight may publish between the count above and the eviction: bounded by
        # ``later_than``, the eviction then leaves it short instead of dropping a shard needed
        # sooner (which would be fetched twice in the epoch).
        evicted = cache.make_room(need, uses, later_than=next_use)
        before.difference_update(evicted)  # fetched again, it counts as this epoch's
        return cache.usage() + need <= limit

    def _start(self, shard: int) -> None:
        with self._lock:
            self._flight.add(shard)
        thread = start_own_thread(self._download, f"fastload-fetch-{shard}", (shard,))
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _download(self, shard: int) -> None:
        started = time.perf_counter()
        try:
            before = self._source.cached(shard)
            self._source.local_path(shard, counted=False)
            if not before:
                self.stats.downloaded += 1
                self.stats.downloaded_bytes += self._source.index.shards[shard].bytes
                self.stats.download_s += time.perf_counter() - started
        except BaseException as exc:  # the worker that needs it downloads it and says why
            self.error = exc
            _log.warning("fastload: prefetching %s failed: %s: %s", self._source.urls[shard], type(exc).__name__, exc)
        finally:
            with self._lock:
                self._flight.discard(shard)
                self._done.add(shard)
            self._wake.set()

    def downloaded_bytes(self) -> int:
        """Bytes this prefetcher downloaded so far (``fastload._protocols.ShardPrefetch``)."""
        return self.stats.downloaded_bytes

    def close(self, join_s: float = 5.0) -> None:
        """Stop walking; let downloads in flight finish (a shard is never left half-written:
        the cache publishes only whole, verified files) for up to ``join_s``."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + join_s
        self._planner.join(max(0.0, deadline - time.monotonic()))
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _first_at_or_after(uses: list[int], now: int) -> int | None:
    at = bisect.bisect_left(uses, now)
    return uses[at] if at < len(uses) else None


__all__ = ["PrefetchStats", "ShardPrefetcher"]
