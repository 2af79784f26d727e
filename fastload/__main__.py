"""``python -m fastload``: the ``fastload`` command."""

import sys

from fastload.cli import main

if __name__ == "__main__":
    sys.exit(main())
