"""Training on Hugging Face Accelerate with fastload doing the loading.

``accelerator.prepare(loader)`` rebuilds any loader as a ``torch.utils.data.DataLoader`` from its
dataset, batch sampler and collate: fastload's engine is gone (on a length-grouped
``HDF5Dataset`` with 2 workers, 130 batches/s instead of 2,473). fastload does not need it:
its planned samplers shard by rank themselves (they read ``torch.distributed``) with equal batch
counts per rank, and ``device=`` puts batches on the GPU. :func:`prepare` does for a fastload
loader what ``accelerator.prepare`` would do, and keeps it a fastload loader. Pass the model and
optimizer to ``accelerator.prepare`` as usual, and the loader here.

A fastload loader that was rebuilt anyway warns with
:class:`~fastload.errors.RebuiltLoaderWarning` when its first batch is asked for.

Importing this module imports ``accelerate`` (the ``hf`` extra: ``pip install 'torch-fastload[hf]'``).
"""

from __future__ import annotations

from typing import Any

from fastload._integrations._deps import require

require("accelerate", "fastload.accelerate")

from fastload._loader._dataloader import DataLoader  # noqa: E402


def prepare(accelerator: Any, loader: DataLoader[Any]) -> DataLoader[Any]:
    """``loader`` set up for this process of ``accelerator``, still a ``fastload.DataLoader``.

    * **Ranks.** With more than one process the loader's batch sampler must shard by rank: a
      length-grouped, token-budget or packed loader (``length_grouped=True``, ``max_tokens=``,
      ``pack_length=``, or a fastload batch sampler), built after ``Accelerator()`` so that it
      read the process group, or with ``num_replicas``/``rank`` given. Its world size and rank
      are checked against ``accelerator.num_processes`` and ``process_index`` (a
      ``ValueError`` says what differs).
    * **even_batches.** Every rank gets the same number of batches (what ``even_batches=True``
      asks). The last round is completed by repeating the epoch's first batches
      (length-grouped) or with batches of padding only (packed), or dropped with
      ``drop_last=True``. ``even_batches=False`` promises no repeated samples instead, which a
      length-grouped loader keeps only with ``drop_last=True``: otherwise ``ValueError``.
    * **Device.** Batches arrive on ``accelerator.device``: a loader without ``device=`` is
      re-created with it when that device is not the CPU (fastload copies each batch from pinned
      slots on a side stream while the previous one trains). A loader that already has a
      device is returned as it is.

    Returns ``loader`` itself, or the re-created loader.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            "fastload.accelerate.prepare takes a fastload.DataLoader; got "
            f"{type(loader).__name__} (pass other loaders to accelerator.prepare)"
        )
    world, rank = int(accelerator.num_processes), int(accelerator.process_index)
    sampler: Any = loader.batch_sampler
    shards = hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")
    if world > 1 and not shards:
        raise ValueError(
            f"this run has {world} processes, but the loader's batch sampler "
            f"({type(sampler).__name__}) does not shard by rank, so every process would train "
            "on the same batches. Build the loader with length_grouped=True, max_tokens= or "
            "pack_length= after Accelerator() (their samplers shard by rank)"
        )
    if shards and (sampler.num_replicas, sampler.rank) != (world, rank):
        raise ValueError(
            f"the loader's batch sampler shards for rank {sampler.rank} of "
            f"{sampler.num_replicas}, but this is process {rank} of {world}: build the loader "
            "after Accelerator() (which starts the process group the sampler reads), or pass "
            f"num_replicas={world}, rank={rank} to the sampler"
        )
    if world > 1 and not accelerator.even_batches and sampler.wraps and not sampler.drop_last:
        raise ValueError(
            "accelerator.even_batches is False, which promises that no sample is repeated to "
            "even out the ranks; this loader gives every rank the same number of batches by "
            "repeating the epoch's first ones. Pass drop_last=True to the loader (the surplus "
            "batches are dropped instead), or leave even_batches True"
        )
    device = accelerator.device
    if loader.device is None and device.type != "cpu":
        return _recreate(loader, device=device)
    return loader


def _recreate(loader: DataLoader[Any], **changes: Any) -> DataLoader[Any]:
    """A new ``fastload.DataLoader`` from ``loader``'s constructor attributes (as frameworks
    that re-create a loader do), with ``changes``; it takes over the same batch sampler."""
    options = {
        "batch_sampler": loader.batch_sampler,
        "batch_size": 1 if loader.batch_sampler is not None else None,
        "sampler": None if loader.batch_sampler is not None else loader.sampler,
        "num_workers": "auto" if loader.auto_workers else loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "in_order": loader.in_order,
        "length_grouped": loader.length_grouped,
        "max_tokens": loader.max_tokens,
        "pack_length": loader.pack_length,
        "seed": loader.seed,
        "device": loader.device,
        "max_shared_bytes": loader.max_shared_bytes,
        "log_every_s": loader.log_every_s,
        "progress": loader.progress,
        "host_tuning": loader.host_tuning,
        **changes,
    }
    return DataLoader(loader.dataset, **options)


__all__ = ["prepare"]
