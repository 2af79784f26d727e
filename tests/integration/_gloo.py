"""Starting a real ``torch.distributed`` world on this machine: one process per rank, gloo over
127.0.0.1, the environment ``init_process_group`` reads, and each rank's output on failure."""

from __future__ import annotations

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
    script: Path, world: int, argv: Callable[[int], Sequence[str]], timeout_s: float, local_world: bool = False
) -> None:
    """Run ``script`` as ranks 0..world-1 (``argv(rank)`` its arguments) and wait for all of them;
    a rank that fails or outlives ``timeout_s`` fails the test with its output, and none is left."""
    port = free_port()
    processes = []
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
        processes.append(
            subprocess.Popen(
                [sys.executable, str(script), *argv(rank)],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        for rank, process in enumerate(processes):
            output, _ = process.communicate(timeout=timeout_s)
            assert process.returncode == 0, f"rank {rank} exited {process.returncode}:\n{output}"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
