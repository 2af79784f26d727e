"""``StallMeter``: splits the consumer's time into waiting for batches and stepping on them.

The meter is driven by three calls from the thread that consumes batches (it is not
thread-safe): ``begin_wait()`` as ``next()`` is entered, ``end_wait(...)`` as it returns a
batch, ``end_epoch()`` when the epoch is over. A caller whose own work in ``next()`` should
count as waiting (the loader's iterator) takes both times itself, as the first and last
statements of ``next()``, and passes them to :meth:`StallMeter.record`: the caller's clock and
the meter then agree, which they do not when the meter's calls sit inside ``next()``. From those it keeps, per epoch and for the whole
run, the total wait and step, counts of batches, samples and tokens, the time to each epoch's
first batch and a :class:`~fastload._metrics._histogram.LogHistogram` of the per-batch waits —
constant memory however long the run.

Timeline of one epoch (``|`` = a ``next()`` returning a batch)::

    begin ─ first wait ─| step 1 |─ wait 2 ─| step 2 |─ wait 3 ─| ... | step n |─ begin (StopIteration)
            start-up      ────────── steady: counted in the stall fraction ──────────

* The first wait of an epoch is start-up: it becomes ``first_batch_s`` and is kept out of the
  stall fraction and the quantiles. It counts from ``start_epoch(at)`` where the caller gives
  it (the loader: the call to ``iter()``, which starts workers and opens shards), else from the
  first ``begin_wait()``.
* Epochs are numbered by ``start_epoch(at, epoch)`` (the loader passes its sampler's epoch),
  else one after the other from 0; an epoch-scope snapshot taken between two epochs is the
  one just ended, a run-scope one names the latest epoch and counts it apart.
* A step runs from one ``end_wait`` to the next ``begin_wait``; the last step of an epoch is
  counted when ``begin_wait()`` is called for the ``next()`` that ends the epoch. A step still
  open at ``end_epoch()`` (the loop broke out) is not counted: its end is unknown.
* A wait still open at ``end_epoch()`` or at the next ``begin_wait()`` (that ``next()`` raised)
  is dropped: it delivered no batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from fastload._metrics._clock import Clock
from fastload._metrics._histogram import LogHistogram
from fastload._metrics._stats import LoaderStats
from fastload._types import StorageCounts

#: Fields of :class:`LoaderStats` that the meter cannot measure and ``snapshot`` accepts from
#: the engine (``epoch`` too, to label the snapshot with the loader's own epoch number).
ENGINE_FIELDS = frozenset(
    {
        "epoch",
        "queue_depth",
        "slots_in_use",
        "worker_busy",
        "worker_read_share",
        "num_workers",
        "respawns",
        "retries",
        "skipped_samples",
        "gpu_idle_s",
    }
)


#: Logged waits folded into the totals at the latest after this many entries (bounded memory;
#: one fold costs a few hundred microseconds).
_FOLD_EVERY = 512


@dataclass
class _Totals:
    """Running sums over one scope (an epoch, or the run)."""

    wait_s: float = 0.0
    step_s: float = 0.0
    batches: int = 0
    steady_batches: int = 0
    samples: int = 0
    stepped_samples: int = 0  # samples of batches whose step has been timed
    stepped_batches: int = 0
    stepped_padded_tokens: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    tokens_known: bool = True  # False once any batch came without token counts
    first_batch_s: float | None = None
    waits: LogHistogram = field(default_factory=LogHistogram)
    # Reads of a remote dataset (None: local): by the workers and the main process, and what
    # the shard prefetcher downloaded; storage_busy_s is the workers' busy time they fall in.
    storage: StorageCounts | None = None
    prefetched_bytes: int = 0
    storage_busy_s: float = 0.0

    def absorb(self, other: _Totals) -> None:
        """Add ``other`` (a later scope: an epoch that ended) to these totals."""
        for name in (
            "wait_s", "step_s", "batches", "steady_batches", "samples", "stepped_samples",
            "stepped_batches", "stepped_padded_tokens", "real_tokens", "padded_tokens",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.tokens_known = self.tokens_known and other.tokens_known
        if other.storage is not None:
            self.storage = other.storage if self.storage is None else self.storage + other.storage
        self.prefetched_bytes += other.prefetched_bytes
        self.storage_busy_s += other.storage_busy_s
        if self.first_batch_s is None:
            self.first_batch_s = other.first_batch_s
        self.waits.absorb(other.waits)


@dataclass(frozen=True)
class _Batch:
    samples: int
    padded_tokens: int | None


class StallMeter:
    """Measures wait and step of the consumer; see the module docstring for the timeline.

    ``clock`` returns monotonic seconds (default :func:`time.perf_counter`; a
    :class:`~fastload._metrics.ManualClock` in tests).
    """

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self._clock = clock
        #: Whether the batches are packed: the real share of their tokens is then reported as
        #: ``packing_efficiency`` (their padded tokens are rows × seq_len).
        self.packing = False
        # begin_wait/end_wait only log a timestamp (they run inside next(), where every
        # microsecond is stall); the log is folded into the totals when they are read.
        # Entries: a float (a begin), a tuple or a list (an end: time, samples, real and
        # padded tokens; a list from record(), whose time is None until its caller sets it).
        self._log: list[Any] = []
        self._open_wait = False
        self._epoch = 0  # the current epoch's number, or the next one's until it starts
        self._started = False  # whether the current epoch has started (start_epoch or a batch)
        self._epoch_started_at: float | None = None  # start_epoch's time, until the first batch
        self._ended_epochs = 0
        self._last: tuple[int, _Totals] | None = None  # the epoch ended last: number, totals
        #: Whether the loader builds batches on the fast path (``read_batch`` and a slot collate);
        #: ``None`` unknown. The diagnosis advises the fast path only to a loader not on it.
        self.fast_path: bool | None = None
        # Batches are counted into the epoch's totals only; an ended epoch is added to the
        # earlier epochs' (half the work per batch of keeping both up to date).
        self._earlier = _Totals()
        self._current = _Totals()
        self._wait_started: float | None = None
        self._step_started: float | None = None
        self._stepping: _Batch | None = None  # the batch the open step works on

    @property
    def epoch(self) -> int:
        """The current epoch's number (before it starts: the number it will have)."""
        return self._epoch

    def start_epoch(self, at: float, epoch: int | None = None) -> None:
        """An epoch starts: ``iter()`` was called at ``at`` (a time of this meter's clock), and
        its first batch counts from then. ``epoch`` numbers it (default: the number after the
        previous epoch's). An epoch left without :meth:`end_epoch` (the loop broke off) is
        closed first: its batches stay in the run's totals, without a summary."""
        self._fold()
        if self._current.batches:
            self._close_epoch()
        if epoch is not None:
            self._epoch = int(epoch)
        self._started = True
        self._epoch_started_at = at

    @property
    def wait_s(self) -> float:
        """The run's steady wait so far (seconds); cheap, for per-batch callers such as
        :class:`~fastload._metrics.AutoTuner`."""
        self._fold()
        return self._earlier.wait_s + self._current.wait_s

    @property
    def step_s(self) -> float:
        """The run's step time so far (seconds); cheap, like :attr:`wait_s`."""
        self._fold()
        return self._earlier.step_s + self._current.step_s

    def begin_wait(self, at: float | None = None) -> None:
        """The consumer enters ``next()`` (at ``at``, a time of this meter's clock taken by the
        caller; default now): closes the open step, if any, and starts a wait."""
        self._log.append(self._clock() if at is None else at)
        self._open_wait = True

    def end_wait(
        self,
        samples: int,
        real_tokens: int | None = None,
        padded_tokens: int | None = None,
        *,
        at: float | None = None,
    ) -> None:
        """``next()`` returned (at ``at``; default now) a batch of ``samples`` rows holding
        ``real_tokens`` tokens in a padded tensor of ``padded_tokens`` (rows * padded length;
        ``None`` when the batch has no ragged field or the caller does not know). Starts the
        step on it."""
        now = self._clock() if at is None else at
        if not self._open_wait:
            raise RuntimeError("StallMeter.end_wait() called without a matching begin_wait()")
        if samples < 0 or (real_tokens or 0) < 0 or (padded_tokens or 0) < 0:
            raise ValueError(
                f"StallMeter.end_wait: counts must be >= 0; got samples={samples}, "
                f"real_tokens={real_tokens}, padded_tokens={padded_tokens}"
            )
        self._open_wait = False
        self._log.append((now, samples, real_tokens, padded_tokens))
        if len(self._log) >= _FOLD_EVERY:
            self._fold()

    def record(
        self, begin: float, samples: int, real_tokens: int | None = None, padded_tokens: int | None = None
    ) -> list[Any]:
        """``next()`` began at ``begin`` (a time of this meter's clock) and is about to return a
        batch: :meth:`begin_wait` and :meth:`end_wait` in one call, for a caller that takes
        the times itself. Returns the batch's entry; the caller stores the time ``next()``
        returns at in its item 0, as its very last statement, so that the wait covers all of
        ``next()`` that a clock inside it can see, this call included. The counts are the
        caller's own and not checked."""
        if len(self._log) >= _FOLD_EVERY:
            self._fold()
        log = self._log
        entry: list[Any] = [None, samples, real_tokens, padded_tokens]
        log.append(begin)
        log.append(entry)
        return entry

    def _fold(self) -> None:
        log, self._log = self._log, []
        if log and type(log[-1]) is list and log[-1][0] is None:  # its next() has not returned
            self._log = log[-2:]
            del log[-2:]
        i, n = 0, len(log)
        while i < n:
            if self._stepping is not None and self._current.batches:
                i = self._fold_steady(log, i)
                if i == n:
                    break
            entry = log[i]
            if isinstance(entry, (tuple, list)):
                self._apply_end(*entry)
            else:
                self._apply_begin(entry)
            i += 1

    def _fold_steady(self, log: list[Any], i: int) -> int:
        """Fold the run of steady batches at ``log[i:]`` — a begin, then an end with token
        counts, after a batch whose step is open — in one loop over local variables, and return
        where the run stops. The arithmetic is :meth:`_apply_begin` and :meth:`_apply_end`'s, in
        the same order (the same floats to the last bit), without their two calls, attribute
        writes and a ``_Batch`` per batch: a tenth of the time."""
        stepping, step_started = self._stepping, self._step_started
        if stepping is None or step_started is None or stepping.padded_tokens is None:
            return i
        prev_samples, prev_padded = stepping.samples, stepping.padded_tokens
        t = self._current
        wait_s, step_s, batches, steady = t.wait_s, t.step_s, t.batches, t.steady_batches
        samples_sum, real_sum, padded_sum = t.samples, t.real_tokens, t.padded_tokens
        stepped, stepped_samples, stepped_padded = t.stepped_batches, t.stepped_samples, t.stepped_padded_tokens
        waits: list[float] = []
        start, n = i, len(log) - 1
        while i < n:
            begin, end = log[i], log[i + 1]
            if type(begin) is not float or (type(end) is not tuple and type(end) is not list):
                break
            now, samples, real, padded = end
            if real is None or padded is None:
                break
            step_s += max(0.0, begin - step_started)
            stepped += 1
            stepped_samples += prev_samples
            stepped_padded += prev_padded
            wait = max(0.0, now - begin)
            wait_s += wait
            steady += 1
            waits.append(wait)
            batches += 1
            samples_sum += samples
            real_sum += real
            padded_sum += padded
            step_started, prev_samples, prev_padded = now, samples, padded
            i += 2
        if i == start:
            return i
        t.wait_s, t.step_s, t.batches, t.steady_batches = wait_s, step_s, batches, steady
        t.samples, t.real_tokens, t.padded_tokens = samples_sum, real_sum, padded_sum
        t.stepped_batches, t.stepped_samples, t.stepped_padded_tokens = stepped, stepped_samples, stepped_padded
        t.waits.record_all(waits)
        self._wait_started = None
        self._step_started = step_started
        self._stepping = _Batch(prev_samples, prev_padded)
        return i

    def _apply_begin(self, now: float) -> None:
        if self._step_started is not None and self._stepping is not None:
            totals = self._current
            totals.step_s += max(0.0, now - self._step_started)
            totals.stepped_batches += 1
            totals.stepped_samples += self._stepping.samples
            if self._stepping.padded_tokens is not None:
                totals.stepped_padded_tokens += self._stepping.padded_tokens
        self._step_started = None
        self._stepping = None
        self._wait_started = now

    def _apply_end(
        self, now: float, samples: int, real_tokens: int | None, padded_tokens: int | None
    ) -> None:
        assert self._wait_started is not None
        wait = max(0.0, now - self._wait_started)
        totals = self._current
        if totals.batches == 0:
            started = self._epoch_started_at
            totals.first_batch_s = wait if started is None else max(wait, now - started)
            self._epoch_started_at = None
            self._started = True
        else:
            totals.wait_s += wait
            totals.steady_batches += 1
            totals.waits.record(wait)
        totals.batches += 1
        totals.samples += samples
        if real_tokens is None or padded_tokens is None:
            totals.tokens_known = False
        else:
            totals.real_tokens += real_tokens
            totals.padded_tokens += padded_tokens
        self._wait_started = None
        self._step_started = now
        self._stepping = _Batch(samples, padded_tokens)

    def add_storage(self, reads: StorageCounts, *, prefetched_bytes: int, busy_s: float) -> None:
        """Count, in the current epoch, what reads of a remote dataset cost since the last call
        (``reads``: the workers' and the main process's), the bytes the shard prefetcher
        downloaded meanwhile and the workers' busy seconds meanwhile (0 without workers: the
        reads then ran inside ``next()``, in the wait)."""
        current = self._current
        current.storage = reads if current.storage is None else current.storage + reads
        current.prefetched_bytes += prefetched_bytes
        current.storage_busy_s += busy_s

    def end_epoch(self) -> LoaderStats:
        """Close the epoch (an open wait is dropped, an open step not counted) and return its
        summary (consumer-side fields only). The next batch starts a new epoch."""
        self._fold()
        self._open_wait = False
        summary = self._summary(self._current, self._epoch, "epoch")
        self._close_epoch()
        return summary

    def _close_epoch(self) -> None:
        self._last = (self._epoch, self._current)
        self._epoch += 1
        self._ended_epochs += 1
        self._started = False
        self._epoch_started_at = None
        self._earlier.absorb(self._current)
        self._current = _Totals()
        self._wait_started = None
        self._step_started = None
        self._stepping = None

    def _summary(self, totals: _Totals, epoch: int, scope: str, **fields: Any) -> LoaderStats:
        stats = self._stats(totals, epoch=epoch, scope=scope, fast_path=self.fast_path, **fields)
        if self.packing:
            efficiency = stats.padding_efficiency
            stats = dataclasses.replace(stats, padding_efficiency=None, packing_efficiency=efficiency)
        return stats.with_diagnosis()

    def snapshot(self, *, scope: str = "run", **engine_fields: Any) -> LoaderStats:
        """The stats so far, over the whole run (``scope="run"``) or the current epoch
        (``scope="epoch"``; between two epochs, the one just ended), with the engine's fields
        (names in :data:`ENGINE_FIELDS`) merged in and the diagnosis computed. A run-scope
        snapshot is labelled with the latest epoch and counts that epoch's batches apart
        (``epoch_batches``)."""
        if scope not in ("run", "epoch"):
            raise ValueError(f"snapshot: scope must be 'run' or 'epoch'; got {scope!r}")
        unknown = set(engine_fields) - ENGINE_FIELDS
        if unknown:
            raise TypeError(
                f"snapshot: unknown engine fields {sorted(unknown)}; accepted: "
                f"{', '.join(sorted(ENGINE_FIELDS))}"
            )
        self._fold()
        epoch, latest = self._epoch, self._current
        if not (self._started or latest.batches) and self._last is not None:
            epoch, latest = self._last  # between two epochs: the one just ended
        if scope == "epoch":
            return self._summary(latest, **{"epoch": epoch, **engine_fields}, scope="epoch")
        totals = _Totals()
        totals.absorb(self._earlier)
        totals.absorb(self._current)
        epochs = self._ended_epochs + (1 if self._current.batches else 0)
        fields = {"epoch": epoch, **engine_fields}
        return self._summary(totals, scope="run", epochs=epochs, epoch_batches=latest.batches, **fields)

    @staticmethod
    def _stats(totals: _Totals, *, epoch: int, scope: str, **engine_fields: Any) -> LoaderStats:
        busy_s = totals.wait_s + totals.step_s
        p50 = totals.waits.quantile(0.50)
        p99 = totals.waits.quantile(0.99)
        tokens = totals.tokens_known and totals.padded_tokens > 0
        fields: dict[str, Any] = {
            "epoch": epoch,
            "scope": scope,
            "batches": totals.batches,
            "steady_batches": totals.steady_batches,
            "samples": totals.samples,
            "wait_s": totals.wait_s,
            "step_s": totals.step_s,
            "stall_fraction": totals.wait_s / busy_s if busy_s > 0 else 0.0,
            "p50_wait_ms": None if p50 is None else p50 * 1e3,
            "p99_wait_ms": None if p99 is None else p99 * 1e3,
            "first_batch_s": totals.first_batch_s,
            "samples_per_s": totals.stepped_samples / busy_s if busy_s > 0 else 0.0,
            "batches_per_s": totals.stepped_batches / busy_s if busy_s > 0 else 0.0,
            "padded_tokens_per_s": (
                totals.stepped_padded_tokens / busy_s if tokens and busy_s > 0 else None
            ),
            "padding_efficiency": totals.real_tokens / totals.padded_tokens if tokens else None,
        }
        fields.update(_storage_fields(totals))
        fields.update(engine_fields)
        if "worker_busy" in fields:
            fields["worker_busy"] = tuple(float(b) for b in fields["worker_busy"])
        return LoaderStats(**fields)


def _storage_fields(totals: _Totals) -> dict[str, Any]:
    """The storage fields of :class:`LoaderStats` (none for a local dataset)."""
    reads = totals.storage
    if reads is None:
        return {}
    downloaded = reads.downloaded_bytes + totals.prefetched_bytes
    elapsed = totals.wait_s + totals.step_s + (totals.first_batch_s or 0.0)
    # Workers' reads fall in their busy time; without workers, reads run inside next().
    reading = totals.storage_busy_s or totals.wait_s + (totals.first_batch_s or 0.0)
    return {
        "downloaded_bytes": downloaded,
        "download_mb_per_s": downloaded / elapsed / 1e6 if elapsed > 0 else None,
        "cache_hits": reads.hits,
        "cache_misses": reads.misses,
        "storage_wait_s": reads.waited_s,
        "storage_wait_share": min(1.0, reads.waited_s / reading) if reading > 0 else None,
    }
