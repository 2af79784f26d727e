"""The generic runner: any dataset, any ``collate_fn``, torch's protocol to the letter (the
consumer's ``next()`` drives the engine, then refills from the sampler). See ``_runner.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastload._engine._messages import DONE, Delivery
from fastload._engine._wiring import (
    RunnerBase,
    SpecFactory,
    engine_fields,
    start_engine,
    worker_spec,
)
from fastload.errors import FastloadError

if TYPE_CHECKING:
    from fastload._engine._runner import RunnerOptions


class GenericRunner(RunnerBase):
    """torch's protocol: ``next()`` drives the engine, then refills from the sampler."""

    fast = False

    def __init__(self, options: RunnerOptions, sampler_iter: Iterator[Any]) -> None:
        self._options = options
        self._sampler_iter = sampler_iter
        self._skip_refills = 0  # after a worker retires: fewer tasks in flight
        self._final: dict[str, Any] | None = None
        self._engine = start_engine(options, SpecFactory(worker_spec(options, None), options.host), None, None)
        self._engine.dispatch_from(options.first_worker)
        self._prime()

    def _prime(self) -> None:
        for _ in range(self._options.prefetch_factor * self._engine.staying_workers):
            self._try_put()

    def _try_put(self) -> None:
        """torch's ``_try_put_index``: one more task, if the sampler has one and a worker is
        active (the index is consumed from the sampler either way)."""
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            return
        self._engine.put(index)

    def get(self) -> Delivery:
        try:
            item = self._engine.get(self._try_put)
        except FastloadError:
            self.close(join_s=0.1)  # a dead or hung worker: this epoch cannot go on
            raise
        if item.kind is not DONE:
            if self._skip_refills:
                self._skip_refills -= 1
            else:
                self._try_put()
        return item

    def new_epoch(self, sampler_iter: Iterator[Any], shared_seed: int | None = None) -> None:
        self._sampler_iter = sampler_iter
        self._engine.new_epoch(shared_seed)
        self._skip_refills = 0  # the new epoch is primed for the workers that stay
        self._prime()

    def add_worker(self) -> None:
        self._engine.add_worker()
        for _ in range(self._options.prefetch_factor):
            self._try_put()

    def retire_worker(self) -> None:
        if self._engine.retire_worker():
            self._skip_refills += self._options.prefetch_factor

    def fields(self) -> dict[str, Any]:
        return dict(self._final) if self._final is not None else engine_fields(self._engine, False)

    def close(self, join_s: float = 2.0) -> None:
        if self._final is None:
            self._final = engine_fields(self._engine, False)
        self._engine.close(join_s)
