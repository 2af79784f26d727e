"""``LoaderStats``: one snapshot of how the data loader and the training step share the time,
and ``diagnose``: the one line that says what to change.

Vocabulary. The consumer (the training loop) alternates between *wait* — blocked inside
``next()`` — and *step* — everything between two ``next()`` calls. The *stall fraction*
``wait / (wait + step)`` is the share of the loop's time the device would sit idle for want of
data. The first batch of each epoch is start-up (from the call to ``iter()``: workers starting,
files opening), reported as ``first_batch_s`` and kept out of the stall fraction and the wait
quantiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Stall fraction under which the loader keeps up: the step is the bottleneck.
STALL_OK = 0.02
#: Mean worker busy fraction from which workers count as saturated (adding one helps).
BUSY_SATURATED = 0.80
#: Share of the workers' busy time spent in reads from which a stall is blamed on storage.
READ_BOUND_SHARE = 0.50
#: Steady batches (after each epoch's first) needed before a diagnosis is more than a guess.
MIN_BATCHES = 10


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of the loader's metrics over one scope (an epoch, or the run so far).

    Times are seconds unless the name says ``_ms``; fractions are in ``[0, 1]``. ``None`` means
    unknown (not measured by whoever built the snapshot), never zero.

    Consumer side (measured by :class:`~fastload._metrics.StallMeter`):

    * ``scope``: ``"epoch"`` (one epoch) or ``"run"`` (every epoch so far).
    * ``epoch``: the epoch the snapshot covers (the latest one for a run-wide snapshot), numbered
      as the loader's sampler numbers it (``set_epoch``), else from 0; the same number as in
      ``loader.epoch_stats``.
    * ``epochs``: the epochs a run-wide snapshot covers (1 for an epoch's).
    * ``batches``, ``samples``: delivered to the consumer, first batches included, over the
      scope (a run-wide snapshot's are the run's totals).
    * ``epoch_batches``: in a run-wide snapshot, the batches of its latest epoch alone.
    * ``steady_batches``: the batches that count toward the stall: all but each epoch's first.
    * ``wait_s``, ``step_s``: time inside ``next()`` and between ``next()`` calls, each
      epoch's first batch excluded.
    * ``stall_fraction``: ``wait_s / (wait_s + step_s)``; 0 when both are 0.
    * ``p50_wait_ms``, ``p99_wait_ms``: quantiles of the per-batch wait (milliseconds, within
      2.5 %), first batches excluded.
    * ``first_batch_s``: time from the call to ``iter()`` to the first batch (of this epoch; of
      the first epoch for a run-wide snapshot).
    * ``samples_per_s``, ``batches_per_s``, ``padded_tokens_per_s``: consumed per second of
      ``wait_s + step_s`` (steady state; start-up is in ``first_batch_s``).
    * ``padding_efficiency``: real tokens / padded tokens over all batches (1.0 = no padding).
    * ``packing_efficiency``: for packed batches, in place of ``padding_efficiency``: real
      tokens / (rows × seq_len) over all batches. (``samples`` then counts rows.)

    Loader side (from the engine; defaults say "not reported"):

    * ``queue_depth``: batches ready but not yet taken by the consumer.
    * ``slots_in_use``: shared-memory batch slots held by workers, the queue or the consumer.
    * ``worker_busy``: per worker, the share of its time spent reading and collating.
    * ``worker_read_share``: of all workers' busy time, the share spent in reads. Samples that
      fastload's readers leave in the memory map are read by the gather into the batch slot,
      so for them that gather counts as reading.
    * ``num_workers``, ``respawns``, ``retries``, ``skipped_samples``: counts.
    * ``fast_path``: whether batches are built by the dataset's ``read_batch`` and a slot
      collate (``None``: not known); the diagnosis suggests the fast path only without it.
    * ``gpu_idle_s`` (with ``device="cuda"``): time the GPU sat between finishing the work queued
      before a ``next()`` and the batch it returned being on the device, measured with CUDA
      events (host-side waiting overstates the stall while kernels are still queued).
    * ``sources`` (with a :class:`~fastload.MixtureBatchSampler`): per source, the samples and
      tokens delivered in the epoch and in the run, as ``MixtureBatchSampler.consumed()`` gives.

    Remote datasets (``s3://``, ``gs://``, ``https://``; all ``None`` for local files):

    * ``downloaded_bytes``: shard bytes downloaded, by the prefetcher and by reads that could
      not wait for it; ``download_mb_per_s`` those per second of the scope (its steps, waits
      and first batch).
    * ``cache_hits``, ``cache_misses``: reads of a shard (one per field and shard a batch
      touches) that found it in the local cache, or had to wait for its download.
    * ``storage_wait_s``: the seconds those reads waited (workers' and the main process's);
      ``storage_wait_share`` that as a share of the workers' busy time (without workers, of
      the consumer's wait, where the reads run).

    ``diagnosis``: :func:`diagnose` of the rest, one actionable line.

    ``preflight``: what the checks run as the loader started found (missing native kernels, a
    small ``/dev/shm``, low limits, ...), one line each; ``fastload.doctor(loader)`` says what
    to change.
    """

    epoch: int = 0
    scope: str = "epoch"
    epochs: int = 1
    batches: int = 0
    epoch_batches: int | None = None
    steady_batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    stall_fraction: float = 0.0
    p50_wait_ms: float | None = None
    p99_wait_ms: float | None = None
    first_batch_s: float | None = None
    samples_per_s: float = 0.0
    batches_per_s: float = 0.0
    padded_tokens_per_s: float | None = None
    padding_efficiency: float | None = None
    packing_efficiency: float | None = None
    queue_depth: int | None = None
    slots_in_use: int | None = None
    worker_busy: tuple[float, ...] = ()
    worker_read_share: float | None = None
    num_workers: int = 0
    respawns: int = 0
    retries: int = 0
    skipped_samples: int = 0
    gpu_idle_s: float | None = None
    fast_path: bool | None = None
    downloaded_bytes: int | None = None
    download_mb_per_s: float | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    storage_wait_s: float | None = None
    storage_wait_share: float | None = None
    sources: dict[str, Any] | None = None
    diagnosis: str = ""
    preflight: tuple[str, ...] = ()

    @property
    def mean_worker_busy(self) -> float | None:
        """The workers' mean busy fraction, ``None`` when the engine reported none."""
        return sum(self.worker_busy) / len(self.worker_busy) if self.worker_busy else None

    def with_diagnosis(self) -> LoaderStats:
        """This snapshot with ``diagnosis`` computed from its other fields."""
        return dataclasses.replace(self, diagnosis=diagnose(self))

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-serializable (``worker_busy`` as a list)."""
        data = dataclasses.asdict(self)
        data["worker_busy"] = list(self.worker_busy)
        data["preflight"] = list(self.preflight)
        return data

    def __str__(self) -> str:
        if self.scope == "run":
            latest = "" if self.epoch_batches is None else f" ({self.epoch_batches:,} in epoch {self.epoch})"
            parts = [
                f"run ({self.epochs} epoch{'' if self.epochs == 1 else 's'}, latest {self.epoch})",
                f"{self.batches:,} batches in all{latest}",
            ]
        else:
            parts = [f"epoch {self.epoch}", f"{self.batches:,} batches"]
        parts += [
            f"{self.samples_per_s:,.0f} samples/s",
            f"stall {self.stall_fraction * 100:.1f} %",
        ]
        if self.p99_wait_ms is not None:
            parts.append(f"p99 wait {self.p99_wait_ms:.1f} ms")
        if self.first_batch_s is not None:
            parts.append(f"first batch {self.first_batch_s:.2f} s")
        if self.padding_efficiency is not None:
            parts.append(f"padding efficiency {self.padding_efficiency * 100:.0f} %")
        if self.packing_efficiency is not None:
            parts.append(f"packing efficiency {self.packing_efficiency * 100:.1f} %")
        if self.gpu_idle_s is not None:
            parts.append(f"GPU idle {self.gpu_idle_s:.3f} s")
        if self.downloaded_bytes is not None:
            parts.append(
                f"downloaded {self.downloaded_bytes / 1e6:,.1f} MB, cache hits "
                f"{self.cache_hits:,} misses {self.cache_misses:,}"
            )
        busy = self.mean_worker_busy
        workers = f"{self.num_workers} workers"
        parts.append(workers if busy is None else f"{workers} busy {busy * 100:.0f} %")
        if self.diagnosis:
            parts.append(self.diagnosis)
        parts.extend(f"preflight: {line} (see fastload.doctor(loader))" for line in self.preflight)
        return " | ".join(parts)


def diagnose(stats: LoaderStats) -> str:
    """One line saying what bounds the training loop and what to change.

    * fewer than :data:`MIN_BATCHES` steady batches: a neutral "not enough data" line;
    * stall fraction under :data:`STALL_OK`: **consumer-bound** — the loader is fine;
    * otherwise the loader is too slow, and the line says why:

      - workers busy at least :data:`BUSY_SATURATED` and spending at least
        :data:`READ_BOUND_SHARE` of that time in reads: **IO-bound**;
      - workers busy at least :data:`BUSY_SATURATED`: **loader-bound**, add workers;
      - workers mostly idle while the consumer waits (a worker's busy time includes its reads,
        so this is not storage): **delivery-bound** — the main process receiving batches is
        the bottleneck;
      - reads of a remote dataset waiting on downloads for at least :data:`READ_BOUND_SHARE`
        of their time: **storage-bound**, with what to change (download concurrency, the
        cache, the shards);
      - ``num_workers == 0``: loader-bound, loading runs in the training process;
      - worker time unknown: loader-bound, judged from the stall alone.

      The fast path is advised only to a loader known not to be on it (``fast_path``).
    """
    if stats.steady_batches < MIN_BATCHES:
        return (
            f"not enough data yet: {stats.steady_batches} steady batches measured, "
            f"{MIN_BATCHES} needed"
        )
    stall = f"{stats.stall_fraction * 100:.0f} %"
    if stats.stall_fraction < STALL_OK:
        return "consumer-bound: the step is the bottleneck, the loader is fine"
    share = stats.storage_wait_share
    if share is not None and share >= READ_BOUND_SHARE:
        return _storage_bound(stats, share, stall)
    if stats.num_workers == 0:
        return (
            f"loader-bound: loading runs in the training process (num_workers=0) and the step "
            f"waits {stall} of the time, add workers" + _cheaper_batches(stats)
        )
    busy = stats.mean_worker_busy
    if busy is None:
        return f"loader-bound: the step waits {stall} of the time, add workers" + _cheaper_batches(stats)
    if busy >= BUSY_SATURATED:
        share = stats.worker_read_share
        if share is not None and share >= READ_BOUND_SHARE:
            return (
                f"IO-bound: workers mostly waiting on reads ({share * 100:.0f} % of their busy "
                f"time); the step waits {stall} of the time: use a contiguous, uncompressed "
                "file on faster storage, or more workers to overlap the reads"
            )
        return f"loader-bound: workers busy {busy * 100:.0f} %, add workers" + _cheaper_batches(stats)
    idle = (
        f"delivery-bound: workers idle {100 - busy * 100:.0f} % of the time while the step waits "
        f"{stall}: the main process receiving batches is the bottleneck; "
    )
    if stats.fast_path:
        return idle + "the loader is already on the fast path: raise prefetch_factor"
    if stats.fast_path is None:
        return idle + f"use {_FAST_PATH} if it is not on it, or raise prefetch_factor"
    return idle + f"use {_FAST_PATH} or raise prefetch_factor"


_FAST_PATH = "the fast path (a dataset with read_batch and lengths, and PadCollate)"


def _cheaper_batches(stats: LoaderStats) -> str:
    """For a loader known to be off the fast path: the cheaper way to build its batches."""
    if stats.fast_path is False:
        return f", or use {_FAST_PATH}, which builds a batch in one call"
    return ""


def _storage_bound(stats: LoaderStats, share: float, stall: str) -> str:
    rate = stats.download_mb_per_s
    fetched = f"{rate:,.1f} MB/s from the store, " if rate is not None else ""
    return (
        f"storage-bound: reads waited on shard downloads {share * 100:.0f} % of their time "
        f"({fetched}{stats.cache_misses or 0:,} cache misses) and the step waits {stall} of the "
        "time: raise download_concurrency, give the cache room for the shards a window "
        "reads (cache_limit of at least shuffle_shards shards), or write larger shards"
    )
