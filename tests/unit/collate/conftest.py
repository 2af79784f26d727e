"""Every collation test runs twice: with the native padding kernel and with the numpy kernels
that stand in for it where it was not built. Both must give the same bytes."""

from __future__ import annotations

import pytest

from fastload._collate import _kernels


@pytest.fixture(autouse=True, params=["native", "numpy"])
def padding_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(_kernels, "_native", None)
    elif _kernels._native is None:
        pytest.fail("fastload._collate._native was not built (pip install -e . needs a C compiler)")
    return str(request.param)
