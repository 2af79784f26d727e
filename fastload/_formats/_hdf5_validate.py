"""Construction-time checks of one HDF5 file: offsets, and the ``/lengths`` index.

Only index data is read (offsets, ``/lengths``, variable-length descriptors), never a payload.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from fastload._formats._block_cache import BlockCache
from fastload._formats._hdf5_layout import LENGTHS_INDEX, H5Contents, H5Field
from fastload._formats._hdf5_shard import H5Shard, ShardPlacement
from fastload._formats._validate import check_lengths_agree
from fastload.errors import DataFormatError


def validate_shard(
    file: str, shard: int, found: H5Contents, selected: dict[str, H5Field]
) -> tuple[str | None, dict[str, npt.NDArray[np.int64]], ShardPlacement | None]:
    """Validate the offsets of the ``selected`` ragged fields of ``file`` and its ``/lengths``
    index. Returns the field ``/lengths`` describes (``None`` without one), the lengths of
    every selected ragged field, so that none has to be computed twice, and where the selected
    fields lie when all of them are memory-mapped (see :class:`ShardPlacement`)."""
    candidates = _lengths_index_candidates(file, found)
    specs = {**{n: found.fields[n] for n in candidates}, **selected}
    reader = H5Shard(file, shard, specs, BlockCache(0))
    try:
        checked = {
            name: reader.checked_lengths(name, spec)
            for name, spec in specs.items()
            if spec.field.kind == "ragged"
        }
        matched = None
        if candidates:
            stored = reader.lengths_index()
            matched = _check_lengths_index(file, stored, {n: checked[n] for n in candidates})
        placement = reader.placement(list(selected))
    finally:
        reader.close()
    return matched, checked, placement


def _lengths_index_candidates(file: str, found: H5Contents) -> list[str]:
    """The ragged fields ``/lengths`` may describe: the one its ``field`` attribute names, else
    every ragged field of the file (it must match one of them); none without ``/lengths``."""
    if not found.has_lengths_index:
        return []
    ragged = [n for n, spec in found.fields.items() if spec.field.kind == "ragged"]
    named = found.lengths_index_field
    if named is None:
        if not ragged:
            raise DataFormatError(
                f"{file}: has a /{LENGTHS_INDEX} index but no ragged field for it to describe"
            )
        return ragged
    if named not in ragged:
        raise DataFormatError(
            f"{file}: /{LENGTHS_INDEX} has field={named!r}, which is not a ragged field of the"
            f" file (ragged fields: {', '.join(ragged) or 'none'})"
        )
    return [named]


def _check_lengths_index(
    file: str, stored: npt.NDArray[np.integer], candidates: dict[str, npt.NDArray[np.int64]]
) -> str:
    """The candidate whose lengths ``/lengths`` equals; if none, the error names the first
    sample where it disagrees with the first candidate."""
    for name, lengths in candidates.items():
        if stored.shape == lengths.shape and np.array_equal(stored, lengths):
            return name
    first = next(iter(candidates))
    others = (
        f" (nor those of {', '.join(repr(n) for n in list(candidates)[1:])})"
        if len(candidates) > 1
        else ""
    )
    check_lengths_agree(
        stored, candidates[first], where=f"{file}: /{LENGTHS_INDEX} vs field {first!r}{others}"
    )
    raise AssertionError("unreachable: check_lengths_agree raised on the difference")
