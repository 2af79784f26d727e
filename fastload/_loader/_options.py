"""The loader's own options (those torch's DataLoader does not have), validated once, in the
constructor, and read by name from then on."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from fastload._device import cuda_device
from fastload.errors import MissingExtraError


@dataclass(frozen=True)
class LoaderOptions:
    """fastload's keyword options of :class:`fastload.DataLoader` (see its docstring for what
    each does). Build with :meth:`create`, which checks every value."""

    length_grouped: bool = False
    max_tokens: int | None = None
    pack_length: int | None = None
    shuffle_shards: int | None = None
    download_concurrency: int | None = None  # None: _shard_traffic.DOWNLOAD_CONCURRENCY
    readahead: bool = False  # workers hint the kernel about queued batches' byte ranges
    seed: int = 0
    device: torch.device | None = None  # the CUDA device batches are copied to; None: the host
    requested_device: str | torch.device | None = None  # as the user gave it
    max_shared_bytes: int | None = None
    log_every_s: float | None = None
    progress: bool = False
    auto_workers: bool = False  # num_workers="auto"
    host_tuning: bool | None = None  # None: the FASTLOAD_HOST_TUNING environment variable

    @classmethod
    def create(
        cls,
        *,
        num_workers: Any,
        length_grouped: Any,
        max_tokens: Any,
        pack_length: Any,
        shuffle_shards: Any,
        seed: Any,
        download_concurrency: Any = None,
        readahead: Any = False,
        device: Any,
        max_shared_bytes: Any,
        log_every_s: Any,
        progress: Any,
        host_tuning: Any,
        batch_size: Any = 1,
    ) -> LoaderOptions:
        """The options, each checked: a bad value raises naming the option, the value and
        what it must be; so do options that contradict each other or that the loader would
        ignore (see :meth:`check_use` for those that depend on the dataset)."""
        if isinstance(num_workers, str) and num_workers != "auto":
            raise ValueError(
                f"num_workers must be an integer >= 0 or 'auto'; got {num_workers!r}"
            )
        if progress:
            try:
                import tqdm  # noqa: F401
            except ImportError as exc:
                raise MissingExtraError.for_extra("progress=True", "tqdm", "progress") from exc
        grouped = _flag("length_grouped", length_grouped)
        packed = _positive_int("pack_length", pack_length, optional=True)
        if grouped and packed is not None:
            raise ValueError(
                "length_grouped=True and pack_length= are two ways to batch by length; choose "
                "one (pack_length packs several documents per row, with no padding between them)"
            )
        tokens = _positive_int("max_tokens", max_tokens, optional=True)
        if packed is not None and tokens is not None:
            _check_packing_budget(packed, tokens, batch_size)
        if _flag("readahead", readahead) and num_workers == 0:
            raise ValueError(
                "readahead=True has the workers tell the kernel which byte ranges their queued "
                "batches read; with num_workers=0 there are none and it would be ignored: give "
                "num_workers >= 1 (or 'auto'), or leave readahead off"
            )
        return cls(
            length_grouped=grouped,
            max_tokens=tokens,
            pack_length=packed,
            shuffle_shards=_positive_int("shuffle_shards", shuffle_shards, optional=True),
            download_concurrency=_positive_int(
                "download_concurrency", download_concurrency, optional=True
            ),
            readahead=_flag("readahead", readahead),
            seed=_seed(seed),
            device=_device(device),
            requested_device=device,
            max_shared_bytes=_positive_int("max_shared_bytes", max_shared_bytes, optional=True),
            log_every_s=_log_every_s(log_every_s),
            progress=_flag("progress", progress),
            auto_workers=num_workers == "auto",
            host_tuning=None if host_tuning is None else _flag("host_tuning", host_tuning),
        )


    def check_use(self, *, dataset: str, remote: bool) -> None:
        """Refuse options that the loader being built would ignore: ``download_concurrency`` for
        a local ``dataset`` (its type name). (A ``seed`` without a length-grouped or packed plan
        is accepted: one configuration that toggles ``length_grouped`` keeps its seed.)"""
        if self.download_concurrency is not None and not remote:
            raise ValueError(
                f"download_concurrency={self.download_concurrency} sets how many shards of a "
                f"remote dataset download at once; this {dataset} is local, so it would be "
                "ignored: leave it out"
            )


def _check_packing_budget(pack_length: int, max_tokens: int, batch_size: Any) -> None:
    """``pack_length`` with ``max_tokens``: the budget decides the rows of a batch
    (``max_tokens // pack_length``), so a ``batch_size`` other than torch's default 1 (or None)
    would be ignored, and a budget below one row fits nothing."""
    if max_tokens < pack_length:
        raise ValueError(
            f"max_tokens={max_tokens} is less than pack_length={pack_length}: not one row of "
            f"pack_length tokens fits the budget; raise max_tokens to at least {pack_length}"
        )
    rows = max_tokens // pack_length
    if batch_size is not None and batch_size != 1 and batch_size != rows:
        raise ValueError(
            f"pack_length={pack_length} with max_tokens={max_tokens} makes each batch "
            f"max_tokens // pack_length = {rows} row(s); batch_size={batch_size} would be ignored: "
            "give batch_size (rows per batch) or max_tokens (tokens per batch), not both"
        )


def _flag(option: str, value: Any) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{option} must be True or False; got {value!r}")
    return bool(value)


def _positive_int(option: str, value: Any, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{option} must be a positive integer or None; got {value!r}")
    return int(value)


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"seed must be an integer >= 0; got {value!r}")
    return int(value)


def _log_every_s(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"log_every_s must be a positive number of seconds or None; got {value!r}")
    return float(value)


def _device(value: Any) -> torch.device | None:
    """The CUDA device to copy batches to, or ``None`` to keep them on the host."""
    if value is None:
        return None
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be None, 'cpu' or a CUDA device such as 'cuda' or 'cuda:0'; got {value!r}"
        ) from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device={value!r}: fastload copies batches to a CUDA device or keeps them on the host "
            "('cpu' or None); for another accelerator, move the batch in your training step"
        )
    return cuda_device(dev)  # raises when CUDA is not available
