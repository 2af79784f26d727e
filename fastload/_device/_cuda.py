"""``torch.cuda`` for the rest of fastload: whether there is a device, which one a loader copies
to, and :class:`CudaOps`, the device's streams and events as the prefetcher uses them."""

from __future__ import annotations

from typing import Any

import torch

from fastload._device._ops import map_tensors


def to_device(data: Any, device: torch.device) -> Any:
    """``data`` with every tensor moved to ``device`` (``non_blocking``), keeping containers."""
    return map_tensors(data, lambda t: t.to(device, non_blocking=True))


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device to prefetch to, or ``None`` when batches stay where they are."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} was requested but CUDA is not available on this machine; "
            "pass device=None (or 'cpu') to keep batches on the host"
        )
    return dev


class CudaOps:
    """:class:`~fastload._device._ops.DeviceOps` of one CUDA device: ``torch.cuda`` streams,
    events with timing, and ``non_blocking`` copies whose device tensors are marked with
    ``record_stream`` for the stream that uses them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def timed_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def to_device(self, data: Any, copy_on: torch.cuda.Stream, used_on: torch.cuda.Stream) -> Any:
        def move(tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.to(self.device, non_blocking=True)
            if out.is_cuda:
                out.record_stream(used_on)
            return out

        with torch.cuda.stream(copy_on):
            return map_tensors(data, move)

    def run_on(self, fn: Any, data: Any, stream: torch.cuda.Stream, used_on: torch.cuda.Stream) -> Any:
        def mark(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.is_cuda:
                tensor.record_stream(used_on)
            return tensor

        with torch.cuda.stream(stream):
            return map_tensors(fn(data), mark)
