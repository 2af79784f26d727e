"""Claiming a fast-path task (``_claims.py``): of its worker and the main process, exactly one
builds it, decided by one compare-and-swap on the slot's claim word."""

from __future__ import annotations

import mmap
import multiprocessing
from typing import Any

import numpy as np
import pytest

from fastload._engine import _claims as claims

pytestmark = pytest.mark.skipif(not claims.available(), reason="the _atomic extension was not built")


def _word() -> mmap.mmap:
    return mmap.mmap(-1, 4096)


def test_the_first_claim_of_a_posted_ticket_wins_and_the_other_side_loses() -> None:
    buf = _word()
    claims.post(buf, 64, 7)
    assert claims.state(buf, 64) == (7, claims.SENT)
    assert claims.claim(buf, 64, 7, claims.WORKER)
    assert not claims.claim(buf, 64, 7, claims.MAIN)
    assert claims.state(buf, 64) == (7, claims.WORKER)
    claims.post(buf, 128, 8)
    assert claims.claim(buf, 128, 8, claims.MAIN)
    assert not claims.claim(buf, 128, 8, claims.WORKER)
    assert claims.state(buf, 128) == (8, claims.MAIN)


def test_a_claim_under_an_older_ticket_fails_once_the_slot_is_posted_again() -> None:
    buf = _word()
    claims.post(buf, 0, 1)
    claims.post(buf, 0, 2)  # the slot was sent again before ticket 1's message was read
    assert not claims.claim(buf, 0, 1, claims.WORKER)
    assert not claims.claim(buf, 0, 1, claims.MAIN)
    assert claims.claim(buf, 0, 2, claims.WORKER)


def test_a_word_outside_the_buffer_misaligned_or_read_only_is_refused() -> None:
    buf = _word()
    for offset in (-8, 4090, 4096, 12):
        with pytest.raises(ValueError, match=f"offset {offset} is not an 8-byte aligned word inside the buffer \\(4096 bytes\\)"):
            claims.claim(buf, offset, 1, claims.MAIN)
    with pytest.raises(BufferError):
        claims.post(bytes(64), 0, 1)
    misaligned = np.zeros(80, np.uint8)[1:65]  # a buffer whose start is not 8-byte aligned
    with pytest.raises(ValueError, match="not an 8-byte aligned word"):
        claims.post(misaligned, 0, 1)


def _claim_all(buf: mmap.mmap, words: int, by: int) -> list[int]:
    return [w for w in range(words) if claims.claim(buf, 8 * w, w + 1, by)]


def _race_in_child(buf: mmap.mmap, words: int, out: Any, ready: Any, go: Any) -> None:
    ready.set()
    go.wait()
    out.send(_claim_all(buf, words, claims.WORKER))


def test_a_worker_and_the_main_process_racing_for_every_word_take_each_exactly_once() -> None:
    words = 50_000
    buf = mmap.mmap(-1, 8 * words)  # shared with the forked child
    for w in range(words):
        claims.post(buf, 8 * w, w + 1)
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    theirs, ours = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_race_in_child, args=(buf, words, ours, ready, go))
    child.start()
    assert ready.wait(10)
    go.set()
    mine = _claim_all(buf, words, claims.MAIN)
    worker = theirs.recv()
    child.join(10)
    assert child.exitcode == 0
    assert sorted(mine + worker) == list(range(words))  # every word taken, none twice
    assert not set(mine) & set(worker)
    states = [claims.state(buf, 8 * w) for w in range(words)]
    assert all(ticket == w + 1 for w, (ticket, _) in enumerate(states))
    assert sum(state == claims.MAIN for _, state in states) == len(mine)
