"""What the consumer has received of an epoch, kept by the loader beyond its iterator's life.

A training loop that stops at ``max_steps`` leaves its ``for`` loop by ``break`` and only then
calls ``loader.state_dict()``: by then the iterator is gone (and its workers with it), so what
the consumer received cannot be read back from the iterator. Each iterator counts into an
:class:`EpochProgress` that the loader holds instead.
"""

from __future__ import annotations


class EpochProgress:
    """One iteration of an epoch as the consumer saw it.

    ``epoch`` is the resumable sampler's epoch when the iteration began (``-1`` where it has
    none); ``delivered`` the batches handed to the consumer; ``finished`` whether the iteration
    ended by ``StopIteration`` (the ``for`` loop ran to its end), after which a saved state
    starts the next epoch.
    """

    __slots__ = ("delivered", "epoch", "finished")

    def __init__(self, epoch: int = -1) -> None:
        self.epoch = epoch
        self.delivered = 0
        self.finished = False


__all__ = ["EpochProgress"]
