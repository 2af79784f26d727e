"""Text to token ids: UTF-8 bytes, a whitespace vocabulary, a Hugging Face ``tokenizer.json``, or
a user's ``module:function``.

A :class:`TokenizerSpec` is small and picklable; each worker process builds its tokenizer from
it once with :func:`make_tokenizer`. Every tokenizer encodes a list of texts at a time and
reports texts it cannot encode instead of raising, so that ``--on-error skip`` can skip exactly
those records.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from fastload.errors import MissingExtraError, UsageError

PAD, UNK = "<pad>", "<unk>"
#: A lone UTF-16 surrogate: what a JSON escape like "\ud800" decodes to, and no UTF-8 holds.
_SURROGATE = re.compile("[\ud800-\udfff]")
PAD_ID, UNK_ID = 0, 1


class Tokenized(NamedTuple):
    """``values`` of all texts back to back; ``lengths[i]`` tokens for text ``i`` (0 for a
    failed one); ``failures`` as ``(text index, what went wrong)``."""

    values: np.ndarray
    lengths: npt.NDArray[np.int64]
    failures: list[tuple[int, str]]


class Tokenizer(Protocol):
    #: Number of distinct ids, or None when unknown (then the dtype follows the ids seen).
    vocab_size: int | None

    def encode(self, texts: Sequence[str]) -> Tokenized: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer: ``kind`` and its argument (a path, ``module:function``, or the
    whitespace vocabulary's words in id order). ``base`` is the folder the user ran the command
    in: relative paths and modules are found from there, also in a worker process whose own
    working folder may differ."""

    kind: Literal["bytes", "whitespace", "hf", "callable"]
    argument: str = ""
    base: str = ""
    vocab: tuple[str, ...] = ()
    errors: Literal["strict", "replace"] = "strict"
    special_tokens: bool = True


def parse_tokenizer(
    text: str, *, errors: Literal["strict", "replace"], special_tokens: bool
) -> TokenizerSpec:
    """Interpret ``--tokenizer``: ``bytes``, ``whitespace``, a path to a ``tokenizer.json``, or
    ``module:function``. Raises UsageError naming the option for anything else."""
    if text in ("bytes", "whitespace"):
        return TokenizerSpec(text, errors=errors)  # type: ignore[arg-type]
    if text.endswith(".json") or os.path.sep in text or Path(text).is_file():
        if not Path(text).is_file():
            raise UsageError(f"--tokenizer {text}: no such tokenizer file")
        return TokenizerSpec("hf", text, os.getcwd(), errors=errors, special_tokens=special_tokens)
    module, sep, name = text.partition(":")
    if sep and module and name:
        return TokenizerSpec("callable", text, os.getcwd(), errors=errors)
    raise UsageError(
        f"--tokenizer must be bytes, whitespace, a path to a tokenizer.json or "
        f"module:function, got {text!r}"
    )


def _utf8(text: str, errors: str) -> bytes | str:
    """``text`` as UTF-8, or the reason it cannot be (a lone surrogate from a JSON escape)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        if errors == "replace":
            return _SURROGATE.sub("\ufffd", text).encode("utf-8")
        return f"lone surrogate {text[exc.start]!r} at character {exc.start} is not valid UTF-8"


class BytesTokenizer:
    """UTF-8 bytes as uint8 ids: lossless, vocabulary 256."""

    vocab_size: int | None = 256

    def __init__(self, errors: str) -> None:
        self._errors = errors

    def encode(self, texts: Sequence[str]) -> Tokenized:
        try:
            parts = list(map(str.encode, texts))  # UTF-8, strict
            failures: list[tuple[int, str]] = []
        except UnicodeEncodeError:
            parts, failures = [], []
            for i, text in enumerate(texts):
                encoded = _utf8(text, self._errors)
                if isinstance(encoded, str):
                    failures.append((i, encoded))
                    encoded = b""
                parts.append(encoded)
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        return Tokenized(np.frombuffer(b"".join(parts), dtype=np.uint8), lengths, failures)


class WhitespaceTokenizer:
    """Words split on whitespace, looked up in a vocabulary; unknown words map to ``<unk>``."""

    def __init__(self, words: Sequence[str]) -> None:
        self._ids = {word: i for i, word in enumerate(words)}
        self.vocab_size: int | None = len(words)

    def encode(self, texts: Sequence[str]) -> Tokenized:
        lookup = self._ids.get
        split = [t.split() for t in texts]
        lengths = np.fromiter(map(len, split), dtype=np.int64, count=len(split))
        ids = (lookup(w, UNK_ID) for words in split for w in words)
        values = np.fromiter(ids, dtype=np.int64, count=int(lengths.sum()))
        return Tokenized(values, lengths, [])


def count_words(texts: Sequence[str], counts: Counter[str]) -> None:
    for text in texts:
        counts.update(text.split())


def build_vocab(counts: Counter[str], *, min_count: int, max_vocab: int | None) -> tuple[str, ...]:
    """``<pad>``, ``<unk>``, then the words seen at least ``min_count`` times, most frequent
    first (ties in code-point order, so the result depends on the counts alone), at most
    ``max_vocab`` of them. The literal words ``<pad>``/``<unk>`` map to the special ids."""
    kept = [w for w, c in counts.items() if c >= min_count and w not in (PAD, UNK)]
    kept.sort(key=lambda w: (-counts[w], w))
    if max_vocab is not None:
        kept = kept[:max_vocab]
    return (PAD, UNK, *kept)


def write_vocab(path: Path, words: Sequence[str]) -> str:
    """Write one word per line, line ``i`` (0-based) holding id ``i``; returns the file's
    SHA-256, recorded in the output so a mismatched vocabulary file can be detected."""
    data = "".join(f"{w}\n" for w in words).encode("utf-8")
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package."""

    def __init__(self, path: str, special_tokens: bool, errors: str) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as exc:
            raise MissingExtraError.for_extra(f"--tokenizer {path}", "tokenizers", "convert") from exc
        try:
            self._tokenizer = _Tokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises a bare Exception for a bad file
            raise UsageError(f"--tokenizer {path}: not a valid tokenizer.json ({exc})") from exc
        self._special = special_tokens
        self._errors = errors
        self.vocab_size: int | None = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=self._special)
        return [e.ids for e in encodings]

    def encode(self, texts: Sequence[str]) -> Tokenized:
        failures: list[tuple[int, str]] = []
        try:
            ids = self._ids(texts)
        except Exception:  # one text the Rust side rejects (a lone surrogate) fails the batch
            ids = []
            for i, text in enumerate(texts):
                encoded = _utf8(text, self._errors)
                if isinstance(encoded, str):
                    failures.append((i, encoded))
                    ids.append([])
                else:
                    ids.append(self._ids([encoded.decode("utf-8")])[0])
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        values = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())
        )
        return Tokenized(values, lengths, failures)


def resolve_callable(spec: str, base: str) -> Callable[[str], object]:
    """Import ``module:function`` (``function`` may be dotted), with ``base`` (the folder the
    command ran in) on the import path as ``python -m`` has it."""
    module_name, _, attribute = spec.partition(":")
    if base and base not in sys.path:
        sys.path.insert(0, base)
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--tokenizer {spec}: cannot import {module_name!r} ({exc})") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--tokenizer {spec}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"--tokenizer {spec}: {attribute!r} is not callable")
    return target


class CallableTokenizer:
    """A user's ``function(text: str) -> sequence of int``; the dtype follows the ids seen."""

    vocab_size: int | None = None

    def __init__(self, spec: str, base: str) -> None:
        self._spec = spec
        self._function = resolve_callable(spec, base)

    def _one(self, text: str) -> np.ndarray | str:
        try:
            out = np.asarray(self._function(text))
        except Exception as exc:  # a user's function may raise anything; report it per record
            return f"{self._spec} raised {type(exc).__name__}: {exc}"
        if out.ndim != 1 or (out.size and out.dtype.kind not in "iu"):
            return f"{self._spec} returned {out.dtype} of shape {out.shape}, expected a 1-D sequence of int"
        return out.astype(np.int64, copy=False)

    def encode(self, texts: Sequence[str]) -> Tokenized:
        arrays: list[np.ndarray] = []
        failures: list[tuple[int, str]] = []
        for i, text in enumerate(texts):
            out = self._one(text)
            if isinstance(out, str):
                failures.append((i, out))
                out = np.zeros(0, dtype=np.int64)
            arrays.append(out)
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return Tokenized(values, lengths, failures)


def make_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec.kind == "bytes":
        return BytesTokenizer(spec.errors)
    if spec.kind == "whitespace":
        return WhitespaceTokenizer(spec.vocab)
    if spec.kind == "hf":
        return HFTokenizer(os.path.join(spec.base, spec.argument), spec.special_tokens, spec.errors)
    return CallableTokenizer(spec.argument, spec.base)


def describe(spec: TokenizerSpec, vocab_size: int | None) -> dict[str, object]:
    """The tokenizer as recorded in the output's ``tokenizer`` attribute."""
    out: dict[str, object] = {"kind": spec.kind}
    if spec.kind == "hf":
        data = Path(spec.base, spec.argument).read_bytes()
        out |= {"path": spec.argument, "sha256": hashlib.sha256(data).hexdigest()}
        out["add_special_tokens"] = spec.special_tokens
    elif spec.kind == "callable":
        out["function"] = spec.argument
    elif spec.kind == "whitespace":
        out |= {"pad_id": PAD_ID, "unk_id": UNK_ID}
    if vocab_size is not None:
        out["vocab_size"] = vocab_size
    return out
