"""``fastload.DataLoader``: torch's DataLoader, constructor and behaviour, on fastload's engine."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
import weakref
from typing import Any, TypeVar, cast

import torch.utils.data

from fastload._capabilities import (
    Capabilities,
    SamplerCapabilities,
    resolve,
    resolve_collate,
    resolve_dataset,
    resolve_sampler,
)
from fastload._loader._iterators import InProcessIterator, WorkerIterator
from fastload._loader._options import LoaderOptions
from fastload._loader._resume import EpochProgress, SkipPositions, worker_resume, worker_state
from fastload._metrics import LoaderStats, StallMeter
from fastload._sampling._stateful import keeps_own_position, stateful_sampler
from fastload._sampling._torch_resume import resumable_torch_sampler
from fastload._sampling._weighted import MixtureBatchSampler
from fastload.errors import RebuiltLoaderWarning

_log = logging.getLogger("fastload")


_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in replacement for :class:`torch.utils.data.DataLoader`.

    Same constructor (signature, defaults, positional order and validation errors), same
    attribute rules and the same batches for the same dataset, sampler, ``collate_fn`` and seed
    — it *is* a ``torch.utils.data.DataLoader`` subclass, so ``isinstance`` checks and frameworks
    that re-create a loader from its constructor arguments keep working. What changes is
    underneath: fastload's own worker engine, which

    * replaces a worker that dies (SIGKILL, segfault) and re-dispatches its unfinished batches,
      so the epoch still delivers every batch exactly once and in order; a batch that kills
      every worker it is given (3 in a row) raises :class:`~fastload.errors.WorkerCrashedError`
      naming the batch and its sample indices;
    * re-raises an exception from a worker with its original type and a message naming the
      worker, the batch and the sample indices, plus the worker's traceback;
    * stops its workers within a bounded time on every exit path (end of epoch, ``break`` and
      garbage collection, ``KeyboardInterrupt``, interpreter exit), and its workers exit by
      themselves when the main process dies;
    * moves tensors and large numpy arrays between processes through shared memory;
    * takes the **fast path** when the dataset offers ``read_batch`` and ``lengths`` (fastload's
      readers do, and so may your own class) and the collate is a :class:`~fastload.PadCollate`
      (the default for such datasets): each worker reads a whole batch in one call and pads it
      straight into a reusable shared-memory slot; the batch you receive is tensors viewing that
      slot, with no copy and no unpickling. A slot is reused only once nothing references its
      tensors, so keeping a batch is always safe.

    fastload's own keyword options (all optional):

    * ``length_grouped=True``: batches of similar-length samples from ``dataset.lengths``
      (:class:`~fastload.LengthGroupedBatchSampler` with ``batch_size``, ``shuffle``,
      ``drop_last`` and ``seed``), padded by ``PadCollate`` unless ``collate_fn`` is given.
    * ``max_tokens=N``: length-grouped batches under a token budget (padded rows × length ≤ N);
      ``batch_size``, when given too, caps the rows.
    * ``pack_length=N``: **sequence packing** — rows of ``N`` tokens, each several whole
      documents back to back (:class:`~fastload.PackedBatchSampler`: ``batch_size`` rows per
      batch, or ``max_tokens // N``; samples longer than ``N`` are split), collated by
      :class:`~fastload.PackCollate` unless ``collate_fn`` is given: ``input_ids``-like fields
      ``[rows, N]``, ``position_ids``, ``labels``, ``document_ids``, ``cu_seqlens`` and
      ``max_seqlen``. Every batch has the same shape; ``stats()`` reports the packing
      efficiency. A ``batch_sampler=PackedBatchSampler(...)`` of your own is read the same way.
    * ``shuffle_shards=K`` (with ``length_grouped``, ``max_tokens`` or ``pack_length``): the
      epoch visits the dataset's shards in a seeded random order, K at a time, and shuffles,
      groups or packs samples within those K only, so a remote dataset needs about K shards in
      its cache at once instead of every shard all epoch (``K`` ≥ the number of shards: the
      global plan). The shards are the dataset's ``shard_sizes``.
    * ``readahead=True`` (local files on a cold or slow disk, a dataset larger than the page
      cache): each worker tells the kernel which byte ranges the batches queued behind its
      current one read (``posix_fadvise(WILLNEED)``, via the dataset's ``willneed``), so the
      disk reads them while the step runs. Off by default: on pages already cached the calls
      cost a fast loader about 40 % of its batches/s (``benchmarks/README.md``).
    * ``download_concurrency`` (a remote dataset): shard downloads run at once ahead of the
      reads, in the order the plan reads them (default 4). ``stats()`` says when the reads
      wait on downloads (``storage_wait_share``) and the diagnosis suggests raising it.
    * ``seed``: the seed of the length-grouped or packed plan (default 0); each ``iter()``
      starts the next epoch, or the one set with :meth:`set_epoch`.
    * ``device="cuda"``: batches arrive on the GPU, each copied on a side stream while the
      previous one trains (pinned slots, ``non_blocking`` copies). Without CUDA, ``"cuda"``
      raises at construction; ``None`` or ``"cpu"`` keeps batches on the host.
    * ``max_shared_bytes``: the most shared memory the batch slots may take (default a quarter
      of the available memory). The slots grow while the consumer keeps batches alive, up to
      this bound, then raise :class:`~fastload.errors.SharedMemoryError`.

    * ``num_workers="auto"``: start with one worker and tune the pool while training runs —
      add a worker while the consumer waits for data more than 2 % of the time and a core and
      1 GiB of memory are free, retire one when the workers idle. The batches and their order do
      not depend on it; ``stats().num_workers`` reports the current count.
    * ``log_every_s``: log :meth:`stats` through the ``logging`` module (logger ``"fastload"``,
      level INFO) this often, and a summary at the end of each epoch.
    * ``progress=True``: a tqdm progress bar with samples/s and the stall fraction.
    * ``host_tuning``: whether a leaving worker drops to the lowest priority, so that its exit
      does not compete with your loop (see the README). ``None`` (default): the environment variable
      ``FASTLOAD_HOST_TUNING`` decides (``0`` turns it off), else on. The batches are the same
      either way.

    Without ``persistent_workers``, the fast path's workers of a finished epoch wait up to 15 s
    (``FASTLOAD_PARK_S``; ``0``: they stop with the epoch, as torch's) for the next ``iter()``
    over the same dataset, collate and options, of this loader or another, which then starts
    at once (the README's "Workers kept for the next iterator").

    Every option is checked here: a bad value raises at construction, naming the option.

    ``loader.stats()`` answers "is my GPU waiting on data?" (see :class:`~fastload.LoaderStats`);
    ``loader.epoch_stats`` keeps one summary per finished epoch. ``iter(loader).worker_pids``
    lists the current worker processes; ``state_dict()`` and ``load_state_dict()`` resume an
    epoch exactly where it stopped, for length-grouped batches and for torch's own samplers
    (sequential, ``RandomSampler`` with or without a generator, ``DistributedSampler``, a
    ``BatchSampler`` over them), also after ``set_epoch`` with the saved epoch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        length_grouped: bool = False,
        max_tokens: int | None = None,
        pack_length: int | None = None,
        shuffle_shards: int | None = None,
        download_concurrency: int | None = None,
        readahead: bool = False,
        seed: int = 0,
        device: str | torch.device | None = None,
        max_shared_bytes: int | None = None,
        log_every_s: float | None = None,
        progress: bool = False,
        host_tuning: bool | None = None,
    ) -> None:
        options = LoaderOptions.create(
            num_workers=num_workers,
            length_grouped=length_grouped,
            max_tokens=max_tokens,
            pack_length=pack_length,
            shuffle_shards=shuffle_shards,
            download_concurrency=download_concurrency,
            readahead=readahead,
            seed=seed,
            device=device,
            max_shared_bytes=max_shared_bytes,
            log_every_s=log_every_s,
            progress=progress,
            host_tuning=host_tuning,
            batch_size=batch_size,
        )
        self._fastload_options = options
        own = resolve_dataset(dataset)  # the dataset's capabilities (fastload._capabilities)
        self._dataset_capabilities = own
        if multiprocessing_context is None and num_workers != 0 and own.remote:
            # pyarrow's S3 client cannot be made again in a forked child of a process that
            # used it: remote datasets get workers forked from a fresh fork server.
            from fastload._engine import fresh_process_context

            multiprocessing_context = fresh_process_context()
        if options.auto_workers:
            num_workers = 1  # the engine starts with one and the tuner grows the pool
        self.epoch_stats: list[LoaderStats] = []
        self.meter = StallMeter()  # the consumer's wait and step, over the loader's life
        self._final_fields: dict[str, Any] = {}  # the engine's figures when its workers stopped
        self._final_workers = 0
        self._epoch = 0
        self._loaded = False  # load_state_dict's position stands until set_epoch names an epoch
        # What the consumer received of the latest iteration (None after set_epoch or
        # load_state_dict); held here because a loop's `break` drops the iterator.
        self._progress: EpochProgress | None = None
        # Out of order: (epoch, positions) received past the loaded position before the
        # checkpoint, which the loaded epoch's iteration skips.
        self._received_ahead: tuple[int, list[int]] | None = None
        # The workers' part of a loaded state (their seeds and random states), with its
        # epoch (None: the next iteration's) and whether its base seed replaces the draw: the
        # loaded epoch's iterator starts its workers from it.
        self._loaded_workers: tuple[int | None, dict[str, Any], bool] | None = None
        self._last_it: weakref.ref[InProcessIterator | WorkerIterator] | None = None
        given_batch_sampler = batch_sampler
        if options.pack_length is not None:
            batch_sampler = _packed_sampler(
                dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, max_tokens, options
            )
            batch_size, shuffle, drop_last = 1, None, False
        self.meter.packing = _packs(batch_sampler)
        if collate_fn is None and _packs(batch_sampler):
            from fastload._collate import PackCollate

            # On the GPU, labels are built there from the ids: 8 bytes a token not copied.
            collate_fn = PackCollate(
                batch_sampler.seq_len, rows=batch_sampler.rows, device_labels=options.device is not None
            )
        elif collate_fn is None and own.reads_batches:
            from fastload._collate import PadCollate

            collate_fn = PadCollate()
        if options.shuffle_shards is not None and not (
            length_grouped or max_tokens is not None or options.pack_length is not None
        ):
            raise ValueError(
                "shuffle_shards= shapes a length-grouped or packed plan; give it with "
                "length_grouped=True, max_tokens= or pack_length= (or pass a "
                "LengthGroupedBatchSampler/PackedBatchSampler with shuffle_shards as batch_sampler)"
            )
        if options.pack_length is None and (length_grouped or max_tokens is not None):
            batch_sampler = _length_grouped_sampler(
                dataset,
                batch_size,
                shuffle,
                sampler,
                batch_sampler,
                drop_last,
                max_tokens,
                options,
                _collate_rounding(collate_fn) if max_tokens is not None else 1,
            )
            batch_size, shuffle, drop_last = 1, None, False
        _check_rounding(batch_sampler, collate_fn)
        if batch_sampler is not given_batch_sampler:  # built here from the length options
            _warn_uniform_lengths(batch_sampler, type(dataset).__name__, own.fields, options)
        options.check_use(dataset=type(dataset).__name__, remote=own.remote)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            cast(int, num_workers),
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        # torch's own samplers, and samplers that keep their own position (torchdata's
        # convention), resume through a stand-in that yields exactly their items.
        index_sampler = super()._index_sampler
        self._torch_resume = resumable_torch_sampler(index_sampler) or stateful_sampler(index_sampler)
        self._iterating = False  # True while __iter__ starts this loader's own iteration
        planned: Any = self.batch_sampler
        if _planned(planned):
            planned.on_iter = _OwnIterationCheck(self)

    # fastload's options, read back by name (frameworks re-create a loader from the
    # attributes named as its constructor's parameters).
    @property
    def options(self) -> LoaderOptions:
        """fastload's own options, as validated at construction."""
        return self._fastload_options

    @property
    def length_grouped(self) -> bool:
        return self._fastload_options.length_grouped

    @property
    def max_tokens(self) -> int | None:
        return self._fastload_options.max_tokens

    @property
    def pack_length(self) -> int | None:
        return self._fastload_options.pack_length

    @property
    def shuffle_shards(self) -> int | None:
        return self._fastload_options.shuffle_shards

    @property
    def download_concurrency(self) -> int | None:
        return self._fastload_options.download_concurrency

    @property
    def seed(self) -> int:
        return self._fastload_options.seed

    @property
    def device(self) -> str | torch.device | None:
        return self._fastload_options.requested_device

    @property
    def max_shared_bytes(self) -> int | None:
        return self._fastload_options.max_shared_bytes

    @property
    def log_every_s(self) -> float | None:
        return self._fastload_options.log_every_s

    @property
    def progress(self) -> bool:
        return self._fastload_options.progress

    @property
    def host_tuning(self) -> bool | None:
        return self._fastload_options.host_tuning

    @property
    def auto_workers(self) -> bool:
        """Whether ``num_workers="auto"`` was given (the pool is tuned while training runs)."""
        return self._fastload_options.auto_workers

    @property
    def _engine_dataset(self) -> Any:
        """What the engine reads: the dataset, or for packed batches the dataset read by
        packed batch (``PackedSource``), made once."""
        source = self.__dict__.get("_packed_source")
        if source is not None and source.dataset is self.dataset:
            return source
        sampler: Any = self.__dict__.get("batch_sampler")
        if not _packs(sampler):
            return self.dataset
        from fastload._collate import PackedSource

        source = PackedSource(
            self.dataset,
            seq_len=sampler.seq_len,
            rows=sampler.rows,
            capabilities=self.__dict__.get("_dataset_capabilities"),
        )
        self.__dict__["_packed_source"] = source
        return source

    def _capabilities(self) -> Capabilities:
        """What the engine may use of the dataset it reads and of the collate, resolved once per
        collate (``collate_fn`` may be set again before an iteration, as with torch's loader)."""
        dataset, collate, sampler = self._engine_dataset, self.collate_fn, self._index_sampler
        cached = self.__dict__.get("_resolved")
        if cached is not None and cached[0] is dataset and cached[1] is collate and cached[2] is sampler:
            return cast(Capabilities, cached[3])
        capabilities = resolve(dataset, collate, sampler)
        self.__dict__["_resolved"] = (dataset, collate, sampler, capabilities)
        return capabilities

    def _sampler_capabilities(self, sampler: Any) -> SamplerCapabilities:
        """What the loader may use of ``sampler`` (its resumable index sampler), resolved once."""
        cached = self.__dict__.get("_resolved_sampler")
        if cached is not None and cached[0] is sampler:
            return cast(SamplerCapabilities, cached[1])
        capabilities = resolve_sampler(sampler)
        self.__dict__["_resolved_sampler"] = (sampler, capabilities)
        return capabilities

    def _get_iterator(self) -> Any:
        it: InProcessIterator | WorkerIterator
        if "_preflight" not in self.__dict__:  # once, as the loader first starts (fastload._doctor)
            from fastload._doctor import startup

            self.__dict__["_preflight"] = tuple(f.message for f in startup(self) if f.severity)
        if self.num_workers == 0:
            it = InProcessIterator(self)
        else:
            self.check_worker_number_rationality()
            it = WorkerIterator(self)
        self._last_it = weakref.ref(it)
        return it

    def __iter__(self) -> Any:
        called = time.perf_counter()  # first_batch_s counts from here: iter() is start-up too
        self._begin_epoch()
        skip = self._skip_received_ahead()
        self._iterating = True
        try:
            it = cast("InProcessIterator | WorkerIterator", super().__iter__())
        finally:
            self._iterating = False
            self.__dict__.pop("_skipping", None)
            self._loaded_workers = None  # taken by a new worker iterator, or of no use
        self._progress = it.progress
        self._progress.epoch = self._sampler_epoch()
        self.meter.start_epoch(called, self._progress.epoch if self._progress.epoch >= 0 else None)
        if not self.in_order and self.num_workers > 0:
            self._progress.track_positions(skip)
        return it

    def _draw_base_seed(self) -> int:
        """The workers' base seed for a new iterator: torch's draw (from ``generator``, else the
        global generator), unless the loaded state continues persistent workers into a new
        epoch, where the uninterrupted run's iterator made none."""
        loaded = self._loaded_workers
        if loaded is not None and loaded[2]:
            return int(loaded[1]["base_seed"])
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def _take_worker_resume(self) -> tuple[int, int, dict[int, Any]] | None:
        """For the iterator of a loaded epoch: the workers' base seed, the worker of the first
        batch and each worker's random states, as the interrupted run had them after the last
        batch received; ``None`` for any other epoch, or where the worker count changed (the
        batches are the same, the randomness of the dataset's augmentation is not)."""
        loaded, self._loaded_workers = self._loaded_workers, None
        if loaded is None or (loaded[0] is not None and loaded[0] != self._sampler_epoch()):
            return None
        saved = loaded[1]
        if int(saved["num_workers"]) != self.num_workers:
            warnings.warn(
                f"the loaded state was saved with num_workers={saved['num_workers']}, this loader "
                f"has {self.num_workers}: the workers' random states are not restored, so random "
                "augmentation in the dataset differs from the interrupted run's",
                stacklevel=4,
            )
            return None
        return worker_resume(saved)

    def _skip_received_ahead(self) -> list[int]:
        """Positions of the loaded epoch received out of order before the checkpoint: the
        iterator about to be made skips them (through ``_index_sampler``), once."""
        received, self._received_ahead = self._received_ahead, None
        if received is None or received[0] != self._sampler_epoch():
            return []
        self.__dict__["_skipping"] = SkipPositions(self._index_sampler, received[1])
        return received[1]

    # -- statistics ---------------------------------------------------------------------------
    def stats(self, scope: str = "run") -> LoaderStats:
        """Is the consumer waiting on data? A :class:`~fastload.LoaderStats` snapshot over the
        whole run (``scope="run"``) or the current epoch (``"epoch"``): wait and step seconds,
        stall fraction, p50/p99 wait, samples/batches/padded tokens per second, padding
        efficiency, queue depth, slots in use, per-worker busy fractions, respawns, retries,
        skipped samples, and a one-line ``diagnosis``."""
        it = self._last_iterator()
        found = self.__dict__.get("_preflight", ())  # the start-up checks' warnings
        if it is not None:
            stats = it.stats(scope)
        else:
            stats = self.meter.snapshot(scope=scope, num_workers=self._final_workers, **self._final_fields)
        if isinstance(self.batch_sampler, MixtureBatchSampler):  # delivered, not prefetched
            progress = self._progress
            consumed = 0 if progress is None or progress.epoch != self._sampler_epoch() else progress.consumed
            stats = dataclasses.replace(stats, sources=self.batch_sampler.consumed(batches_consumed=consumed))
        return dataclasses.replace(stats, preflight=found)

    def _on_epoch_end(self, summary: LoaderStats) -> None:
        self.epoch_stats.append(summary)
        if self.log_every_s is not None:
            _log.info("epoch %d: %s", summary.epoch, summary)

    def _on_shutdown(self, engine_fields: dict[str, Any], num_workers: int) -> None:
        """The workers stopped: keep their last figures for :meth:`stats`."""
        self._final_fields, self._final_workers = engine_fields, num_workers
    # -- epochs and exact resume ----------------------------------------------------------------
    @property
    def _index_sampler(self) -> Any:
        """What the iterator draws indices from: torch's choice (``batch_sampler``, or
        ``sampler`` without auto-collation), or its resumable stand-in for torch's own samplers."""
        skipping = self.__dict__.get("_skipping")
        if skipping is not None:
            return skipping
        stand_in = self.__dict__.get("_torch_resume")
        return stand_in if stand_in is not None else super()._index_sampler

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (and later ones count on from it).

        A position loaded by :meth:`load_state_dict` in this same epoch is kept, so the usual
        loop (``load_state_dict``, then ``set_epoch(e)`` before each epoch) resumes where the run
        stopped instead of repeating the epoch's first batches; any other epoch starts from its
        beginning. The sampler's own ``set_epoch`` is called too (a ``DistributedSampler``'s
        included)."""
        self._epoch = int(epoch)
        self._loaded, self._progress = False, None
        if self._received_ahead is not None and self._received_ahead[0] != self._epoch:
            self._received_ahead = None
        if self._loaded_workers is not None and self._loaded_workers[0] not in (None, self._epoch):
            self._loaded_workers = None
        sampler = self._resumable()
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)

    def _begin_epoch(self) -> None:
        sampler = self._resumable()
        if sampler is None or not hasattr(sampler, "set_epoch"):
            return
        if not self._sampler_capabilities(sampler).follows_loader_epoch:
            return  # a DistributedSampler: its own epoch decides, as with torch's loader
        if self._loaded:
            self._loaded = False  # the sampler holds the loaded position (or its own epoch)
        else:
            sampler.set_epoch(self._epoch)
        self._epoch = sampler.epoch + 1

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands: batches the consumer received count as consumed;
        batches prefetched by workers but not yet received do not. It may be taken while
        iterating or after the loop was left (``break``); after a loop that ran to the end of
        its epoch, loading it starts the next epoch. Right after :meth:`load_state_dict` it is
        the loaded position. JSON-able."""
        if self._own_position_dataset():
            return self._iterable_state()
        sampler = self._resumable_for("state_dict()")
        progress = self._progress
        if progress is None or progress.epoch != self._sampler_epoch():
            progress = EpochProgress()  # nothing received of the sampler's current epoch
        state: dict[str, Any] = {"sampler": sampler.state_dict(batches_consumed=progress.consumed)}
        if progress.finished:
            state["epoch_finished"] = True
        ahead = progress.received_ahead()
        if self._progress is None and self._received_ahead is not None:
            ahead = list(self._received_ahead[1])  # loaded, not yet iterated
        if ahead:
            state["received_ahead"] = ahead
        if self._loaded_workers is not None:
            state["workers"] = self._loaded_workers[1]  # loaded, not yet iterated
        elif (
            progress.base_seed is not None
            and self.num_workers > 0
            and (not progress.finished or self.persistent_workers)  # carried into the next epoch
        ):
            state["workers"] = worker_state(progress, self.num_workers)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``iter()`` continues the saved epoch with exactly the batches an
        uninterrupted run would have produced, also after ``set_epoch`` with the saved epoch;
        a state saved after its epoch ended starts the next epoch. The state is loaded into the
        sampler at once, so a state saved with other settings raises ``ValueError`` here, and
        ``len(loader)`` counts the batches left."""
        if self._own_position_dataset():
            self._load_iterable_state(state)
            return
        sampler = self._resumable_for("load_state_dict()")
        sampler.load_state_dict(dict(state["sampler"]))
        if self._sampler_capabilities(sampler).epoch:
            self._epoch = sampler.epoch
        self._loaded, self._progress = True, None
        ahead = [int(p) for p in state.get("received_ahead", ())]
        self._received_ahead = (self._sampler_epoch(), ahead) if ahead else None
        workers = state.get("workers")
        self._loaded_workers = None if workers is None else (self._sampler_epoch(), dict(workers), False)
        if state.get("epoch_finished", False):
            self._finish_loaded_epoch()
            if workers is not None and self.persistent_workers:
                # The uninterrupted run's workers went on into the next epoch with the same
                # seed (its iterator made no new draw): so does the resumed one.
                self._loaded_workers = (None, dict(workers), True)

    def _finish_loaded_epoch(self) -> None:
        """The loaded epoch had ended: run its (empty) rest now, so that the sampler stands
        where the uninterrupted run's stood after its loop (a generator has made the epoch's
        draws), and the next ``iter()`` starts the following epoch."""
        progress = EpochProgress(self._sampler_epoch())
        self._iterating = True
        try:
            for _ in self._index_sampler:
                progress.delivered += 1  # none, unless the sampler was given another length
        finally:
            self._iterating = False
        progress.finished = True
        self._loaded, self._progress = False, progress
        self._epoch = progress.epoch + 1

    def _own_position_dataset(self) -> bool:
        """Whether the dataset is an ``IterableDataset`` that keeps its own position (torchdata's
        ``state_dict()``/``load_state_dict()``): then the loader saves and loads its state (with
        workers, each worker's replica's, as it stood after the last batch received from it)."""
        return isinstance(self.dataset, torch.utils.data.IterableDataset) and keeps_own_position(self.dataset)

    def _replicas_keep_position(self) -> bool:
        """Whether each worker sends its iterable dataset replica's own state with its batches."""
        return self.num_workers > 0 and self.in_order and self._own_position_dataset()

    def _iterable_state(self) -> dict[str, Any]:
        if self.num_workers == 0:
            return {"dataset": cast(Any, self.dataset).state_dict()}
        if not self.in_order:
            raise TypeError(
                f"state_dict() of a loader over {type(self.dataset).__name__} (an IterableDataset "
                "with its own state) needs in_order=True with workers: out of order, which "
                "worker's batches were received cannot be replayed"
            )
        progress = self._progress
        if self._loaded_workers is not None:
            return {"dataset_workers": self._loaded_workers[1]}  # loaded, not yet iterated
        if progress is None or progress.base_seed is None or progress.finished:
            return {"dataset_workers": None}  # the next iteration starts from the dataset itself
        return {"dataset_workers": worker_state(progress, self.num_workers)}

    def _load_iterable_state(self, state: dict[str, Any]) -> None:
        if "dataset" in state:
            cast(Any, self.dataset).load_state_dict(state["dataset"])
        workers = state.get("dataset_workers")
        self._loaded_workers = None if workers is None else (-1, dict(workers), False)

    def _resumable(self) -> Any | None:
        """The index sampler that saves and loads positions, if there is one."""
        sampler: Any = self._index_sampler
        if isinstance(self.dataset, torch.utils.data.IterableDataset):
            return None
        return sampler if hasattr(sampler, "state_dict") and hasattr(sampler, "load_state_dict") else None

    def _sampler_epoch(self) -> int:
        """The resumable sampler's epoch (-1 where it has none): its own ``set_epoch`` may
        move it."""
        sampler: Any = self._resumable()
        return int(sampler.epoch) if self._sampler_capabilities(sampler).epoch else -1

    def _resumable_for(self, action: str) -> Any:
        """The index sampler that saves and loads positions, or a ``TypeError`` that says what
        would make this loader resumable."""
        sampler: Any = self._resumable()
        if sampler is not None:
            return sampler
        if isinstance(self.dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                f"{action} cannot resume a loader over an IterableDataset "
                f"({type(self.dataset).__name__}): no sampler decides its order, so its position "
                "must be kept by the dataset itself: give it state_dict() and "
                "load_state_dict(state) (torchdata's convention)"
            )
        used: Any = self._index_sampler
        inner = used.sampler if type(used) is torch.utils.data.BatchSampler else None
        name = type(used).__name__ + ("" if inner is None else f" over a {type(inner).__name__}")
        raise TypeError(
            f"{action} needs a resumable sampler; this loader's {name} has no state_dict/"
            "load_state_dict. Use torch's SequentialSampler, RandomSampler or "
            "DistributedSampler (alone or in a BatchSampler), length_grouped=True or "
            "max_tokens=, or pass as batch_sampler= a sampler with "
            "state_dict(batches_consumed=...) and load_state_dict(state)"
        )

    def _last_iterator(self) -> InProcessIterator | WorkerIterator | None:
        return self._last_it() if self._last_it is not None else None


class _OwnIterationCheck:
    """Set as ``on_iter`` of the planned batch sampler a loader owns: an iteration of that
    sampler that the loader did not start means another loader iterates it — in practice a
    framework that rebuilt this loader as torch's from its dataset, batch sampler and collate
    (Accelerate's ``prepare``, ``transformers.Trainer``), which silently drops fastload's engine.
    It warns once per loader. The sampler starts an iteration exactly when a loader's iterator is
    made, so the warning comes with the first batch. Holds the loader weakly; pickles as a check
    that does nothing (a copy of the sampler belongs to no loader)."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self._loader: weakref.ref[DataLoader[Any]] | None = weakref.ref(loader)
        self._warned = False

    def __call__(self) -> None:
        loader = self._loader() if self._loader is not None else None
        if loader is None or loader._iterating or self._warned:
            return
        self._warned = True
        warnings.warn(
            f"the batch sampler of a fastload.DataLoader ({type(loader.batch_sampler).__name__}) "
            "is being iterated by another loader, so fastload's engine is not loading these "
            "batches: most likely the loader was rebuilt as torch.utils.data.DataLoader "
            "(accelerator.prepare(loader), or transformers.Trainer's own get_train_dataloader), "
            "which is many times slower. Use fastload.accelerate.prepare(accelerator, loader) "
            "instead of accelerator.prepare, or fastload.hf.FastloadTrainer instead of Trainer",
            RebuiltLoaderWarning,
            stacklevel=4,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_OwnIterationCheck._orphan, ())

    @classmethod
    def _orphan(cls) -> _OwnIterationCheck:
        check = cls.__new__(cls)
        check._loader, check._warned = None, True
        return check


def _planned(batch_sampler: Any) -> bool:
    from fastload._sampling._stream import PlannedBatchSampler

    return isinstance(batch_sampler, PlannedBatchSampler)


def _packs(batch_sampler: Any) -> bool:
    from fastload._sampling import PackedBatchSampler

    if isinstance(batch_sampler, MixtureBatchSampler):  # a mixture packs with pack_length
        return batch_sampler.pack_length is not None
    return isinstance(batch_sampler, PackedBatchSampler)


def _packed_sampler(
    dataset: Any,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    max_tokens: int | None,
    options: LoaderOptions,
) -> Any:
    from fastload._sampling import PackedBatchSampler

    if _packs(batch_sampler) and sampler is None:
        return batch_sampler  # re-created from its own attributes (Lightning, Accelerate)
    if isinstance(batch_sampler, MixtureBatchSampler):
        raise ValueError(
            f"pack_length={options.pack_length} with a MixtureBatchSampler that does not pack: "
            f"give it to the sampler, MixtureBatchSampler(..., pack_length={options.pack_length}, "
            "batch_size=rows), and pass that as batch_sampler"
        )
    lengths = _own_sampler_lengths("pack_length=", dataset, sampler, batch_sampler)
    if max_tokens is None and batch_size is None:
        raise ValueError("pack_length= needs batch_size (rows per batch) or max_tokens")
    assert options.pack_length is not None
    if max_tokens is not None and max_tokens < options.pack_length:
        raise ValueError(  # said here: the sampler would name pack_length its seq_len
            f"max_tokens={max_tokens} is less than pack_length={options.pack_length}: not one "
            "packed row fits the budget"
        )
    return PackedBatchSampler(
        lengths,
        seq_len=options.pack_length,
        rows=batch_size if max_tokens is None else None,
        max_tokens=max_tokens,
        shuffle=True if shuffle is None else bool(shuffle),
        seed=options.seed,
        drop_last=drop_last,
        **_shard_window(dataset, options),
    )


def _warn_uniform_lengths(batch_sampler: Any, dataset: str, fields: Any, options: LoaderOptions) -> None:
    from fastload._sampling._batch_options import uniform_lengths_message
    from fastload.errors import UniformLengthsWarning

    if options.pack_length is not None:
        option = f"pack_length={options.pack_length}"
    else:
        option = "length_grouped=True" if options.max_tokens is None else f"max_tokens={options.max_tokens}"
    message = uniform_lengths_message(
        batch_sampler.lengths, option=option, dataset=dataset, fields=fields, packing=options.pack_length is not None
    )
    if message is not None:
        warnings.warn(message, UniformLengthsWarning, stacklevel=3)


def _own_sampler_lengths(option: str, dataset: Any, sampler: Any, batch_sampler: Any) -> Any:
    """The dataset's lengths, for an option that builds its own batch sampler; raises where
    the loader was given a sampler too, or the dataset has no lengths."""
    if sampler is not None or batch_sampler is not None:
        raise ValueError(
            f"{option} builds its own batch sampler; it is mutually exclusive with sampler and "
            "batch_sampler"
        )
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        raise ValueError(
            f"{option} needs the dataset's per-sample lengths as a `lengths` array; "
            f"{type(dataset).__name__} has no `lengths` attribute"
        )
    return lengths


def _shard_window(dataset: Any, options: LoaderOptions) -> dict[str, Any]:
    """The sampler options of ``shuffle_shards=K``: K and the dataset's shards."""
    if options.shuffle_shards is None:
        return {}
    own = resolve_dataset(dataset)  # declared capabilities (fastload._protocols)
    sizes = own.shard_sizes
    if sizes is None:
        raise ValueError(
            f"shuffle_shards= needs the dataset's shards (`shard_sizes`, samples per shard); "
            f"{type(dataset).__name__} has none"
        )
    message = dataset.cache_window_warning(options.shuffle_shards) if own.cache_window_warning else None
    if message is not None:
        warnings.warn(message, stacklevel=4)
    return {"shuffle_shards": options.shuffle_shards, "shard_sizes": sizes}


def _length_grouped_sampler(
    dataset: Any,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    max_tokens: int | None,
    options: LoaderOptions,
    rounding: int,
) -> Any:
    from fastload._sampling import LengthGroupedBatchSampler

    if isinstance(batch_sampler, LengthGroupedBatchSampler) and sampler is None:
        return batch_sampler  # re-created from its own attributes (Lightning, Accelerate)
    option = "length_grouped=True" if max_tokens is None else "max_tokens="
    lengths = _own_sampler_lengths(option, dataset, sampler, batch_sampler)
    return LengthGroupedBatchSampler(
        lengths,
        batch_size=batch_size if max_tokens is None or batch_size != 1 else None,
        max_tokens=max_tokens,
        shuffle=True if shuffle is None else bool(shuffle),
        seed=options.seed,
        drop_last=drop_last,
        pad_to_multiple_of=rounding if max_tokens is not None and rounding > 1 else None,
        **_shard_window(dataset, options),
    )


def _collate_rounding(collate: Any) -> int:
    """The multiple the collate rounds padded lengths up to (``RoundingCollate``), 1 for none:
    what a ``max_tokens`` plan must count, so that the budget holds for the shape built."""
    resolved = resolve_collate(collate)
    if resolved.rounding_error is not None:
        raise TypeError(resolved.rounding_error)
    return resolved.pad_to_multiple_of or 1


def _check_rounding(batch_sampler: Any, collate: Any) -> None:
    """A length-grouped ``batch_sampler`` with a budget must plan for padded lengths at least
    as coarse as the collate's, or its batches would exceed ``max_tokens``."""
    from fastload._sampling import LengthGroupedBatchSampler

    if not isinstance(batch_sampler, LengthGroupedBatchSampler) or batch_sampler.max_tokens is None:
        return
    rounding = _collate_rounding(collate)
    planned = batch_sampler.pad_to_multiple_of or 1
    if planned % rounding:
        raise ValueError(
            f"the batch_sampler plans max_tokens={batch_sampler.max_tokens} for lengths padded "
            f"to a multiple of {planned}, but collate_fn pads to pad_to_multiple_of={rounding}: "
            f"its batches would exceed the budget; build the sampler with "
            f"pad_to_multiple_of={rounding}"
        )
