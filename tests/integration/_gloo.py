"""Starting a real ``torch.distributed`` world on this machine: one process per rank, gloo over
127.0.0.1, the environment ``init_process_group`` reads, and each rank's output on failure."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_world(
    script: Path,
    world: int,
    argv: Callable[[int], Sequence[str]],
    timeout_s: float,
    local_world: bool = False,
    preload: Sequence[str] = ("torch", "torch.distributed", "fastload"),
) -> None:
    """Run ``script`` as ranks 0..world-1 (``argv(rank)`` its arguments) and wait for all of them;
    a rank that fails or outlives ``timeout_s`` fails the test with its output, and none is left.
    The ranks are forked from one process that imported ``preload`` (``_gloo_world.py``)."""
    port = free_port()
    envs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        if local_world:
            env["LOCAL_WORLD_SIZE"] = str(world)
        envs.append(env)
    logs = [f"{script}.rank{rank}.log" for rank in range(world)]
    spec = {
        "script": str(script),
        "argvs": [list(argv(rank)) for rank in range(world)],
        "envs": envs,
        "logs": logs,
        "timeout_s": timeout_s,
        "preload": list(preload),
    }
    launcher = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_gloo_world.py")), json.dumps(spec)],
        env=envs[0],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )
    assert launcher.returncode == 0, f"the world's launcher exited {launcher.returncode}:\n{launcher.stderr}"
    codes = json.loads(launcher.stdout.strip().splitlines()[-1])
    for rank, code in enumerate(codes):
        said = Path(logs[rank]).read_text() if Path(logs[rank]).exists() else ""
        assert code == 0, f"rank {rank} {'outlived ' + str(timeout_s) + ' s' if code is None else f'exited {code}'}:\n{said}"
