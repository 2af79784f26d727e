"""Whether starting workers would re-run the statement that starts them.

``spawn`` and ``forkserver`` (the start method of remote datasets' workers) begin each worker by
running the main script again, as module ``__mp_main__``: whatever the script does outside
``if __name__ == "__main__":`` happens once more in every worker. A script whose loop is not under
that guard therefore makes each worker build the loader and start workers of its own, which
Python refuses while the worker is still starting: the worker dies, is replaced, dies again, and
the run ends in ``WorkerCrashedError`` after printing its output once per worker. So before the
first worker starts, :func:`check_main_guard` finds the main script's top-level statement that
is running now and raises :class:`~fastload.errors.UnguardedMainError` where no guard encloses
it.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from types import FrameType, ModuleType
from typing import Any

from fastload.errors import UnguardedMainError


def start_method(ctx: Any) -> str:
    """The start method workers get from ``ctx`` (``None``: the default context)."""
    if ctx is None:
        return str(multiprocessing.get_start_method())
    if isinstance(ctx, str):
        return ctx
    return str(ctx.get_start_method())


def rerun_script(main: ModuleType | None = None) -> str | None:
    """The file a ``spawn`` or ``forkserver`` worker runs again before it starts (as
    ``multiprocessing`` decides it), or ``None`` where it runs none (an interactive session, a
    notebook, ``python -c``, a package's ``__main__``)."""
    main = sys.modules.get("__main__") if main is None else main
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    return os.path.abspath(path)


def _is_guard(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"``."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            named = any(isinstance(p, ast.Name) and p.id == "__name__" for p in parts)
            main = any(isinstance(p, ast.Constant) and p.value == "__main__" for p in parts)
            if named and main:
                return True
    return False


def _guarded(body: list[ast.stmt], line: int) -> bool:
    """Whether the statement of ``body`` holding ``line`` lies under a ``__main__`` guard."""
    for stmt in body:
        end = getattr(stmt, "end_lineno", None) or stmt.lineno
        if not stmt.lineno <= line <= end:
            continue
        if isinstance(stmt, ast.If) and _is_guard(stmt.test):
            return True
        inner = [
            part
            for field in ("body", "orelse", "finalbody", "handlers")
            for part in getattr(stmt, field, [])
        ]
        blocks = [h.body for h in inner if isinstance(h, ast.ExceptHandler)]
        stmts = [s for s in inner if isinstance(s, ast.stmt)]
        return _guarded(stmts, line) or any(_guarded(b, line) for b in blocks)
    return False


def unguarded_line(frame: FrameType | None = None) -> tuple[str, int] | None:
    """``(script, line)`` of the main script's top-level statement running now, where a worker
    would run it again (see the module text) and no ``__main__`` guard encloses it; else
    ``None``."""
    script = rerun_script()
    if script is None:
        return None
    outermost = None
    frame = sys._getframe(1) if frame is None else frame
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and os.path.abspath(code.co_filename) == script:
            outermost = frame
        frame = frame.f_back
    if outermost is None:
        return None
    line = outermost.f_lineno
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return None
    return None if _guarded(tree.body, line) else (script, line)


def check_main_guard(ctx: Any) -> None:
    """Raise :class:`~fastload.errors.UnguardedMainError` where workers started from ``ctx``
    would re-run the statement starting them (see the module text)."""
    method = start_method(ctx)
    if method == "fork":
        return
    found = unguarded_line()
    if found is None:
        return
    script, line = found
    raise UnguardedMainError(
        f"{script}, line {line}: this statement starts fastload's workers with the "
        f"{method!r} start method, which runs {os.path.basename(script)} again in each worker; "
        "it is not under `if __name__ == \"__main__\":`, so every worker would start workers of "
        "its own (ending in WorkerCrashedError, with the script's output once per worker). "
        "Put the code that builds and iterates the loader under the guard:\n\n"
        "    def main():\n"
        "        loader = fastload.DataLoader(...)\n"
        "        for batch in loader:\n"
        "            ...\n\n"
        "    if __name__ == \"__main__\":\n"
        "        main()\n\n"
        "(or pass multiprocessing_context=\"fork\" for a local dataset)"
    )


__all__ = ["check_main_guard", "rerun_script", "start_method", "unguarded_line"]
