"""The pump's logic (``_engine/_pump.py``) over a real engine and a fake pool:
both drivers run for real, polling the fake pool's descriptor; the test decides what the workers
reply and when (``_fake_pool.py``). With real processes: ``tests/integration/test_engine_thread.py``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _fake_pool import FakeCodec, FakePool, Fakes, batch_indices

from fastload._engine import _pump
from fastload._engine._messages import DONE, ERROR, FAILED, OK, Delivery
from fastload._engine._pump import Pump, end_marker
from fastload._types import Counts
from fastload.errors import LoaderTimeoutError


class _Sampler:
    """The index source: batches ``batch_indices(k, epoch)`` for ``k < batches``, raising at
    ``fail_at``; ``check`` is called before each batch is given."""

    def __init__(self, batches: int, *, epoch: int = 0, fail_at: int | None = None) -> None:
        self.batches, self.epoch, self.fail_at = batches, epoch, fail_at
        self.given = 0  # batches handed out
        self.calls = 0
        self.check: Callable[[], None] = lambda: None

    def __call__(self) -> Any:
        self.calls += 1
        if self.given == self.fail_at:
            raise RuntimeError(f"the sampler has no batch {self.given}")
        if self.given == self.batches:
            return end_marker()
        self.check()
        self.given += 1
        return batch_indices(self.given - 1, self.epoch)


class _Consumer:
    """Takes items as the fast path's runner does: a grant per batch taken."""

    def __init__(self, pump: Pump) -> None:
        self.pump = pump
        self.taken = 0  # batches and failures taken: each granted a task
        self.taking = False  # inside take(): it may have granted already

    def take(self, **kwargs: Any) -> Delivery:
        self.taking = True
        item = self.pump.take(**kwargs)
        self.taken += item.kind <= FAILED
        self.taking = False
        return item


def _start(
    fakes: Fakes, *, workers: int = 2, prefetch: int = 2, batches: int = 8, timeout_s: float = 0.0,
    codec: FakeCodec | None = None, fail_at: int | None = None,
) -> tuple[_Consumer, FakePool, _Sampler]:
    """A pump over a fake pool, primed as the runner primes it."""
    engine, pool = fakes.engine(num_workers=workers, prefetch=prefetch, codec=codec)
    sampler = _Sampler(batches, fail_at=fail_at)
    pump = fakes.pump(engine, sampler, timeout_s=timeout_s)
    pump.grant(prefetch * workers)
    return _Consumer(pump), pool, sampler


def _serve(pool: FakePool, seq: int, epoch: int = 0) -> None:
    """The worker holding task ``seq`` builds it (once it has been sent)."""
    pool.reply(pool.await_task(seq, epoch), seq)


def _ok(k: int, epoch: int = 0) -> Delivery:
    index = batch_indices(k, epoch)
    return Delivery(OK, index, Counts(len(index)), k)


def _pump_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fastload-pump" and t.is_alive()]


@pytest.mark.parametrize("seed", range(3))
def test_at_most_prefetch_times_workers_tasks_are_out_whatever_the_replies(
    fakes: Fakes, driver: str, seed: int
) -> None:
    prefetch, workers, batches = 2, 3, 24
    bound = prefetch * workers
    consumer, pool, sampler = _start(fakes, workers=workers, prefetch=prefetch, batches=batches)
    over: list[int] = []

    def check() -> None:  # the batch about to be given would be one too many
        if sampler.given + 1 > bound + consumer.taken + consumer.taking:
            over.append(sampler.given)

    sampler.check = check
    pool.await_task(bound - 1)
    assert sampler.given == bound  # the sampler runs ahead by the bound at once
    rng = random.Random(seed)
    failing = set(rng.sample(range(batches), 4))
    answered: set[int] = set()
    for k in range(batches):
        if k not in answered:
            pool.await_task(k)
        chosen = [(w, t.seq) for w, t in pool.unanswered() if t.seq == k or rng.random() < 0.4]
        rng.shuffle(chosen)  # the workers finish in any order
        answered.update(seq for _, seq in chosen)
        for wid, seq in chosen:
            if seq in failing:
                pool.fail(wid, seq, ValueError(f"bad batch {seq}"))
            else:
                pool.reply(wid, seq)
        item = consumer.take()
        assert (item.kind, item.value if item.kind is OK else None) == (
            (FAILED, None) if k in failing else (OK, batch_indices(k))
        )
        if k in failing:
            assert f"bad batch {k}" in str(item.value)
    assert consumer.take().kind is DONE
    assert over == [] and sampler.given == batches


def test_a_sampler_that_raises_ends_the_epoch_after_the_batches_it_gave(fakes: Fakes, driver: str) -> None:
    consumer, pool, sampler = _start(fakes, batches=8, fail_at=5, timeout_s=2.0)
    for k in range(5):
        _serve(pool, k)
        assert consumer.take() == _ok(k)
    item = consumer.take()
    assert item.kind is ERROR and str(item.value) == "the sampler has no batch 5"
    assert consumer.take().kind is DONE  # then nothing more
    assert sampler.calls == 6  # never asked again
    assert not pool.unanswered()  # and nothing was sent after it


def test_done_comes_once_the_sampler_is_spent_and_every_batch_is_taken(fakes: Fakes, driver: str) -> None:
    consumer, pool, sampler = _start(fakes, workers=2, prefetch=2, batches=3)
    pool.await_task(2)
    assert sampler.calls == 4  # spent with the first grants
    for k in range(3):
        _serve(pool, k)
        assert consumer.take() == _ok(k)
    assert consumer.take().kind is DONE


def test_take_after_the_epochs_last_item_gives_done_again(fakes: Fakes, driver: str) -> None:
    consumer, pool, _ = _start(fakes, batches=1, timeout_s=2.0)  # persistent workers: no close
    _serve(pool, 0)
    assert consumer.take() == _ok(0)
    assert [consumer.take().kind for _ in range(3)] == [DONE] * 3


def test_an_empty_sampler_gives_done_at_once(fakes: Fakes, driver: str) -> None:
    consumer, pool, _ = _start(fakes, batches=0)
    assert consumer.take().kind is DONE
    assert not pool.unanswered()


def test_a_long_step_hands_over_to_the_thread_and_fast_steps_hand_back(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pump, "SLOW_STEP_S", 0.1)
    monkeypatch.setattr(_pump, "FAST_STEP_S", 0.05)
    consumer, pool, _ = _start(fakes, batches=12)
    now = [0.0]
    # The step before each take; the average weighs the newest step by 1/4: 1.0 s makes it
    # 0.25 s (over SLOW_STEP_S), and it decays below FAST_STEP_S at the sixth fast step after.
    steps = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    threaded = []
    for k, step_s in enumerate(steps):
        now[0] += step_s
        _serve(pool, k)
        assert consumer.take(_clock=lambda: now[0]) == _ok(k)
        threaded.append(consumer.pump.threaded)
    # The thread starts with the first batch, and between the two thresholds nothing changes.
    assert threaded == [True, False, True, True, True, True, True, True, False, False]
    # Who received each batch: next() itself the one it hands over with (2), the thread those
    # after (3-7), next() again once the consumer is fast (9). Batches 1 and 8 arrive while a
    # switch is due: either may receive them.
    heard = [pool.heard_by[k] for k in (0, 2, 3, 4, 5, 6, 7, 9)]
    assert heard == ["MainThread"] * 2 + ["fastload-pump"] * 5 + ["MainThread"]
    # And who sent the task each take granted (tasks 4-10 for takes 0-6; take 7's is sent by
    # either, as take 8 switches back): the thread drives only once the take handing over is out.
    sent = [pool.sent_by[(0, seq)] for seq in range(4, 11)]
    assert sent == ["MainThread"] * 3 + ["fastload-pump"] * 4


def test_skip_grants_holds_back_that_many_grants(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pump, "FAST_STEP_S", 1e9)  # inline from the second take: in step
    monkeypatch.setattr(_pump, "SLOW_STEP_S", 2e9)
    consumer, pool, sampler = _start(fakes, workers=2, prefetch=2, batches=8)
    consumer.pump.skip_grants(2)  # as when a worker retires
    given = []
    for k in range(5):
        _serve(pool, k)
        assert consumer.take() == _ok(k)
        given.append(sampler.given)
    assert given == [4, 4, 5, 6, 7]  # the first two batches granted nothing


def test_a_new_epoch_drops_the_old_epochs_batches_not_taken(fakes: Fakes, driver: str) -> None:
    codec = FakeCodec()
    consumer, pool, _ = _start(fakes, workers=2, prefetch=2, batches=8, codec=codec)
    for k in range(3):
        _serve(pool, k)
    assert consumer.take() == _ok(0)
    pool.await_heard()
    with consumer.pump.lock:  # batches 1 and 2 are ready, batch 3 in flight
        pass
    consumer.pump.new_epoch(_Sampler(2, epoch=1))
    consumer.pump.grant(4)
    pool.reply(pool.await_task(3), 3)  # the old epoch's last batch arrives late
    for k in range(2):
        _serve(pool, k, epoch=1)
        assert consumer.take() == _ok(k, epoch=1)
    assert consumer.take().kind is DONE
    assert codec.dropped[batch_indices(3)] == 1 and batch_indices(3) not in codec.delivered


def test_close_stops_the_thread_and_may_be_repeated(fakes: Fakes, driver: str) -> None:
    consumer, pool, _ = _start(fakes)
    _serve(pool, 0)
    assert consumer.take() == _ok(0)
    assert _pump_threads()  # started with the first batch, in either driver
    consumer.pump.close()
    assert not _pump_threads()
    consumer.pump.close()
    with pytest.raises(RuntimeError, match="engine"):
        consumer.take()


def test_a_timeout_raises_in_either_driver(fakes: Fakes, driver: str) -> None:
    consumer, pool, _ = _start(fakes, timeout_s=0.05)
    _serve(pool, 0)
    assert consumer.take() == _ok(0)  # the thread is started; the next take waits in vain
    with pytest.raises(LoaderTimeoutError, match=r"timed out after 0\.05 seconds"):
        consumer.take()




@pytest.mark.parametrize("build_s", [0.1, 5.0])
def test_tasks_placed_in_time_keep_to_the_workers_the_consumer_needs(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch, build_s: float
) -> None:
    """NOTE [tasks placed in time]: the consumer takes a batch a second (the test's clock);
    builds of 0.1 s keep up on worker 0 alone, builds of 5 s need both workers (each task to
    the one with fewer left)."""
    monkeypatch.setattr(_pump, "SLOW_STEP_S", 1e9)  # the inline driver throughout
    engine, pool = fakes.engine(num_workers=2, prefetch=2, place_in_time=True)
    pump = fakes.pump(engine, _Sampler(12))
    pump.grant(4)
    consumer, now = _Consumer(pump), [0.0]
    for k in range(12):
        now[0] += 1.0
        pool.reply(pool.await_task(k), k, busy_s=build_s)
        assert consumer.take(_clock=lambda: now[0]) == _ok(k)
    assert consumer.take().kind is DONE
    if build_s < 1.0:
        # The first tasks go out before any build time is known: as evenly as round-robin.
        assert pool.seqs(1) == [1, 3]
        assert pool.seqs(0) == [0, 2, *range(4, 12)]
    else:
        assert set(pool.seqs(1)) - {1, 3}, "worker 1 got no task once builds were known slow"
        assert sorted(pool.seqs(0) + pool.seqs(1)) == list(range(12))


def test_without_placing_in_time_tasks_go_round_robin_whatever_the_pace(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pump, "SLOW_STEP_S", 1e9)
    consumer, pool, _ = _start(fakes, batches=8)
    now = [0.0]
    for k in range(8):
        now[0] += 1.0
        pool.reply(pool.await_task(k), k, busy_s=0.1)
        assert consumer.take(_clock=lambda: now[0]) == _ok(k)
    assert (pool.seqs(0), pool.seqs(1)) == ([0, 2, 4, 6], [1, 3, 5, 7])
