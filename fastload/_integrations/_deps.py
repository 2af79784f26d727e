"""Importing an optional dependency with an error that names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise ``ImportError`` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the {module!r} package, which is not installed: install fastload "
            "with its Hugging Face extra, `pip install 'fastload[hf]'` (transformers and "
            "accelerate)"
        ) from exc
