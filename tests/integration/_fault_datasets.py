"""Datasets that misbehave on purpose, importable by worker processes of any start method."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Slow(Dataset):
    """Sample ``i`` is ``i``; each read sleeps ``delay_s`` so an epoch lasts long enough to be
    interrupted."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.tensor(i)


class DiesOnce(Slow):
    """Kills its own worker the first time sample ``victim`` is read (``how``: "exit" for
    ``os._exit``, "segfault" for a real SIGSEGV, "kill" for SIGKILL); a marker file makes the
    retry succeed."""

    def __init__(self, n: int, victim: int, marker: Path, how: str = "exit") -> None:
        super().__init__(n)
        self.victim = victim
        self.marker = str(marker)
        self.how = how

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.victim and not os.path.exists(self.marker):
            Path(self.marker).touch()
            die(self.how)
        return torch.tensor(i)


class Poison(Slow):
    """Sample ``victim`` kills every worker that reads it."""

    def __init__(self, n: int, victim: int) -> None:
        super().__init__(n)
        self.victim = victim

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.victim:
            die("exit")
        return torch.tensor(i)


class Hangs(Slow):
    def __init__(self, n: int, victim: int) -> None:
        super().__init__(n)
        self.victim = victim

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.victim:
            time.sleep(60)
        return torch.tensor(i)


def die(how: str) -> None:
    if how == "segfault":
        ctypes.string_at(0)
    if how == "kill":
        os.kill(os.getpid(), 9)
    os._exit(3)
