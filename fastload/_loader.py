"""``fastload.DataLoader``: torch's DataLoader, constructor and behaviour, on fastload's engine."""

from __future__ import annotations

from typing import Any

import torch.utils.data

from fastload._iterator import LoaderIterator


class DataLoader(torch.utils.data.DataLoader):
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
    * moves tensors and large numpy arrays between processes through shared memory.

    ``iter(loader).worker_pids`` lists the current worker processes.
    """

    def _get_iterator(self) -> Any:
        return LoaderIterator(self)
