"""The only package with processes, threads and shared memory."""

from fastload._engine._engine import DONE, Engine
from fastload._engine._fetch import make_fetcher
from fastload._engine._worker import FAILED, OK, WorkerSpec

__all__ = ["DONE", "FAILED", "OK", "Engine", "WorkerSpec", "make_fetcher"]
