#!/usr/bin/env python
"""Convert raw data (text, JSON Lines, CSV, Parquet, Arrow, Hugging Face folders, numpy arrays)
into the fastload HDF5 layout. The same command as ``fastload convert``; see ``--help``."""

from __future__ import annotations

import sys

from fastload._apps._convert._cli import convert_main

if __name__ == "__main__":  # the guard matters: --workers spawns processes that import this file
    sys.exit(convert_main())
