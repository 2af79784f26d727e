"""The engine's pure bookkeeping, without processes."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from fastload._engine._bookkeeping import Dispatcher, ReorderBuffer, RetryBudgetExceeded, Task


def _dispatcher(num_workers: int = 2, *, max_tasks: int = 4, in_order: bool = True) -> Dispatcher:
    return Dispatcher(num_workers, max_tasks=max_tasks, in_order=in_order, max_deaths=3)


def test_in_order_dispatch_cycles_round_robin_like_torch() -> None:
    d = _dispatcher(3)
    picks = []
    for seq in range(7):
        wid = d.pick_worker()
        assert wid is not None
        d.assign(wid, Task(seq, [seq]))
        picks.append(wid)
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert d.in_flight == 7


def test_inactive_workers_are_skipped_and_their_tasks_dropped() -> None:
    d = _dispatcher(2)
    for seq in range(4):
        d.assign(d.pick_worker(), Task(seq, None))  # type: ignore[arg-type]
    assert [t.seq for t in d.deactivate(0)] == [0, 2]
    assert d.in_flight == 2
    assert [d.pick_worker() for _ in range(3)] == [1, 1, 1]


def test_no_worker_is_picked_when_all_are_exhausted() -> None:
    d = _dispatcher(2)
    d.deactivate(0)
    d.deactivate(1)
    assert d.pick_worker() is None


def test_out_of_order_dispatch_skips_a_worker_holding_its_share() -> None:
    d = _dispatcher(2, max_tasks=4, in_order=False)
    d.assign(0, Task(0, None))
    d.assign(0, Task(1, None))  # worker 0 holds 4 // 2 = 2 tasks: its share
    assert d.pick_worker() == 1
    assert d.pick_worker() == 1


def test_complete_returns_the_holder_and_frees_the_task() -> None:
    d = _dispatcher(2)
    task = Task(5, [1, 2])
    d.assign(1, task)
    assert d.tasks_of(1) == [task] and d.in_flight == 1
    assert d.complete(5) is task
    assert d.tasks_of(1) == []
    assert d.in_flight == 0


def test_a_lost_worker_returns_its_tasks_oldest_first_and_blames_only_the_culprit() -> None:
    d = _dispatcher(2)
    d.assign(0, Task(0, [0]))
    d.assign(0, Task(2, [2]))
    lost = d.lose_worker(0, culprit=2)
    assert [t.seq for t in lost] == [0, 2]
    assert [t.deaths for t in lost] == [0, 1]
    assert d.in_flight == 0


def test_a_worker_dying_between_tasks_blames_nobody() -> None:
    d = _dispatcher(1)
    d.assign(0, Task(0, [0]))
    (task,) = d.lose_worker(0, culprit=None)
    assert task.deaths == 0


def test_a_task_that_kills_max_deaths_workers_exceeds_the_budget() -> None:
    d = _dispatcher(1)
    task = Task(7, [3, 4])
    for _ in range(2):
        d.assign(0, task)
        (again,) = d.lose_worker(0, culprit=7)
        assert again is task
    d.assign(0, task)
    with pytest.raises(RetryBudgetExceeded) as info:
        d.lose_worker(0, culprit=7)
    assert info.value.task.seq == 7
    assert info.value.task.deaths == 3


def test_reactivate_all_restarts_the_cycle_and_hands_back_held_tasks() -> None:
    d = _dispatcher(3)
    d.assign(d.pick_worker(), Task(0, None))  # type: ignore[arg-type]
    d.deactivate(1)
    held = d.reactivate_all()
    assert [(wid, t.seq) for wid, t in held] == [(0, 0)]
    assert d.in_flight == 0
    assert d.pick_worker() == 0
    assert d.is_active(0)


def test_dispatcher_rejects_zero_workers() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        Dispatcher(0, max_tasks=2, in_order=True, max_deaths=3)


def test_reorder_buffer_releases_strictly_in_sequence() -> None:
    buf: ReorderBuffer[str] = ReorderBuffer(in_order=True)
    buf.push(1, "b")
    buf.push(2, "c")
    assert buf.pop() == (False, None)
    buf.push(0, "a")
    assert [buf.pop() for _ in range(4)] == [(True, "a"), (True, "b"), (True, "c"), (False, None)]


@pytest.mark.parametrize("in_order", [True, False])
def test_reorder_buffer_memory_stays_flat_over_a_long_epoch(in_order: bool) -> None:
    buf: ReorderBuffer[int] = ReorderBuffer(in_order=in_order)
    for seq in range(1000):  # warm up whatever the buffer keeps at its size
        buf.push(seq, seq)
        buf.pop()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in range(1000, 60_000):
            buf.push(seq, seq)
            assert buf.pop() == (True, seq)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"{grown} bytes kept after 59,000 batches passed through"


def test_reorder_buffer_steps_over_skipped_sequence_numbers() -> None:
    buf: ReorderBuffer[str] = ReorderBuffer(in_order=True)
    buf.skip(0)
    buf.skip(2)
    buf.push(3, "d")
    buf.push(1, "b")
    assert buf.pop() == (True, "b")
    assert buf.pop() == (True, "d")
    assert buf.next_seq == 4


def test_out_of_order_buffer_releases_in_arrival_order() -> None:
    buf: ReorderBuffer[str] = ReorderBuffer(in_order=False)
    buf.push(3, "x")
    buf.push(0, "y")
    assert buf.pop() == (True, "x")
    assert buf.pop() == (True, "y")
    assert buf.pending == 0


def test_reorder_buffer_refuses_a_duplicate_delivery() -> None:
    buf: ReorderBuffer[str] = ReorderBuffer(in_order=True)
    buf.push(0, "a")
    buf.pop()
    with pytest.raises(ValueError, match="already delivered"):
        buf.push(0, "again")


@pytest.mark.parametrize("in_order", [True, False])
def test_pop_ready_hands_out_what_repeated_pops_would(in_order: bool) -> None:
    rng = random.Random(7)
    one: ReorderBuffer[int] = ReorderBuffer(in_order=in_order)
    many: ReorderBuffer[int] = ReorderBuffer(in_order=in_order)
    order = list(range(400))
    rng.shuffle(order)
    for seq in order:  # arrivals out of sequence, some never produce an item
        for buf in (one, many):
            if seq % 7 == 3:
                buf.skip(seq)
            else:
                buf.push(seq, seq * 10)
        if rng.random() < 0.3:
            popped = []
            while (got := one.pop())[0]:
                popped.append(got[1])
            assert many.pop_ready() == popped
            assert (many.next_seq, many.pending) == (one.next_seq, one.pending)
    assert many.pop_ready() == [item for found, item in iter(one.pop, (False, None))]
    assert many.pending == one.pending == 0


def test_drain_returns_every_held_item() -> None:
    buf: ReorderBuffer[int] = ReorderBuffer(in_order=True)
    buf.push(2, 20)
    buf.push(5, 50)
    assert sorted(buf.drain()) == [20, 50]
    assert buf.pending == 0


def test_an_added_worker_joins_the_cycle() -> None:
    d = _dispatcher(1)
    assert d.pick_worker() == 0
    assert d.add_worker() == 1
    assert sorted(d.pick_worker() for _ in range(4)) == [0, 0, 1, 1]


def test_a_retiring_worker_gets_no_task_and_leaves_once_drained() -> None:
    d = _dispatcher(2)
    d.assign(1, Task(0, None))
    assert d.retirements == 0  # the engine looks for a leaving worker only while this is not
    assert d.retire_last() == 1
    assert d.retire_last() == 1  # asked again before it left: still one retirement
    assert d.retirements == 1
    assert [d.pick_worker() for _ in range(3)] == [0, 0, 0]
    with pytest.raises(RuntimeError, match="holds no task"):
        d.remove_last()
    d.complete(0)
    d.remove_last()
    assert d.retirements == 0
    assert d.num_workers == 1
    assert d.reactivate_all() == []
    assert d.pick_worker() == 0


class _Finished(dict[int, int]):
    """What each worker has finished, as the pool's ``finished(wid)`` reports it."""

    def __call__(self, wid: int) -> int:
        return self.get(wid, 0)


def _place(d: Dispatcher, seq: int, finished: _Finished, build_s: float, due_s: float) -> int:
    wid = d.pick_in_time(finished, build_s, due_s)
    assert wid is not None
    d.assign(wid, Task(seq, None))
    return wid


def test_tasks_in_time_go_to_the_lowest_worker_that_builds_them_before_they_are_due() -> None:
    d, finished = _dispatcher(3, max_tasks=12), _Finished()
    # 1 s a build, due in 3 s: worker 0 can hold 3 (the third is built at 3 s), then worker 1.
    picks = [_place(d, seq, finished, 1.0, 3.0) for seq in range(7)]
    assert picks == [0, 0, 0, 1, 1, 1, 2]
    finished[0] = 2  # worker 0 built two of its tasks: it has room again, before the others
    assert [_place(d, seq, finished, 1.0, 3.0) for seq in (7, 8)] == [0, 0]
    # Due later than every worker's backlog allows: the lowest-numbered worker still wins.
    assert _place(d, 9, finished, 1.0, 100.0) == 0


def test_tasks_late_everywhere_go_to_the_worker_with_fewest_left() -> None:
    d, finished = _dispatcher(3, max_tasks=12), _Finished()
    # Builds slower than the consumer (or not measured yet: inf): as even as round-robin.
    assert [_place(d, seq, finished, 5.0, 1.0) for seq in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [_place(d, seq, finished, float("inf"), 0.0) for seq in range(6, 9)] == [0, 1, 2]
    finished[2] = 3  # worker 2 finished all it had: fewest left
    assert _place(d, 9, finished, 5.0, 1.0) == 2


def test_tasks_in_time_skip_inactive_and_retiring_workers() -> None:
    d, finished = _dispatcher(3, max_tasks=12), _Finished()
    d.deactivate(0)
    d.retire_last()
    assert [_place(d, seq, finished, 1.0, 10.0) for seq in range(3)] == [1, 1, 1]
    d.deactivate(1)
    assert d.pick_in_time(finished, 1.0, 10.0) is None


def test_a_respawned_worker_starts_with_nothing_sent() -> None:
    d, finished = _dispatcher(2, max_tasks=8), _Finished()
    for seq in range(2):
        _place(d, seq, finished, 1.0, 2.0)  # worker 0 holds both
    lost = d.lose_worker(0, culprit=None)
    d.replaced(0)  # the pool's count of what the fresh process finished starts at 0 too
    for task in lost:
        d.assign(0, task)
    assert _place(d, 2, finished, 1.0, 3.0) == 0  # 2 left on the fresh worker, room for a third
    assert _place(d, 3, finished, 1.0, 3.0) == 1


def test_no_worker_holds_more_than_one_task_beyond_its_share_however_early_the_due() -> None:
    # 2 workers, 4 tasks out: a share of 2 each, so at most 3 left on any one worker.
    d, finished = _dispatcher(2, max_tasks=4), _Finished()
    assert [_place(d, seq, finished, 0.001, 100.0) for seq in range(5)] == [0, 0, 0, 1, 1]
    finished[0] = 1
    assert _place(d, 5, finished, 0.001, 100.0) == 0
