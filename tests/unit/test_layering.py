"""The package's layers, kept by parsing imports: lower layers never import higher ones,
processes live only in the engine (and the converter's CLI-level workers), and only _device
touches CUDA."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fastload"

# module prefix -> fastload modules it must not import
FORBIDDEN = {
    "fastload._types": ["fastload._"],
    "fastload._protocols": ["fastload._engine", "fastload._device", "fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert", "fastload._formats", "fastload._sampling", "fastload._collate", "fastload._options", "fastload._storage"],
    "fastload._storage": ["fastload._formats", "fastload._engine", "fastload._sampling", "fastload._collate", "fastload._device", "fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert"],
    "fastload._formats": ["fastload._engine", "fastload._device", "fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert", "fastload._sampling", "fastload._collate"],
    "fastload._sampling": ["fastload._engine", "fastload._device", "fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert", "fastload._formats", "fastload._collate"],
    "fastload._collate": ["fastload._engine", "fastload._device", "fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert", "fastload._formats", "fastload._sampling"],
    "fastload._engine": ["fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert", "fastload._device"],
    "fastload._device": ["fastload._engine", "fastload._loader", "fastload._iterator", "fastload._metrics", "fastload._convert"],
}
PROCESSES_ALLOWED = ("fastload._engine", "fastload._convert")


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, ast.parse(path.read_text(), str(path))))
    return out


def _imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = _modules()


@pytest.mark.parametrize(("name", "tree"), MODULES, ids=[m for m, _ in MODULES])
def test_lower_layers_do_not_import_higher_ones(name: str, tree: ast.Module) -> None:
    for prefix, banned in FORBIDDEN.items():
        if name == prefix or name.startswith(prefix + "."):
            bad = sorted(i for i in _imports(tree) for b in banned if i == b or i.startswith(b + ".") or (b.endswith("_") and i.startswith(b) and not i.startswith(prefix)))
            assert bad == [], f"{name} imports {bad}"


@pytest.mark.parametrize(("name", "tree"), MODULES, ids=[m for m, _ in MODULES])
def test_processes_live_only_in_the_engine(name: str, tree: ast.Module) -> None:
    if name.startswith(PROCESSES_ALLOWED):
        return
    bad = sorted(i for i in _imports(tree) if i.split(".")[0] in {"multiprocessing", "subprocess", "concurrent"})
    assert bad == [], f"{name} imports {bad}"


@pytest.mark.parametrize(("name", "tree"), MODULES, ids=[m for m, _ in MODULES])
def test_only_the_device_package_touches_cuda(name: str, tree: ast.Module) -> None:
    if name.startswith("fastload._device"):
        return
    uses = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch"
    ]
    assert uses == [], f"{name} uses torch.cuda on lines {uses}"
