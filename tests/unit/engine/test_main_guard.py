"""Which statements of a main script a ``spawn``/``forkserver`` worker would run again: those
outside every ``if __name__ == "__main__":`` (``fastload/_engine/_main_guard.py``)."""

from __future__ import annotations

import ast
import textwrap
import types

import pytest

from fastload._engine._main_guard import _guarded, rerun_script, start_method

SCRIPT = textwrap.dedent(
    """
    import fastload
    loader = make()                          # 3
    for batch in loader:                     # 4
        step(batch)                          # 5
    if __name__ == "__main__":
        run(loader)                          # 7
    if "__main__" == __name__ and FLAGS:
        run(loader)                          # 9
    try:
        if __name__ == "__main__":
            run(loader)                      # 12
    except KeyboardInterrupt:
        run(loader)                          # 14
    if DEBUG:
        run(loader)                          # 16
    """
)


@pytest.mark.parametrize(("line", "guarded"), [(3, False), (5, False), (7, True), (9, True), (12, True), (14, False), (16, False)])
def test_a_statement_is_guarded_only_under_an_if_comparing_name_with_main(line: int, guarded: bool) -> None:
    assert _guarded(ast.parse(SCRIPT).body, line) is guarded


def test_only_a_script_or_a_module_run_by_name_is_run_again() -> None:
    script = types.ModuleType("__main__")
    script.__file__ = "train.py"
    assert rerun_script(script) is not None and rerun_script(script).endswith("/train.py")  # type: ignore[union-attr]
    package = types.ModuleType("__main__")
    package.__file__ = "/x/pkg/__main__.py"
    package.__spec__ = types.SimpleNamespace(name="pkg.__main__")  # type: ignore[assignment]
    assert rerun_script(package) is None
    assert rerun_script(types.ModuleType("__main__")) is None  # an interactive session


def test_the_start_method_is_read_from_a_context_a_name_or_the_default() -> None:
    import multiprocessing

    assert start_method(multiprocessing.get_context("spawn")) == "spawn"
    assert start_method("forkserver") == "forkserver"
    assert start_method(None) == multiprocessing.get_start_method()
