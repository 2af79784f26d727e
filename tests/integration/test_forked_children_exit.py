"""A process forked (``os.fork``) from one that used a fastload loader exits as it would
without fastload: status 0 and nothing on stderr, whether the loader had finished its epoch or
was in the middle of one (its workers belong to the parent, which keeps using them)."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
import os, sys
import fastload

def fork_and_check(label):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 2)
        sys.exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or err:
        print(f"{label}: exit {code}, stderr {err.decode()[-400:]!r}")

loader = fastload.DataLoader(list(range(40)), batch_size=4, num_workers=2)
assert sum(len(b) for b in loader) == 40
for i in range(5):  # the first forks meet the reaper still closing the workers; each
    fork_and_check(f"after the epoch, fork {i}")  # child's exit takes ~0.4 s (torch's teardown)
held = iter(fastload.DataLoader(list(range(40)), batch_size=4, num_workers=2, persistent_workers=True))
first = next(held)
for i in range(3):
    fork_and_check(f"mid-epoch, fork {i}")
rest = [b for b in held]
assert len(rest) == 9, len(rest)
print("done")
"""


def test_children_forked_from_a_process_that_used_a_loader_exit_cleanly() -> None:
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "done", result.stdout[-2000:]
