"""``open_store(url, storage_options)``: the store a URL names, its client configured from the
client's own option names and the standard environment."""

from __future__ import annotations

import difflib
import os
import urllib.parse
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from fastload._remote import _http
from fastload._remote._objects import Store
from fastload._remote._pyarrow_fs import ArrowStore
from fastload._remote._retry import Retrier, RetryPolicy
from fastload.errors import MissingExtraError, UnsupportedSchemeError

_S3_SCHEMES = ("s3",)
_GCS_SCHEMES = ("gs", "gcs")
_HTTP_SCHEMES = ("http", "https")
REMOTE_SCHEMES = _S3_SCHEMES + _GCS_SCHEMES + _HTTP_SCHEMES

# The keyword arguments of pyarrow.fs.S3FileSystem and GcsFileSystem (pyarrow 26): the names
# storage_options accepts for each, so a typo fails here, with the list, not deep in pyarrow.
S3_OPTIONS = (
    "access_key", "allow_bucket_creation", "allow_bucket_deletion", "allow_delayed_open", "anonymous",
    "background_writes", "check_directory_existence_before_creation", "connect_timeout", "default_metadata",
    "endpoint_override", "external_id", "force_virtual_addressing", "load_frequency", "proxy_options", "region",
    "request_timeout", "retry_strategy", "role_arn", "scheme", "secret_key", "session_name", "session_token",
    "tls_ca_file_path",
)  # fmt: skip
GCS_OPTIONS = (
    "access_token", "anonymous", "credential_token_expiration", "default_bucket_location", "default_metadata",
    "endpoint_override", "project_id", "retry_time_limit", "scheme", "target_service_account",
)  # fmt: skip
# Names boto3, s3fs and fsspec users know, taken for pyarrow's own (``client_kwargs`` is s3fs's
# dictionary of boto3 client arguments; only these of its keys have a pyarrow equivalent).
S3_ALIASES = {
    "endpoint_url": "endpoint_override",
    "aws_access_key_id": "access_key",
    "aws_secret_access_key": "secret_key",
    "aws_session_token": "session_token",
    "key": "access_key",
    "secret": "secret_key",
    "token": "session_token",
    "region_name": "region",
    "anon": "anonymous",
    "use_ssl": "scheme",  # s3fs's switch: False is http
}
# gcsfs's names.
GCS_ALIASES = {"endpoint_url": "endpoint_override", "project": "project_id"}
_CLIENT_KWARGS = ("endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
# Checked in this order when endpoint_override is not given: pyarrow reads neither.
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def is_remote(path: str) -> bool:
    """Whether ``path`` is a URL that :func:`open_store` opens (``s3://``, ``gs://``,
    ``gcs://``, ``http://``, ``https://``) rather than a local path."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def open_store(url: str, storage_options: Mapping[str, Any] | None = None, *, retry: RetryPolicy | None = None) -> Store:
    """The store at ``url``, a folder (a bucket and prefix) or one object (``name=""``).

    ``storage_options`` are the client's own keyword arguments: ``pyarrow.fs.S3FileSystem``'s
    for ``s3://`` (for an S3-compatible store: ``{"endpoint_override": "http://127.0.0.1:9000",
    "access_key": ..., "secret_key": ...}``, or boto3's and s3fs's names for them:
    :func:`pyarrow_options`; without them the ``AWS_*`` environment variables and
    ``~/.aws`` apply, and ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` set the endpoint),
    ``pyarrow.fs.GcsFileSystem``'s for ``gs://``, and ``headers`` and ``timeout_s`` for
    ``http(s)://``. fastload turns pyarrow's own retries off (``retry_strategy`` with one attempt,
    GCS ``retry_time_limit`` of one second) so that ``retry`` alone bounds the time spent on
    transient errors, and delays S3 opens for writing (``allow_delayed_open``) so a small
    :meth:`Store.write` is one PUT; an option given explicitly wins.

    Raises :class:`UnsupportedSchemeError` (a ``ValueError``) for a URL that is not remote,
    ``ValueError`` for one without a bucket or host or an option the client does not take
    (naming it and the valid ones), and :class:`MissingExtraError` where pyarrow was built
    without the S3 or GCS client.
    """
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    if scheme not in REMOTE_SCHEMES:
        what = f"fastload cannot read {parsed.scheme}:// URLs" if parsed.scheme else "not a URL"
        raise UnsupportedSchemeError(f"{url}: {what}; open_store reads {', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    if not parsed.netloc:
        raise ValueError(f"open_store({url!r}): names no host or bucket after {scheme}://")
    options = dict(storage_options or {})
    retrier = Retrier(retry or RetryPolicy())
    if scheme in _HTTP_SCHEMES:
        _check_options(url, options, _http.OPTIONS)
        return _http.HttpStore(url, options, retrier)
    base = parsed.netloc + parsed.path
    if scheme in _S3_SCHEMES:
        options = pyarrow_options(url, options, S3_ALIASES, client_kwargs=_CLIENT_KWARGS)
        _check_options(url, options, S3_OPTIONS)
        return ArrowStore(url, _s3_filesystem(options), base, retrier, s3=True)
    options = pyarrow_options(url, options, GCS_ALIASES)
    _check_options(url, options, GCS_OPTIONS)
    return ArrowStore(url, _gcs_filesystem(options), base, retrier, s3=False)


def pyarrow_options(
    url: str, options: Mapping[str, Any], aliases: Mapping[str, str], *, client_kwargs: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``options`` with other clients' names (``aliases``: :data:`S3_ALIASES`,
    :data:`GCS_ALIASES`; and, where ``client_kwargs`` names some, those keys of s3fs's
    ``client_kwargs`` dictionary) replaced by pyarrow's. An endpoint with a scheme (``http://host:port``)
    becomes pyarrow's ``endpoint_override`` without it and ``scheme``, which pyarrow would
    otherwise take as ``https`` for some spellings. Raises ``ValueError`` naming both spellings
    where two of them give one setting different values."""
    entries: list[tuple[str, str, Any]] = []  # (the spelling the user wrote, its name, value)
    for name, value in options.items():
        if name != "client_kwargs" or not client_kwargs:
            entries.append((name, name, value))
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"storage_options client_kwargs for {url}: must be a dict; got {type(value).__name__}")
        for key, inner in value.items():
            if key not in client_kwargs:
                raise ValueError(
                    f"storage_options client_kwargs {key!r} for {url}: has no pyarrow equivalent;"
                    f" client_kwargs may hold {', '.join(client_kwargs)}"
                )
            entries.append((f"client_kwargs[{key!r}]", key, inner))
    given: dict[str, tuple[str, Any]] = {}  # pyarrow's name -> (spelling, value)
    for spelling, name, value in entries:
        if name == "use_ssl" and aliases.get(name) == "scheme":
            value = "https" if value else "http"
        name = aliases.get(name, name)
        if name == "endpoint_override" and isinstance(value, str) and "://" in value:
            scheme, _, value = value.partition("://")
            entries.append((f"the scheme of {spelling}", "scheme", scheme))
            value = value.rstrip("/")
        if name in given and given[name][1] != value:
            raise ValueError(
                f"storage_options for {url}: {given[name][0]}={given[name][1]!r} and {spelling}={value!r}"
                f" set the same option (pyarrow's {name!r}) to different values; give one of them"
            )
        given[name] = (spelling, value)
    return {name: value for name, (_, value) in given.items()}


def _check_options(url: str, options: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    for name in options:
        if name in valid:
            continue
        hint = {**S3_ALIASES, **GCS_ALIASES}.get(name) or next(iter(difflib.get_close_matches(name, valid, n=1)), None)
        did_you_mean = f" (did you mean {hint!r}?)" if hint in valid else ""
        raise ValueError(f"storage_options {name!r} is not an option for {url}{did_you_mean}; valid options: {', '.join(valid)}")


def _s3_filesystem(options: dict[str, Any]) -> Any:
    try:
        import pyarrow.fs as pafs
        from pyarrow._s3fs import S3FileSystem  # absent where pyarrow was built without S3
    except ImportError as exc:
        raise MissingExtraError(
            "s3:// needs pyarrow built with S3 support, which this pyarrow lacks; install pyarrow's wheel from "
            "PyPI (pip install --force-reinstall pyarrow) or conda-forge's pyarrow, both of which include it"
        ) from exc
    options.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    options.setdefault("allow_delayed_open", True)
    if "endpoint_override" not in options:
        endpoint = next((os.environ[v] for v in ENDPOINT_ENV if os.environ.get(v)), None)
        if endpoint is not None:
            options["endpoint_override"] = endpoint
    return S3FileSystem(**options)


def _gcs_filesystem(options: dict[str, Any]) -> Any:
    try:
        from pyarrow._gcsfs import GcsFileSystem
    except ImportError as exc:
        raise MissingExtraError(
            "gs:// needs pyarrow built with GCS support, which this pyarrow lacks; install pyarrow's wheel from "
            "PyPI (pip install --force-reinstall pyarrow) or conda-forge's pyarrow, both of which include it"
        ) from exc
    options.setdefault("retry_time_limit", timedelta(seconds=1))
    return GcsFileSystem(**options)
