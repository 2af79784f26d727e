"""The converter behind ``fastload convert`` / ``scripts/convert_to_hdf5.py`` and ``fastload inspect``.

Stages, each in its own module, data flowing one way::

    _discover  inputs → typed file list          _inputs / _numpy_inputs  files → chunks (main process)
    _records   chunk → validated columns         _encode                  columns → token arrays (workers)
    _tokenize  text → token ids                  _parallel                ordered, bounded process map
    _writer    arrays → spools → HDF5 shards      _crash_safe              temp folder, fsync, rename
    _convert   the orchestration                 _cli / _inspect          the commands

Nothing here is public API; the commands are the interface.
"""
