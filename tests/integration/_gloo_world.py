"""The process :func:`_gloo.run_world` starts for a world: it imports torch and fastload once,
then forks one process per rank, which runs the rank's script as ``__main__`` with the rank's
arguments and environment and exits as that script would. Each rank is still its own process
with its own gloo connection; only the imports (a second or more per rank on 2 cores) are
shared. Prints, as JSON, each rank's exit code (``None``: still running at the deadline, then
killed).

Usage: python _gloo_world.py SPEC_JSON, with SPEC_JSON holding ``script``, ``argvs``, ``envs``,
``logs`` (one per rank), ``timeout_s`` and ``preload`` (module names).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from typing import NoReturn


def _run_rank(script: str, argv: list[str], env: dict[str, str], log: str) -> NoReturn:
    """In the forked child: become the rank's ``python script argv...`` and exit as it does, its
    exit handlers included; only the interpreter's teardown of every module (0.4 s of torch's
    per rank) is skipped."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    spec = json.loads(sys.argv[1])
    for module in spec["preload"]:
        importlib.import_module(module)
    ranks: dict[int, int] = {}
    for rank, (argv, env, log) in enumerate(zip(spec["argvs"], spec["envs"], spec["logs"], strict=True)):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_rank(spec["script"], argv, env, log)  # never returns
        ranks[pid] = rank
    codes: list[int | None] = [None] * len(ranks)
    deadline = time.monotonic() + spec["timeout_s"]
    while ranks and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.02)
        elif pid in ranks:
            codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(json.dumps(codes), flush=True)
    os._exit(0)  # nothing of its own to clean up: skip the teardown of the modules it preloaded


if __name__ == "__main__":
    main()
