"""A path that is a URL of a scheme fastload cannot read fails at construction naming the scheme
and the ones it reads, not as a missing local file."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload import ArrowDataset, HDF5Dataset
from fastload._remote import open_store
from fastload.errors import UnsupportedSchemeError


@pytest.mark.parametrize("reader", [HDF5Dataset, ArrowDataset])
@pytest.mark.parametrize("path", ["nosuchproto://bucket/corpus", "hdfs://nn:8020/corpus/*.h5", "file:///data/x.h5"])
def test_an_unknown_scheme_is_named_with_the_supported_ones(reader: type, path: str) -> None:
    scheme = path.partition("://")[0]
    with pytest.raises(UnsupportedSchemeError) as caught:
        reader(path)
    message = str(caught.value)
    assert f"{path}: fastload cannot read {scheme}:// URLs" in message
    assert "s3://, gs://, gcs://, http://, https://" in message and "a local path" in message
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, FileNotFoundError)


def test_an_unknown_scheme_in_a_list_of_paths_too(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedSchemeError, match=r"abfs://c/x\.h5: fastload cannot read abfs://"):
        HDF5Dataset([tmp_path / "a.h5", "abfs://c/x.h5"])


def test_open_store_names_an_unknown_scheme_too() -> None:
    with pytest.raises(UnsupportedSchemeError, match=r"nosuchproto://b/c: fastload cannot read nosuchproto://"):
        open_store("nosuchproto://b/c")


def test_a_local_folder_whose_name_looks_like_a_scheme_still_reads(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        HDF5Dataset(str(tmp_path / "x://y"))  # an absolute path: not a URL
