"""A worker process answers the fast path's common tasks directly (NOTE [direct replies] in
``_engine/_worker.py``), and every other task the general way, in the order they came."""

from __future__ import annotations

import multiprocessing
import os
import select
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _procs import alive
from _token_files import write_token_file

import fastload
from fastload._engine._arena import SlotArena
from fastload._engine._builder import SlotBuilder
from fastload._engine._messages import FAILED, OK, Resume
from fastload._engine._slots import SlotCodec, decode_reply
from fastload._engine._transport import dumps_task, take_frames, write_frame
from fastload._engine._worker import WorkerSpec, worker_main

N = 200


class _Counting(SlotBuilder):
    """Counts, in shared memory, the tasks it answered directly."""

    def __init__(self, *args: Any, direct: Any) -> None:
        super().__init__(*args)
        self.direct = direct

    def direct_reply(self, data: bytes) -> bytes | None:
        reply = super().direct_reply(data)
        if reply is not None:
            self.direct.value += 1
        return reply


def _replies(fd: int, count: int) -> list[Any]:
    inbox, out = bytearray(), []
    while len(out) < count:
        assert select.select([fd], [], [], 30)[0], f"no reply within 30 s after {len(out)} of {count}"
        chunk = os.read(fd, 1 << 20)
        assert chunk, f"the worker closed its pipe after {len(out)} of {count} replies"
        inbox += chunk
        out += take_frames(inbox, decode_reply)
    return out


def test_a_worker_answers_common_tasks_directly_and_the_rest_the_general_way(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "d.h5", N, 60, seed=3)
    ds = fastload.HDF5Dataset(path, fields=["tokens"])
    collate = fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)
    ctx = multiprocessing.get_context("fork")
    direct = ctx.RawValue("q", 0)
    arena = SlotArena(slot_bytes=1 << 15, slots=8, max_bytes=1 << 26)
    arena.resize(1 << 15)
    codec = SlotCodec(arena)
    spec = WorkerSpec(
        dataset=ds, auto_collation=True, collate_fn=collate, drop_last=False, base_seed=0,
        worker_init_fn=None, worker_id=0, num_workers=1, main_pid=os.getpid(), epoch=0,
        builder=_Counting(ds, collate, os.getpid(), direct=direct),
    )  # fmt: skip
    task_r, task_w = os.pipe()
    result_r, result_w = os.pipe()
    progress, finished = ctx.RawArray("q", [-1]), ctx.RawArray("q", 1)
    ends = Connection(task_r, writable=False), Connection(result_w, readable=False)
    worker = ctx.Process(target=worker_main, args=(spec, *ends, progress, finished, (task_w, result_r)))
    worker.start()
    for end in ends:
        end.close()  # the worker's now
    plans = [[1, 2, 3], [N - 1, 0], [5, N], [-1, 4], list(range(0, N, 9)), [7]]
    tasks = [codec.task(p) for p in plans]
    try:
        for seq, task in enumerate(tasks[:3]):
            write_frame(task_w, codec.task_message(0, seq, task))
        write_frame(task_w, dumps_task(Resume(0)))  # a pickled message between the tasks
        for seq, task in enumerate(tasks[3:], start=3):
            write_frame(task_w, codec.task_message(0, seq, task))
        replies = _replies(result_r, len(plans))
    finally:
        os.close(task_w)
        worker.join(10)
        os.close(result_r)
    assert not alive(worker.pid) and worker.exitcode == 0
    assert [r.seq for r in replies] == list(range(len(plans)))  # in the order sent
    assert finished[0] == len(plans) and progress[0] == -1
    # [5, N] names its bad index the general way; [-1, 4] is read the general way.
    assert replies[2].kind == FAILED and "index 200" in replies[2].payload.message
    assert direct.value == len(plans) - 2
    for reply, task, plan in zip(replies, tasks, plans, strict=True):
        if reply.kind != OK:
            codec.drop(task)
            continue
        batch, counts = codec.deliver(task, reply.payload)
        for row, i in enumerate(plan):
            sample = np.asarray(ds[i]["tokens"])
            assert np.array_equal(batch["tokens"][row, : len(sample)].numpy(), sample)
            assert int(batch["lengths"][row]) == len(sample)
        assert counts is not None and counts.rows == len(plan)
        del batch
    arena.close()
