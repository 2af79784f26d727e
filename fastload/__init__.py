"""fastload: whole batches from disk to the GPU, with the GPU never waiting.

Everything public is re-exported here; every other module is private.
"""

from __future__ import annotations

from fastload import errors

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "errors",
]
