"""``import fastload`` never imports transformers or accelerate (the ``hf`` extra);
``fastload.hf`` and ``fastload.accelerate`` import them, and name the extra where they are
missing. Each check runs in a fresh interpreter: this one has imported them already."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_importing_fastload_imports_neither_transformers_nor_accelerate_nor_ray() -> None:
    result = _run(
        """
        import sys
        import fastload, fastload.cli
        loaded = sorted(m for m in ("transformers", "accelerate", "ray") if m in sys.modules)
        assert loaded == [], loaded
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("module", "missing"), [("fastload.hf", "transformers"), ("fastload.accelerate", "accelerate")])
def test_the_integrations_name_the_extra_when_their_package_is_missing(module: str, missing: str) -> None:
    # A None entry in sys.modules makes Python's import raise ImportError, as if not installed.
    result = _run(
        f"""
        import sys
        sys.modules[{missing!r}] = None
        try:
            import {module}
        except ImportError as exc:
            from fastload.errors import MissingExtraError
            assert type(exc) is MissingExtraError and exc.extra == "hf", repr(exc)
            print(exc)
        else:
            raise SystemExit("imported without {missing}")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'torch-fastload[hf]'" in result.stdout and repr(missing) in result.stdout


def test_engine_ray_without_ray_is_a_one_line_error_naming_the_extra(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    result = _run(
        f"""
        import sys
        sys.modules["ray"] = None
        from fastload.cli import main
        code = main(["convert", {str(tmp_path / "a.txt")!r}, "-o", {str(tmp_path / "o.h5")!r}, "--engine", "ray"])
        raise SystemExit(code)
        """
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'torch-fastload[ray]'" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "o.h5").exists()


def test_progress_without_tqdm_is_a_missing_extra_error_naming_the_progress_extra() -> None:
    result = _run(
        """
        import sys
        sys.modules["tqdm"] = None
        import fastload
        from fastload.errors import MissingExtraError
        try:
            fastload.DataLoader(list(range(8)), batch_size=2, progress=True)
        except MissingExtraError as exc:
            assert isinstance(exc, ImportError) and exc.extra == "progress"
            print(exc)
        else:
            raise SystemExit("progress=True built a loader without tqdm")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'torch-fastload[progress]'" in result.stdout and "'tqdm'" in result.stdout


def test_convert_with_a_tokenizer_json_without_tokenizers_names_the_convert_extra(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "tokenizer.json").write_text("{}")
    result = _run(
        f"""
        import sys
        sys.modules["tokenizers"] = None
        from fastload.cli import main
        raise SystemExit(main(["convert", {str(tmp_path / "a.txt")!r}, "-o", {str(tmp_path / "o.h5")!r},
                               "--tokenizer", {str(tmp_path / "tokenizer.json")!r}]))
        """
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'torch-fastload[convert]'" in result.stderr and len(result.stderr.splitlines()) == 1
