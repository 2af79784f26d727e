"""The pure parts of ``fastload convert -o s3://...`` and ``fastload index URL``: storage
options from the command line, and the names an output URL gives its files."""

from __future__ import annotations

import pytest

from fastload._apps._convert._publish import RemoteTarget, parse_storage_options
from fastload.errors import UsageError


def test_storage_option_values_become_numbers_and_booleans_where_they_look_like_one() -> None:
    options = parse_storage_options(
        ["endpoint_override=http://127.0.0.1:9000", "connect_timeout=2.5", "request_timeout=7",
         "anonymous=TRUE", "region=us-east-1", "force_virtual_addressing=false", "scheme=", "x=1e3"]
    )  # fmt: skip
    assert options == {
        "endpoint_override": "http://127.0.0.1:9000", "connect_timeout": 2.5, "request_timeout": 7,
        "anonymous": True, "region": "us-east-1", "force_virtual_addressing": False, "scheme": "", "x": 1000.0,
    }  # fmt: skip
    assert type(options["request_timeout"]) is int
    assert parse_storage_options(["a=1", "a=two"]) == {"a": "two"}  # the last one wins


@pytest.mark.parametrize("bad", ["novalue", "=x", " =x"])
def test_a_storage_option_without_key_and_value_is_refused_by_name(bad: str) -> None:
    with pytest.raises(UsageError, match=f"--storage-option expects KEY=VALUE, got {bad!r}"):
        parse_storage_options([bad])


@pytest.mark.parametrize(
    ("url", "folder", "name"),
    [
        ("s3://b/corpus/", "s3://b/corpus/", "corpus.h5"),
        ("s3://b/corpus", "s3://b/corpus/", "corpus.h5"),
        ("s3://b/", "s3://b/", "b.h5"),
        ("gs://b/a/data.h5", "gs://b/a/", "data.h5"),
        ("s3://b/data.hdf5", "s3://b/", "data.hdf5"),
        ("s3://b/data.h5/", "s3://b/data.h5/", "data.h5.h5"),
    ],
)
def test_an_output_url_names_a_folder_or_a_file_in_one(url: str, folder: str, name: str) -> None:
    assert RemoteTarget.parse(url) == RemoteTarget(folder, name)
