"""Which storage errors are worth retrying, and the retry loop: exponential backoff with full
jitter under a bounded total time.

The jitter draws from a private ``random.Random`` seeded by the OS, never from the ``random``
module's shared state (or numpy's, or torch's), so retries change only when bytes arrive, never
which bytes a dataset's own seeded shuffles produce.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeVar

import urllib3.exceptions

from fastload._remote._objects import StoreStats
from fastload.errors import StorageError, StorageNotFoundError, StoragePermissionError

T = TypeVar("T")


class Kind(IntEnum):
    TRANSIENT = 0
    NOT_FOUND = 1
    DENIED = 2
    PERMANENT = 3


class ShortReadError(OSError):
    """A reply carried fewer bytes than the request asked for and the object holds."""


class HttpStatusError(OSError):
    """An HTTP(S) server answered with an error status (after following redirects)."""

    def __init__(self, url: str, code: int, reason: str) -> None:
        super().__init__(f"HTTP {code} {reason}".rstrip())
        self.url, self.code = url, code

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.url, self.code, str(self).partition(f"HTTP {self.code} ")[2])


# pyarrow raises OSError whose message carries the AWS SDK's error name (``AWS Error SLOW_DOWN
# during GetObject``), or ``(HTTP status 503)`` for a reply without a body (HEAD), or, for GCS,
# google-cloud-cpp's status code. Read against moto for each case (tests/remote/test_store.py).
_NOT_FOUND = re.compile(r"NO_SUCH_BUCKET|NO_SUCH_KEY|RESOURCE_NOT_FOUND|\bNOT_FOUND\b|HTTP status 404")
_DENIED = re.compile(
    r"ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|INVALID_CLIENT_TOKEN_ID"
    r"|EXPIRED_TOKEN|PERMISSION_DENIED|UNAUTHENTICATED|HTTP status 40[13]"
)
_TRANSIENT = re.compile(
    r"NETWORK_CONNECTION|SLOW_DOWN|THROTTLING|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|REQUEST_TIMEOUT"
    r"|REQUEST_LIMIT_EXCEEDED|TOO_MANY_REQUESTS|HTTP status (?:5\d\d|429|408)"
    r"|\bUNAVAILABLE\b|RESOURCE_EXHAUSTED|DEADLINE_EXCEEDED|\bINTERNAL\b|\bABORTED\b"
)
_TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}


def classify(exc: BaseException) -> Kind:
    """Whether ``exc``, raised by pyarrow or urllib3 while talking to a store, is worth
    retrying, names a missing object, a refusal, or another permanent failure."""
    if isinstance(exc, HttpStatusError):
        if exc.code in (404, 410):
            return Kind.NOT_FOUND
        if exc.code in (401, 403):
            return Kind.DENIED
        return Kind.TRANSIENT if exc.code in _TRANSIENT_HTTP else Kind.PERMANENT
    if isinstance(exc, urllib3.exceptions.MaxRetryError):  # urllib3's wrapper of the failure
        return classify(exc.reason) if exc.reason is not None else Kind.PERMANENT
    if isinstance(exc, urllib3.exceptions.NameResolutionError):  # a wrong host name
        return Kind.PERMANENT
    if isinstance(exc, (urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError, urllib3.exceptions.ProxyError)):
        return Kind.TRANSIENT  # a dropped or cut-off reply, a refused connection, a timeout
    if isinstance(exc, (ShortReadError, http.client.IncompleteRead, ConnectionError, socket.timeout, TimeoutError)):
        return Kind.TRANSIENT
    if isinstance(exc, http.client.HTTPException):  # a malformed or cut-off status line
        return Kind.TRANSIENT
    if isinstance(exc, FileNotFoundError):  # pyarrow's HEAD of a missing key or bucket
        return Kind.NOT_FOUND
    if isinstance(exc, OSError):
        text = str(exc)
        if _NOT_FOUND.search(text):
            return Kind.NOT_FOUND
        if _DENIED.search(text):
            return Kind.DENIED
        if _TRANSIENT.search(text):
            return Kind.TRANSIENT
    return Kind.PERMANENT


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient errors after ``uniform(0, min(cap_s, base_s * 2**attempt))`` seconds
    (exponential backoff with full jitter), until the next wait would end more than ``total_s``
    after the operation began; then fail with :class:`StorageError`."""

    total_s: float = 300.0
    base_s: float = 0.1
    cap_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("total_s", "base_s", "cap_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RetryPolicy({name}={value!r}): must be > 0 seconds")
        if self.base_s > self.cap_s:
            raise ValueError(f"RetryPolicy(base_s={self.base_s!r}, cap_s={self.cap_s!r}): the first wait cannot exceed the cap")

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0 ** min(attempt, 60)))


class Retrier:
    """Runs store operations under a :class:`RetryPolicy` and counts requests, bytes received
    and retries (thread-safe)."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._sleep = sleep
        self._rng = random.Random()  # OS-seeded; see the module docstring
        self._lock = threading.Lock()
        self._requests = self._bytes = self._retries = 0

    def deadline(self) -> float:
        return self._clock() + self.policy.total_s

    def count(self, *, requests: int = 0, received: int = 0) -> None:
        with self._lock:
            self._requests += requests
            self._bytes += received

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._requests, self._bytes, self._retries)

    def call(self, url: str, operation: Callable[[], T], *, deadline: float | None = None) -> T:
        """``operation()``, retried while it fails transiently and the budget lasts (until
        ``deadline``, a :meth:`deadline` shared by several calls, or ``total_s`` from now);
        any failure leaves as a :class:`StorageError` (or subclass) naming ``url``."""
        began = self._clock()
        end = began + self.policy.total_s if deadline is None else deadline
        attempt = 0
        while True:
            try:
                return operation()
            except StorageError:
                raise
            except Exception as exc:
                kind = classify(exc)
                if kind is Kind.TRANSIENT:
                    wait_s = self.policy.backoff_s(attempt, self._rng)
                    if self._clock() + wait_s <= end:
                        with self._lock:
                            self._retries += 1
                        self._sleep(wait_s)
                        attempt += 1
                        continue
                raise storage_error(url, exc, kind, attempts=attempt + 1, elapsed_s=self._clock() - began, policy=self.policy) from exc


def storage_error(url: str, exc: BaseException, kind: Kind, *, attempts: int, elapsed_s: float, policy: RetryPolicy) -> StorageError:
    cause = f"{type(exc).__name__}: {exc}"
    if kind is Kind.NOT_FOUND:
        return StorageNotFoundError(f"{url}: not found (the object or its bucket does not exist): {cause}", url)
    if kind is Kind.DENIED:
        return StoragePermissionError(
            f"{url}: access refused: {cause}. Check the credentials (storage_options access_key/secret_key, "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and that they may read this bucket.",
            url,
        )
    if kind is Kind.TRANSIENT:
        return StorageError(
            f"{url}: still failing after {attempts} attempts in {elapsed_s:.1f} s, the retry budget "
            f"(RetryPolicy(total_s={policy.total_s:g})): last error {cause}. The store is down or throttling; "
            "retry later, or allow more time with a larger total_s.",
            url,
        )
    return StorageError(f"{url}: {cause}", url)
