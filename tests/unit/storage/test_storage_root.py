"""Where the cache lives, and how entries derived from a local file are named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastload._storage import SourceVersion, cache_root, derived_path, other_versions


def test_cache_root_prefers_the_argument_then_the_env_then_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "env"))
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_root() == tmp_path / "env"
    monkeypatch.setenv("FASTLOAD_CACHE", "")  # empty counts as unset
    assert cache_root() == tmp_path / "xdg" / "fastload"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as XDG says
    assert cache_root() == tmp_path / "home" / ".cache" / "fastload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == tmp_path / "home" / ".cache" / "fastload"


def test_cache_root_is_absolute_and_expands_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cache_root("rel") == tmp_path / "rel"
    assert cache_root("~/c") == tmp_path / "c"
    assert not (tmp_path / "rel").exists()  # never created here


def _source(tmp_path: Path, content: bytes, mtime_ns: int) -> SourceVersion:
    path = tmp_path / "data.v2.parquet"
    path.write_bytes(content)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return SourceVersion.of(path)


def test_an_entry_name_changes_with_the_source_version_and_the_variant(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = derived_path(cache, _source(tmp_path, b"abc", 10**18), "tokens", ".arrow")
    assert first.parent == cache and first.name.startswith("data_v2.") and first.suffix == ".arrow"
    assert derived_path(cache, _source(tmp_path, b"abc", 10**18), "tokens", ".arrow") == first
    assert derived_path(cache, _source(tmp_path, b"abcd", 10**18), "tokens", ".arrow") != first
    assert derived_path(cache, _source(tmp_path, b"abc", 10**18 + 1), "tokens", ".arrow") != first
    assert derived_path(cache, _source(tmp_path, b"abc", 10**18), "label", ".arrow") != first


def test_other_versions_are_the_same_source_path_at_another_version(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    old = derived_path(cache, _source(tmp_path, b"old", 1), "tokens", ".arrow")
    old_other_fields = derived_path(cache, _source(tmp_path, b"old", 1), "label", ".arrow")
    new = derived_path(cache, _source(tmp_path, b"new!", 2), "tokens", ".arrow")
    new_other_fields = derived_path(cache, _source(tmp_path, b"new!", 2), "label", ".arrow")
    other_file = tmp_path / "other.parquet"
    other_file.write_bytes(b"x")
    unrelated = derived_path(cache, SourceVersion.of(other_file), "tokens", ".arrow")
    for path in (old, old_other_fields, new, new_other_fields, unrelated):
        path.write_bytes(b"")
    (cache / f".{old.name}.lock").write_bytes(b"")
    assert other_versions(new) == sorted([old, old_other_fields])
    assert other_versions(old) == sorted([new, new_other_fields])
