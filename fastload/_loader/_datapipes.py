"""DataPipes (``torch.utils.data.datapipes``) in fastload's loader, as torch's loader runs them.

torch's DataLoader shuffles, seeds and shards a DataPipe graph itself: at construction it
applies the loader's ``shuffle`` to the graph's shufflers (done by torch's own ``__init__``,
which fastload's loader calls); each iterator draws a seed shared by every worker (broadcast
over a gloo group when ``torch.distributed`` is initialized), before anything else it draws,
and seeds the graph's random operations with it; and each worker, or the only process without
workers, keeps its shard of the ``sharding_filter`` (``num_workers × world size`` shards). The
functions here do the same at the same moments, with torch's own graph functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings
from torch.utils.data import dataloader as torch_dataloader


def is_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


class SharedSeed:
    """The seed each epoch of an iterator gives an ``IterDataPipe`` graph (see the module
    text); the group it is broadcast over is made once per iterator, as torch makes it."""

    def __init__(self) -> None:
        #: The seed the last :meth:`apply` drew (what the workers of a new epoch apply).
        self.last: int | None = None
        self._group: Any = None
        if dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")

    def apply(self, dataset: Any, generator: torch.Generator | None) -> Any:
        """``dataset`` with its random operations seeded for a new epoch (drawn from
        ``generator``, as torch draws it); any other dataset as it is, drawing nothing."""
        if not isinstance(dataset, IterDataPipe):
            return dataset
        seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
        if isinstance(self._group, dist.ProcessGroup):
            dist.broadcast(seed, src=0, group=self._group)
        self.last = int(seed.item())
        rng = torch.Generator()
        rng.manual_seed(self.last)
        return graph_settings.apply_random_seed(dataset, rng)


def shard_in_process(dataset: Any) -> None:
    """Without workers: keep this rank's shard of a DataPipe graph (nothing for another
    dataset)."""
    if is_datapipe(dataset):
        world_size, rank = torch_dataloader._get_distributed_settings()
        graph_settings.apply_sharding(dataset, world_size, rank)


def sharding_worker_init(
    dataset: Any, worker_init_fn: Callable[[int], None] | None
) -> Callable[[int], None] | None:
    """``worker_init_fn`` preceded, for a DataPipe graph, by torch's own sharding of it in the
    worker (shard ``worker_id × world size + rank`` of ``num_workers × world size``)."""
    if not is_datapipe(dataset):
        return worker_init_fn
    world_size, rank = torch_dataloader._get_distributed_settings()
    return functools.partial(torch_dataloader._sharding_worker_init_fn, worker_init_fn, world_size, rank)


__all__ = ["SharedSeed", "is_datapipe", "shard_in_process", "sharding_worker_init"]
