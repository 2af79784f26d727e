"""Where fastload's local cache lives on this machine."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FASTLOAD_CACHE"

#: What a message about an unusable cache directory tells the user to do.
CACHE_REMEDY = f"pass cache_dir= a writable directory with room for it, or set {CACHE_ENV} to one"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local cache directory, absolute and not created here: ``cache_dir`` when given, else
    ``$FASTLOAD_CACHE``, else ``$XDG_CACHE_HOME/fastload``, else ``~/.cache/fastload``.

    Empty environment variables count as unset, and so does a relative ``XDG_CACHE_HOME`` (the
    XDG specification says to ignore one).
    """
    if cache_dir is not None:
        chosen = Path(os.fspath(cache_dir)).expanduser()
    elif os.environ.get(CACHE_ENV):
        chosen = Path(os.environ[CACHE_ENV]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
        chosen = base / "fastload"
    return chosen.absolute()
