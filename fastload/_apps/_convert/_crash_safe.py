"""Crash-safe output: everything is written inside a temporary folder beside the destination,
then moved into place by ``rename``.

Invariant: at any instant, killed by any signal, the destination holds either its previous
content or the complete new file, and the only other trace is a folder named
``.<OUTPUT NAME>.fastload-tmp-<PID>``. The next run for the same output removes such folders
when their process is gone.

Protocol of :meth:`TempArea.commit`: each finished file is fsynced, renamed over its
destination (``os.replace`` is atomic within one filesystem, which the temporary folder's
location guarantees), and the destination folder is fsynced so that the rename itself survives
a power loss.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from fastload._storage import fsync_path

TEMP_MARK = ".fastload-tmp-"


def temp_folder_for(dest: Path, pid: int) -> Path:
    return dest.parent / f".{dest.name}{TEMP_MARK}{pid}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def remove_stale_temps(dest: Path) -> list[Path]:
    """Remove temporary folders left for ``dest`` by converters that no longer run.

    A folder whose process is alive is left alone: another converter may be writing it.
    Returns what was removed.
    """
    removed = []
    pattern = f".{glob.escape(dest.name)}{glob.escape(TEMP_MARK)}*"
    for path in sorted(dest.parent.glob(pattern)):
        pid_text = path.name.rsplit(TEMP_MARK, 1)[1]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        if _process_alive(int(pid_text)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class TempArea:
    """The temporary folder of one run; remove it with :meth:`close` (idempotent), also after a
    failure. Files to publish are created inside :attr:`path` and handed to :meth:`commit`."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.path = temp_folder_for(dest, os.getpid())
        if self.path.exists():  # left by an earlier run in this same process
            shutil.rmtree(self.path)
        self.path.mkdir()

    def commit(self, files: Sequence[tuple[Path, Path]], *, obsolete: Sequence[Path] = ()) -> None:
        """Move each ``(temporary, destination)`` pair into place, in order, then delete
        ``obsolete`` destinations (shards of an earlier, larger run)."""
        for temporary, _ in files:
            fsync_path(temporary)
        for temporary, destination in files:
            os.replace(temporary, destination)
        for path in obsolete:
            path.unlink(missing_ok=True)
        for folder in sorted({destination.parent for _, destination in files}):
            fsync_path(folder)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.path)

    def __enter__(self) -> TempArea:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
