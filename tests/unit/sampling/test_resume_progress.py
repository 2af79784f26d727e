"""The loader's record of what the consumer received (``fastload._loader._resume``), without processes:
out of order, a contiguous prefix plus the positions beyond it; a resumed iteration skips
exactly those; a worker's random states survive JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from fastload._loader._resume import EpochProgress, SkipPositions, decode_worker, encode_worker


def test_out_of_order_positions_fold_into_a_prefix() -> None:
    progress = EpochProgress()
    progress.track_positions()
    for position in (1, 3, 0, 5):
        progress.mark(position)
    assert (progress.consumed, progress.received_ahead()) == (2, [1, 3])
    progress.mark(2)
    assert (progress.consumed, progress.received_ahead()) == (4, [1])


def test_a_resumed_iteration_skips_the_positions_received_once() -> None:
    skipping = SkipPositions(list(range(10)), [1, 3])
    assert len(skipping) == 8
    assert list(skipping) == [0, 2, 4, 5, 6, 7, 8, 9]
    assert [skipping.position_of(k) for k in range(3)] == [0, 2, 4]
    assert list(skipping) == list(range(10))  # later iterations pass everything through


def test_a_workers_state_survives_json() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = (
        (torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state()),
        {"yielded": 4},
    )
    expected = (torch.rand(3), random.random(), np.random.rand())
    back = decode_worker(json.loads(json.dumps(encode_worker(state))))
    torch.set_rng_state(torch.frombuffer(bytearray(back[0][0]), dtype=torch.uint8))
    random.setstate(back[0][1])
    np.random.set_state(back[0][2])
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]
    assert back[1] == {"yielded": 4}
