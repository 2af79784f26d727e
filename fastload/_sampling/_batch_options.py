"""Validated batching options shared by every length-grouped sampler.

Every check names the option, the value and the bound, and runs at construction, so a bad value
fails at once instead of in the middle of an epoch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from fastload._types import Field

OversizePolicy = Literal["error", "skip", "truncate"]
OVERSIZE_POLICIES: tuple[str, ...] = ("error", "skip", "truncate")


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer; got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def check_optional_int(name: str, value: object, *, minimum: int) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def as_lengths(name: str, lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``lengths`` as a read-only, contiguous int64 copy (owned by the sampler, so a caller that
    mutates its array later cannot change a plan, and forked workers share the pages)."""
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one length per sample); got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers; got dtype {array.dtype}")
    result = np.array(array, dtype=np.int64, copy=True)
    if result.size and int(result.min()) < 0:
        first = int(np.flatnonzero(result < 0)[0])
        raise ValueError(f"{name}[{first}] is {int(result[first])}; lengths must be >= 0")
    result.flags.writeable = False
    return result


def uniform_lengths_message(
    lengths: npt.NDArray[np.int64],
    *,
    option: str,
    dataset: str,
    fields: Mapping[str, Field] | None,
    packing: bool = False,
) -> str | None:
    """What to tell the user when ``option`` (``length_grouped=True``, ``max_tokens=N``,
    ``pack_length=N``) gets nothing from the lengths of ``dataset`` (its type name), whose
    ``fields`` say where the lengths come from: all equal, so grouping by length groups
    nothing (for packing: all 1, samples of one element each). ``None`` when they vary."""
    if lengths.size < 2:
        return None
    first = int(lengths[0])
    if not bool((lengths == first).all()) or (packing and first != 1):
        return None
    ragged = [name for name, field in (fields or {}).items() if field.kind == "ragged"]
    if fields is None:
        source = "its `lengths`"
    elif not ragged:
        names = ", ".join(repr(name) for name in fields)
        source = f"it has no ragged field (fields: {names}), so every sample counts as length 1"
    elif len(ragged) == 1:
        source = f"the lengths of its ragged field {ragged[0]!r}"
    else:
        source = f"the lengths of its length field (one of {', '.join(map(repr, ragged))})"
    effect = "packs one-element samples" if packing else "groups nothing"
    return (
        f"{dataset}: all {lengths.size:,} lengths are {first} ({source}), so {option} {effect}; "
        "a text column is read as one value per sample: tokenize it first (fastload convert "
        "--tokenizer ...) or give the ragged field to group by (length_field=)"
    )


def round_up(values: npt.NDArray[np.int64], multiple: int) -> npt.NDArray[np.int64]:
    """``values`` rounded up to a multiple of ``multiple`` (elementwise, int64)."""
    if multiple == 1:
        return values
    return -(-values // multiple) * multiple


@dataclass(frozen=True)
class BatchingOptions:
    """How an epoch's samples are cut into batches.

    * ``batch_size`` caps the rows of a batch; alone, every batch has exactly ``batch_size`` rows
      except one partial batch per epoch.
    * ``max_tokens`` caps the padded size of a batch: rows * the longest length in the batch,
      rounded up to ``pad_to_multiple_of``. With ``batch_size`` as well, both caps hold.
    * ``window`` is the sort window in batches: samples are spread over
      ``ceil(n / (window * rows per batch))`` random windows and sorted by length inside each,
      rows per batch being ``batch_size``, or with ``max_tokens`` the budget over the mean
      padded length (capped by ``batch_size``). ``None`` sorts the whole epoch as one window
      (best padding, least randomness).
    """

    batch_size: int | None
    max_tokens: int | None
    pad_to_multiple_of: int
    window: int | None
    shuffle: bool
    drop_last: bool
    longest_first: bool

    @classmethod
    def create(
        cls,
        *,
        batch_size: object,
        max_tokens: object,
        pad_to_multiple_of: object,
        window: object,
        shuffle: object,
        drop_last: object,
        longest_first: object,
    ) -> BatchingOptions:
        rows = check_optional_int("batch_size", batch_size, minimum=1)
        tokens = check_optional_int("max_tokens", max_tokens, minimum=1)
        if rows is None and tokens is None:
            raise ValueError(
                "give batch_size (rows per batch), max_tokens (a padded-token budget per batch) "
                "or both; got neither"
            )
        multiple = check_optional_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1) or 1
        if tokens is not None and multiple > tokens:
            raise ValueError(
                f"pad_to_multiple_of={multiple} exceeds max_tokens={tokens}: no row of any "
                "length would fit the budget"
            )
        for name, flag in (
            ("shuffle", shuffle),
            ("drop_last", drop_last),
            ("longest_first", longest_first),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False; got {flag!r}")
        return cls(
            batch_size=rows,
            max_tokens=tokens,
            pad_to_multiple_of=multiple,
            window=check_optional_int("window", window, minimum=1),
            shuffle=bool(shuffle),
            drop_last=bool(drop_last),
            longest_first=bool(longest_first),
        )

    def rows_per_batch(self, mean_padded_length: float) -> float:
        """The expected rows of a batch, which sizes the sort windows."""
        if self.max_tokens is None:
            assert self.batch_size is not None
            return float(self.batch_size)
        rows = max(1.0, self.max_tokens / max(mean_padded_length, 1.0))
        return rows if self.batch_size is None else min(rows, float(self.batch_size))

    def samples_per_window(self, num_samples: int, mean_padded_length: float) -> int:
        """Samples in one sort window (>= 1): ``window`` batches' worth, or the whole epoch."""
        if self.window is None:
            return max(1, num_samples)
        return max(1, math.ceil(self.window * self.rows_per_batch(mean_padded_length)))

    def as_state(self) -> dict[str, int | bool | None]:
        """The options that shape a plan, as JSON-able values (kept in ``state_dict`` so a state
        is never loaded into a sampler that would plan differently)."""
        return {
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "window": self.window,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "longest_first": self.longest_first,
        }
