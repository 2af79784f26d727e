"""What ``pip install`` gets: a wheel under a distribution name that is fastload's own (the
index's ``fastload`` is an unrelated project), with ``py.typed`` and the license file, and
every install hint (errors, README, scripts) naming that distribution and an extra it has."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib

from fastload.errors import DISTRIBUTION, install_command

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())

#: ``pip install 'NAME[extra]'``, ``pip install NAME[extra]`` and a bare ``NAME[extra]``.
HINT = re.compile(r"(?<![\w.-])([A-Za-z][\w.-]*)\[([a-z,]+)\]")


def _hint_files() -> list[Path]:
    files = [*(REPO_ROOT / "fastload").rglob("*.py"), REPO_ROOT / "README.md", REPO_ROOT / "dev.sh"]
    files += [*(REPO_ROOT / "requirements").iterdir(), *(REPO_ROOT / "scripts").iterdir()]
    return [f for f in files if f.is_file() and f.suffix not in (".so", ".pyc")]


def test_the_distribution_name_is_not_the_unrelated_fastload_and_errors_use_it() -> None:
    assert PYPROJECT["project"]["name"] == DISTRIBUTION != "fastload"
    assert install_command("hf") == f"pip install '{DISTRIBUTION}[hf]'"


def test_every_install_hint_names_the_distribution_and_an_extra_it_has() -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    found = []
    for path in _hint_files():
        text = path.read_text()
        for line in text.splitlines():
            if "pip install" not in line and "fastload[" not in line:
                continue
            for name, wanted in HINT.findall(line):
                found.append((path.name, name, wanted))
    assert found, "no install hints found: the pattern is wrong"
    wrong = [f for f in found if f[1] != DISTRIBUTION or not set(f[2].split(",")) <= extras]
    assert wrong == []


def test_license_is_an_spdx_string_with_its_file() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO_ROOT / "LICENSE").read_text()[:200]
    assert "Apache-2.0" in (REPO_ROOT / "README.md").read_text()


@pytest.mark.slow
def test_the_wheel_ships_py_typed_and_the_license_under_the_distribution_name(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(
        REPO_ROOT / "fastload", source / "fastload",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=110, check=False,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith(DISTRIBUTION.replace("-", "_") + "-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(archive.read(metadata).decode())
    assert "fastload/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert fields["Name"] == DISTRIBUTION
    assert fields["License-Expression"] == "Apache-2.0"


def test_the_readme_names_the_c_files_pyproject_compiles_and_nothing_outside_the_repository() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    compiled = {s for m in PYPROJECT["tool"]["setuptools"]["ext-modules"] for s in m["sources"]}
    named = set(re.findall(r"`(fastload/[\w/]+\.c)`", readme))
    assert compiled and named == compiled
    assert re.search(r"compiles (two|three|four) ", readme) is None  # a count goes stale
    assert "../" not in readme and "DESIGN.md" not in readme
    for phrase in ("this 2-core machine", "this project's VM", "on this machine"):
        assert phrase not in readme
