"""``on_iter``: a planned sampler calls it at the start of every iteration, however started
(how ``fastload.DataLoader`` notices another loader iterating the sampler it owns)."""

from __future__ import annotations

import numpy as np

from fastload import LengthGroupedBatchSampler, PackedBatchSampler


def test_on_iter_is_called_once_per_iteration_started() -> None:
    lengths = np.arange(1, 101)
    for sampler in (
        LengthGroupedBatchSampler(lengths, batch_size=8, num_replicas=1, rank=0),
        PackedBatchSampler(lengths, seq_len=128, rows=2, num_replicas=1, rank=0),
    ):
        calls: list[int] = []
        sampler.on_iter = lambda calls=calls: calls.append(1)
        batches = list(sampler)
        assert len(calls) == 1 and len(batches) == len(sampler)
        list(sampler.iter_arrays())
        len(sampler)
        sampler.state_dict()
        assert len(calls) == 2  # len() and state_dict() start no iteration


def test_drop_last_is_read_back() -> None:
    assert LengthGroupedBatchSampler([3, 4], batch_size=1, drop_last=True).drop_last is True
    assert PackedBatchSampler([3, 4], seq_len=8, rows=1).drop_last is False
