"""Suite-wide settings: warnings are errors (pyproject), every test has a timeout and a hang
dumps all stacks (pytest-timeout + faulthandler), and tests that need CUDA are skipped where
there is none."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
