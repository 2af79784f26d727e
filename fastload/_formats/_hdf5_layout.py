"""What an HDF5 file holds, found from its metadata alone: the fields it offers, how each is
stored, and its sample count.

Field discovery: a group holding datasets ``values`` and ``offsets`` is one ragged field named
after the group (the fastload layout); a 1-D variable-length dataset of numbers is a ragged
field; a string dataset (variable or fixed length) is an object field; any other numeric
dataset ``[N, ...]`` is a fixed field. Nested groups are named by path (``"a/b"``). The root
dataset ``lengths`` is the lengths index, not a field; scalar datasets are metadata and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import h5py
import numpy as np

from fastload._formats._hdf5_rows import native
from fastload._types import Field
from fastload.errors import DataFormatError, FieldNotFoundError

Storage = Literal["offsets", "vlen", "array", "string"]

FORMAT_VERSION = 1
LENGTHS_INDEX = "lengths"
_NUMERIC_KINDS = "biuf"
_SUPPORTED = (
    "fields must hold integers, floats or bools ([N, ...] arrays, or variable-length sequences),"
    " or strings"
)


@dataclass(frozen=True)
class H5Field:
    """One field of one file: its description and where it is stored.

    ``path`` is the dataset, or for ``storage == "offsets"`` the group holding ``values`` and
    ``offsets``. ``text`` says whether strings decode to ``str`` (UTF-8) or stay ``bytes``.
    """

    field: Field
    storage: Storage
    path: str
    num_samples: int
    text: bool = False


@dataclass(frozen=True)
class H5Contents:
    """Every field of a file that can be read, in the file's order, and why the others cannot.

    ``lengths_index_field`` is the ``field`` attribute of ``/lengths`` when it has one.
    """

    fields: dict[str, H5Field]
    problems: dict[str, str]
    has_lengths_index: bool
    lengths_index_field: str | None
    num_samples_attr: int | None


def scan(file: h5py.File, where: str) -> H5Contents:
    """Discover the fields of ``file`` (see the module docstring); ``where`` names it in errors."""
    version = file.attrs.get("fastload_format")
    if version is not None and int(version) != FORMAT_VERSION:
        raise DataFormatError(
            f"{where}: fastload_format is {int(version)}, but this version of fastload reads"
            f" format {FORMAT_VERSION}; upgrade fastload or re-convert the file"
        )
    fields: dict[str, H5Field] = {}
    problems: dict[str, str] = {}
    _walk(file, "", fields, problems)
    num_samples_attr = file.attrs.get("num_samples")
    index = file.get(LENGTHS_INDEX)
    has_index = isinstance(index, h5py.Dataset)
    index_field = None
    if has_index:
        named = index.attrs.get("field")
        if named is not None:
            index_field = named.decode() if isinstance(named, bytes) else str(named)
    return H5Contents(
        fields,
        problems,
        has_index,
        index_field,
        None if num_samples_attr is None else int(num_samples_attr),
    )


def select(contents: H5Contents, requested: list[str] | None, where: str) -> dict[str, H5Field]:
    """The fields to read: ``requested`` in its order, or every field of the file.

    Raises :class:`FieldNotFoundError` for a name the file lacks (listing those it has), and
    :class:`DataFormatError` for a field that exists but cannot be read; with ``requested=None``
    any unreadable dataset is an error too, naming it and suggesting ``fields=``.
    """
    if requested is None:
        if contents.problems:
            listed = "; ".join(f"{name!r}: {why}" for name, why in contents.problems.items())
            raise DataFormatError(
                f"{where}: cannot read {listed}. Pass fields=[...] to read only the others"
                f" ({', '.join(repr(n) for n in contents.fields) or 'none'})"
            )
        return dict(contents.fields)
    chosen: dict[str, H5Field] = {}
    for name in requested:
        key = name.strip("/")
        if key in contents.problems:
            raise DataFormatError(f"{where}: field {key!r}: {contents.problems[key]}")
        if key not in contents.fields:
            available = [*contents.fields, *contents.problems]
            raise FieldNotFoundError(
                f"{where}: no field {name!r}; the file has: "
                f"{', '.join(repr(n) for n in available) or '(no fields)'}"
            )
        chosen[key] = contents.fields[key]
    return chosen


def common_num_samples(fields: dict[str, H5Field], contents: H5Contents, where: str) -> int:
    """The sample count shared by ``fields`` (and the ``num_samples`` attribute, if any)."""
    counts = {name: f.num_samples for name, f in fields.items()}
    if contents.num_samples_attr is not None:
        counts = {"(attribute num_samples)": contents.num_samples_attr, **counts}
    if not counts:
        return 0
    distinct = set(counts.values())
    if len(distinct) > 1:
        listed = ", ".join(f"{name!r}: {n}" for name, n in counts.items())
        raise DataFormatError(
            f"{where}: fields have different numbers of samples ({listed}); every field must"
            " have one entry per sample"
        )
    return distinct.pop()


def _walk(
    group: h5py.Group, prefix: str, fields: dict[str, H5Field], problems: dict[str, str]
) -> None:
    for key in group:
        if isinstance(key, bytes):  # h5py's name for a link whose name is not UTF-8
            problems[prefix + key.decode(errors="backslashreplace")] = (
                "has a link name that is not UTF-8; the file is damaged"
            )
            continue
        name = prefix + key
        link = group.get(key, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            problems[name] = f"is an external link to {link.filename}:{link.path}, not supported"
            continue
        if isinstance(link, h5py.SoftLink):
            obj = group.get(key)  # None for a link to nothing, which is no field
        else:
            try:
                # Not group.get(key): it answers None for an object HDF5 cannot open, which
                # would drop a damaged field without a word.
                obj = group[key]
            except (KeyError, RuntimeError, ValueError, OSError) as exc:
                problems[name] = f"cannot be opened, the file is damaged ({exc})"
                continue
        if isinstance(obj, h5py.Group):
            if "values" in obj and "offsets" in obj:
                _classify_ragged_group(obj, name, fields, problems)
            else:
                _walk(obj, name + "/", fields, problems)
        elif isinstance(obj, h5py.Dataset) and not (prefix == "" and key == LENGTHS_INDEX):
            _classify_dataset(obj, name, fields, problems)


def _classify_ragged_group(
    group: h5py.Group, name: str, fields: dict[str, H5Field], problems: dict[str, str]
) -> None:
    values, offsets = group.get("values"), group.get("offsets")
    if not isinstance(values, h5py.Dataset) or not isinstance(offsets, h5py.Dataset):
        problems[name] = "'values' and 'offsets' must both be datasets"
    elif values.ndim < 1 or values.dtype.kind not in _NUMERIC_KINDS:
        problems[name] = (
            f"values has dtype {values.dtype} and shape {values.shape}; expected a numeric"
            " array [total, ...]"
        )
    elif offsets.ndim != 1 or offsets.dtype.kind not in "iu" or offsets.shape[0] == 0:
        problems[name] = (
            f"offsets has dtype {offsets.dtype} and shape {offsets.shape}; expected int64 [N+1]"
        )
    else:
        field = Field(name, "ragged", native(values.dtype), tuple(values.shape[1:]))
        fields[name] = H5Field(field, "offsets", group.name, offsets.shape[0] - 1)


def _classify_dataset(
    dset: h5py.Dataset, name: str, fields: dict[str, H5Field], problems: dict[str, str]
) -> None:
    if dset.shape is None or dset.ndim == 0:
        return  # a scalar (or empty-dataspace) dataset is metadata, not a per-sample field
    string = h5py.check_string_dtype(dset.dtype)
    vlen = h5py.check_vlen_dtype(dset.dtype)
    if string is not None:
        if dset.ndim != 1:
            problems[name] = f"is a string dataset of shape {dset.shape}; expected [N]"
            return
        field = Field(name, "object", np.dtype(object))
        text = string.encoding == "utf-8"
        fields[name] = H5Field(field, "string", dset.name, dset.shape[0], text)
    elif vlen is not None:
        base = np.dtype(vlen)
        if dset.ndim != 1 or base.kind not in _NUMERIC_KINDS:
            problems[name] = (
                f"is a variable-length dataset of {base} with shape {dset.shape}; {_SUPPORTED}"
            )
            return
        field = Field(name, "ragged", native(base))
        fields[name] = H5Field(field, "vlen", dset.name, dset.shape[0])
    elif dset.dtype.kind in _NUMERIC_KINDS and dset.dtype.fields is None:
        field = Field(name, "fixed", native(dset.dtype), tuple(dset.shape[1:]))
        fields[name] = H5Field(field, "array", dset.name, dset.shape[0])
    else:
        problems[name] = f"has dtype {dset.dtype}, which is not supported; {_SUPPORTED}"

