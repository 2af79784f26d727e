"""The applications built on the library: the converter (``fastload convert``, ``inspect``,
``index``), ``fastload bench``, ``fastload demo`` and the doctor's command line. Only
``fastload.cli`` imports them; nothing in the library does (the layering test checks it)."""
