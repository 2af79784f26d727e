"""Importing an optional dependency with an error that names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from fastload.errors import MissingExtraError


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise :class:`MissingExtraError` naming the ``hf``
    extra (transformers and accelerate) and its install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError.for_extra(feature, module, "hf") from exc
