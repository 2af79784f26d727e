"""The engine's logic (``_engine/_engine.py``) against a fake pool: no process, no pipe to a
worker; the test decides what each worker replies and when (``_fake_pool.py``). What real
processes add (deaths by signal, hangs, descriptors) is in ``tests/integration``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from _fake_pool import FakeClock, FakeCodec, FakePool, Fakes, batch_indices

from fastload._engine import _deadline
from fastload._engine._engine import MAX_DEATHS, Engine
from fastload._engine._messages import DONE, EXHAUSTED, FAILED, OK, Resume, TaskMessage
from fastload.errors import LoaderTimeoutError, WorkerCrashedError


def _no_refill() -> None:
    raise AssertionError("refill() is for an exhausted iterable dataset only")


def _put(engine: Engine, batches: range) -> list[tuple[int, int]]:
    indices = [batch_indices(k) for k in batches]
    for index in indices:
        assert engine.put(index)
    return indices


def _answer_all(pool: FakePool) -> None:
    """Every live worker replies to every task it holds."""
    for wid, task in pool.unanswered():
        pool.reply(wid, task.seq)


def _epoch(engine: Engine) -> list[Any]:
    """What get() hands out until DONE (batches as themselves, failures as exceptions)."""
    out = []
    while (item := engine.get(_no_refill)).kind is not DONE:
        out.append(item.value)
    return out


def test_results_that_arrive_out_of_order_leave_in_order(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=2)
    indices = _put(engine, range(4))
    assert (pool.seqs(0), pool.seqs(1)) == ([0, 2], [1, 3])  # torch's round robin
    for wid, seq in [(1, 3), (0, 2), (1, 1)]:
        pool.reply(wid, seq)
    assert engine.collect(_no_refill) == []  # batch 0 has not arrived: nothing may leave
    assert (engine.pending, engine.in_flight) == (3, 1)
    pool.reply(0, 0)
    assert [item.value for item in engine.collect(_no_refill)] == indices
    assert engine.get(_no_refill).kind is DONE


def test_out_of_order_results_leave_in_arrival_order_when_in_order_is_false(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=2, in_order=False)
    indices = _put(engine, range(4))
    for wid, seq in [(1, 3), (0, 0), (1, 1), (0, 2)]:
        pool.reply(wid, seq)
    assert _epoch(engine) == [indices[3], indices[0], indices[1], indices[2]]


def test_a_dead_workers_unfinished_tasks_go_to_its_replacement_and_the_epoch_is_whole(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=3, codec=codec)
    indices = _put(engine, range(6))
    dead = pool.worker(0)
    pool.reply(0, 0)
    pool.reply(1, 1)
    pool.die(0, culprit=2)  # while building batch 2, with batch 4 queued behind it
    assert engine.get(_no_refill).value == indices[0]
    assert engine.get(_no_refill).value == indices[1]
    fresh = pool.worker(0)
    assert fresh.pid != dead.pid and fresh.spec == (0, 0)  # the same id, this epoch's spec
    assert pool.seqs(0) == [2, 4]  # sent again, oldest first
    assert (engine.respawns, engine.retries) == (1, 2)
    assert not pool.lost  # nothing was sent to the dead worker before its replacement
    for wid in (0, 1, 0, 1):
        pool.reply(wid)
    assert _epoch(engine) == indices[2:]
    assert codec.delivered == indices and not codec.dropped  # each batch exactly once


def test_a_batch_that_kills_max_deaths_workers_raises_naming_the_batch_and_its_indices(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=1)
    engine.put([7, 8, 9])
    engine.put([5])
    for deaths in range(1, MAX_DEATHS):
        pool.die(0, culprit=0, exitcode=-11)
        engine.collect(_no_refill)
        assert pool.seqs(0) == [0] and engine.respawns == deaths  # retried on a fresh worker
    pid = pool.worker(0).pid
    pool.die(0, culprit=0, exitcode=-11)
    with pytest.raises(WorkerCrashedError) as raised:
        engine.collect(_no_refill)
    message = str(raised.value)
    assert f"pid {pid} killed by signal 11" in message
    assert "batch 0 from sample indices [7, 8, 9]" in message
    assert f"{MAX_DEATHS} workers died on this batch" in message


def test_a_worker_that_dies_between_tasks_max_deaths_times_in_a_row_raises(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=1)
    engine.put(batch_indices(0))  # worker 1 holds nothing
    for _ in range(MAX_DEATHS - 1):
        pool.die(1, exitcode=1)
        engine.collect(_no_refill)
    assert engine.respawns == MAX_DEATHS - 1
    pool.die(1, exitcode=1)
    with pytest.raises(WorkerCrashedError, match=rf"worker 1 died {MAX_DEATHS} times without building a batch"):
        engine.collect(_no_refill)


def test_a_worker_that_dies_before_building_anything_raises_though_it_holds_tasks(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=1, prefetch=2)
    _put(engine, range(2))
    for _ in range(MAX_DEATHS - 1):
        pool.die(0, exitcode=1)  # in worker_init_fn, say: no culprit, its tasks still queued
        engine.collect(_no_refill)
        assert pool.seqs(0) == [0, 1]
    pool.die(0, exitcode=1)
    with pytest.raises(WorkerCrashedError, match=rf"worker 0 died {MAX_DEATHS} times without building a batch"):
        engine.collect(_no_refill)
    assert engine.respawns == MAX_DEATHS - 1


def test_a_worker_that_delivers_between_deaths_is_respawned_every_time(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=1, prefetch=1)
    for k in range(2 * MAX_DEATHS):
        pool.die(0, exitcode=1)
        engine.collect(_no_refill)
        _put(engine, range(k, k + 1))
        pool.reply(0)
        assert engine.get(_no_refill).value == batch_indices(k)
    assert engine.respawns == 2 * MAX_DEATHS


def test_an_iterable_datasets_worker_death_raises_at_once(fakes: Fakes) -> None:
    engine, pool = fakes.engine(restartable=False)
    _put(engine, range(2))
    pool.die(1, culprit=1)
    with pytest.raises(WorkerCrashedError, match="position cannot be recovered"):
        engine.collect(_no_refill)
    assert engine.respawns == 0


def test_a_failed_batch_is_raised_as_its_own_type_naming_worker_batch_and_indices(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=2, codec=codec)
    indices = _put(engine, range(4))
    pool.fail(1, 1, ValueError("bad sample 11"))
    for wid in (0, 0, 1):
        pool.reply(wid)
    items = [engine.get(_no_refill) for _ in range(4)]
    assert [item.kind for item in items] == [OK, FAILED, OK, OK]  # the epoch goes on after it
    error = items[1].value
    assert type(error) is ValueError
    assert f"worker process 1 (pid {pool.worker(1).pid})" in str(error)
    assert "batch 1 from sample indices [10, 11]" in str(error) and "bad sample 11" in str(error)
    assert codec.dropped == Counter({indices[1]: 1})  # its payload is freed as it arrives


def test_an_exhausted_worker_skips_its_other_tasks_and_asks_for_a_refill(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=2, restartable=False)
    indices = _put(engine, range(4))
    refills = []
    pool.reply(0, 0, kind=EXHAUSTED, payload=None)
    assert engine.collect(lambda: refills.append(1)) == []
    assert refills == [1] and engine.in_flight == 2  # batch 2, queued on worker 0, is skipped
    engine.put(batch_indices(4))
    assert pool.seqs(1) == [1, 3, 4]  # only the active worker gets tasks
    for _ in range(3):
        pool.reply(1)
    assert _epoch(engine) == [indices[1], indices[3], batch_indices(4)]


def test_stale_results_after_a_new_epoch_are_dropped_exactly_once(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=2, codec=codec)
    late, waiting, orphaned, unfinished = _put(engine, range(4))  # on workers 0, 1, 0, 1
    pool.reply(1, 1)  # waits for batch 0 in the reorder buffer
    engine.collect(_no_refill)
    pool.reply(0, 0)  # the new epoch begins before it is received
    engine.new_epoch()
    assert codec.dropped == Counter({waiting: 1})
    assert [w.inbox[-1] for w in pool.incarnations] == [Resume(1), Resume(1)]
    assert engine.collect(_no_refill) == []  # batch 0 of epoch 0: not delivered in epoch 1
    assert codec.dropped == Counter({waiting: 1, late: 1})
    pool.die(0, culprit=2)  # batch 2 of epoch 0 dies with its worker
    engine.collect(_no_refill)
    assert codec.dropped == Counter({waiting: 1, late: 1, orphaned: 1})
    assert pool.worker(0).spec == (0, 1)  # respawned for this epoch
    new = _put(engine, range(10, 12))
    assert (pool.seqs(0), pool.seqs(1)[-1]) == ([0], 1)  # numbered from 0 again, from worker 0
    pool.reply(0, 0)
    pool.reply(1, 1)
    assert _epoch(engine) == new
    engine.close()
    assert codec.dropped == Counter({waiting: 1, late: 1, orphaned: 1, unfinished: 1})
    assert not set(new) & set(codec.dropped)


def test_a_timeout_raises_naming_the_loaders_timeout_counted_from_the_last_arrival(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(_deadline, "time", clock)
    engine, pool = fakes.engine(num_workers=2, prefetch=1, timeout_s=10, clock=clock)
    indices = _put(engine, range(2))
    clock.at(6.0, lambda: pool.reply(1, 1))  # not deliverable yet, but it restarts the count
    clock.at(12.0, lambda: pool.reply(0, 0))
    assert [engine.get(_no_refill).value for _ in range(2)] == indices
    assert clock.now == 12.0
    engine.put(batch_indices(2))
    with pytest.raises(LoaderTimeoutError, match=r"DataLoader timed out after 10 seconds"):
        engine.get(_no_refill)
    assert clock.now == 22.0


def test_close_drops_every_undelivered_payload_exactly_once_and_is_idempotent(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=2, codec=codec)
    delivered, in_flight, failed, waiting = _put(engine, range(4))  # on workers 0, 1, 0, 1
    pool.reply(0, 0)
    pool.fail(0, 2, OSError("unreadable"))
    pool.reply(1, 3)
    assert engine.get(_no_refill).value == delivered
    assert engine.pending == 2  # the failure and batch 3 wait for batch 1
    engine.close()
    engine.close()
    assert codec.dropped == Counter({waiting: 1, in_flight: 1, failed: 1})
    assert pool.closed and all(w.inbox[-1] is None for w in pool.incarnations)  # told to stop


def test_a_batch_the_codec_retries_is_sent_again_with_its_new_index(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=2, codec=codec)
    (index,) = _put(engine, range(1))
    codec.retry_with[index] = bigger = (*index, "bigger slot")
    pool.reply(0)
    assert engine.collect(_no_refill) == []
    assert pool.worker(0).inbox[-1] == TaskMessage(0, 0, bigger)
    pool.reply(0)
    assert _epoch(engine) == [bigger]


def test_a_retiring_worker_gets_no_task_and_leaves_once_its_tasks_are_done(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=3, prefetch=2, max_workers=3)
    indices = _put(engine, range(6))
    engine.retire_worker()
    engine.retire_worker()  # one retirement at a time
    leaving = pool.worker(2)
    pool.reply(2, 2)
    engine.collect(_no_refill)
    assert engine.num_workers == 3 and leaving.live  # batch 5 is still to come
    indices += _put(engine, range(6, 9))
    assert leaving.unanswered() == [TaskMessage(0, 5, batch_indices(5))]  # nothing new for it
    pool.reply(2, 5)
    engine.collect(_no_refill)
    assert engine.num_workers == 2 and len(pool.workers) == 2 and len(engine.worker_pids) == 2
    assert leaving.retired and leaving.inbox[-1] is None and not leaving.unanswered()
    assert not pool.unheard  # it left after its last reply, not before
    _answer_all(pool)
    assert _epoch(engine) == indices


def test_the_last_worker_is_never_retired_and_a_worker_can_be_added_again(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=1, max_workers=2)
    engine.retire_worker()
    assert engine.num_workers == 1  # it held nothing: it left at once
    engine.retire_worker()
    assert engine.num_workers == 1
    engine.add_worker()
    assert engine.num_workers == 2 and pool.worker(1).spec == (1, 0)
    indices = _put(engine, range(2))
    assert pool.seqs(1) == [1]
    pool.reply(1)
    pool.reply(0)
    assert _epoch(engine) == indices


def test_tasks_wait_for_the_workers_held_back_and_go_to_them_once_started(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=3, prefetch=1, start_workers=1)
    _put(engine, range(1))  # the fake refuses a task for a worker not started
    assert pool.workers[1:] == [None, None] and len(engine.worker_pids) == 1
    engine.start_workers()
    _put(engine, range(1, 3))
    assert [pool.seqs(w) for w in range(3)] == [[0], [1], [2]]


def test_a_retiring_worker_whose_last_batch_is_built_again_leaves_after_it(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=1, codec=codec)
    first, last = _put(engine, range(2))  # on workers 0 and 1
    engine.retire_worker()
    codec.retry_with[last] = bigger = (*last, "bigger slot")
    pool.reply(1, 1)
    engine.collect(_no_refill)
    assert pool.worker(1).inbox[-1] == TaskMessage(0, 1, bigger) and engine.num_workers == 2
    pool.reply(1, 1)
    pool.reply(0, 0)
    assert _epoch(engine) == [first, bigger]
    assert engine.num_workers == 1 and len(pool.workers) == 1


def test_a_retiring_worker_whose_iterable_dataset_ends_leaves(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=1, restartable=False)
    first, _ = _put(engine, range(2))
    engine.retire_worker()
    refills: list[int] = []
    pool.reply(1, 1, kind=EXHAUSTED, payload=None)
    engine.collect(lambda: refills.append(1))
    assert refills == [1] and engine.num_workers == 1 and len(pool.workers) == 1
    pool.reply(0, 0)
    assert _epoch(engine) == [first]


def test_a_retirement_pending_at_a_new_epoch_completes_once_its_old_batches_are_back(fakes: Fakes) -> None:
    codec = FakeCodec()
    engine, pool = fakes.engine(num_workers=2, prefetch=1, codec=codec)
    _, last = _put(engine, range(2))
    engine.retire_worker()
    engine.new_epoch()
    leaving = pool.worker(1)
    assert engine.num_workers == 2 and leaving.live  # it may still be writing batch 1
    pool.reply(1, 1)
    engine.collect(_no_refill)
    assert engine.num_workers == 1 and leaving.retired and codec.dropped[last] == 1
    assert not pool.unheard
    indices = _put(engine, range(2))
    assert pool.seqs(0)[-2:] == [0, 1]  # the new epoch's tasks all go to the worker that stays
    _answer_all(pool)
    assert _epoch(engine) == indices


def test_a_batch_that_kills_a_retiring_worker_for_the_last_time_raises_naming_it(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=1)
    engine.put([3])
    engine.put([7, 8, 9])  # on worker 1, the one to retire
    for _ in range(MAX_DEATHS - 1):
        pool.die(1, culprit=1)
        engine.collect(_no_refill)
    engine.retire_worker()
    pool.die(1, culprit=1)
    with pytest.raises(WorkerCrashedError, match=r"batch 1 from sample indices \[7, 8, 9\]"):
        engine.collect(_no_refill)


def test_a_retiring_worker_that_dies_hands_its_tasks_to_the_others(fakes: Fakes) -> None:
    engine, pool = fakes.engine(num_workers=2, prefetch=2)
    indices = _put(engine, range(4))
    engine.retire_worker()
    pool.die(1, culprit=1)
    engine.collect(_no_refill)
    assert engine.num_workers == 1 and pool.seqs(0) == [0, 2, 1, 3]
    assert (engine.respawns, engine.retries) == (0, 2)
    _answer_all(pool)
    assert _epoch(engine) == indices


def test_retire_worker_says_whether_a_worker_will_leave(fakes: Any) -> None:
    engine, _ = fakes.engine(num_workers=2)
    assert engine.retire_worker() is True and engine.staying_workers == 1
    assert engine.retire_worker() is False  # never below one worker
    assert engine.staying_workers == 1


def test_tasks_placed_in_time_survive_a_death_on_the_busy_worker(fakes: Fakes) -> None:
    """NOTE [tasks placed in time]: worker 0 holds every task the consumer needs; it dies, a
    fresh process takes them over, each batch still comes once and in order, and the fresh
    worker is counted from nothing sent (what the dead one had left does not weigh on it)."""
    engine, pool = fakes.engine(num_workers=2, prefetch=4, place_in_time=True)
    indices = [batch_indices(k) for k in range(8)]
    assert engine.put(indices[0], due_s=10.0)
    pool.reply(0, 0, busy_s=1.0)  # a build takes 1 s; the consumer needs one in 10 s
    assert engine.collect(_no_refill)[0].value == indices[0]
    for k in range(1, 5):
        assert engine.put(indices[k], due_s=10.0)
    assert (pool.seqs(0), pool.seqs(1)) == ([0, 1, 2, 3, 4], [])
    pool.reply(0, 1, busy_s=1.0)
    pool.die(0, culprit=2)
    assert [item.value for item in engine.collect(_no_refill)] == [indices[1]]
    assert [t.seq for t in pool.worker(0).unanswered()] == [2, 3, 4]  # the fresh process
    assert engine.put(indices[5], due_s=5.0)  # 3 left on the fresh worker: room for a fourth
    assert pool.seqs(0)[-1] == 5 and pool.seqs(1) == []
    for k in range(6, 8):
        assert engine.put(indices[k], due_s=2.0)  # due too soon for worker 0: worker 1
    assert pool.seqs(1) == [6, 7]
    _answer_all(pool)
    assert _epoch(engine) == indices[2:]
    assert engine.respawns == 1 and engine.retries == 3
