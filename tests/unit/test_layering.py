"""The package's layers, kept by parsing imports: lower layers never import higher ones,
processes live only in the engine (and the converter's CLI-level workers), and only _device
touches CUDA."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fastload"

# module prefix -> fastload modules it must not import. From the bottom: the shared vocabulary
# (_types, _protocols, _capabilities), storage and object stores, where shards live, the readers, sampling and
# collation, the engine, the metrics (pure), the loader, the doctor; the applications on top.
FORBIDDEN = {
    "fastload._types": ["fastload._"],
    "fastload._protocols": ["fastload._storage", "fastload._remote", "fastload._shards", "fastload._formats", "fastload._sampling", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._capabilities": ["fastload._storage", "fastload._remote", "fastload._shards", "fastload._formats", "fastload._sampling", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._storage": ["fastload._remote", "fastload._shards", "fastload._formats", "fastload._sampling", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._remote": ["fastload._shards", "fastload._formats", "fastload._sampling", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._shards": ["fastload._formats", "fastload._sampling", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._formats": ["fastload._sampling", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._sampling": ["fastload._shards", "fastload._formats", "fastload._collate", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._collate": ["fastload._shards", "fastload._formats", "fastload._sampling", "fastload._engine", "fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._engine": ["fastload._metrics", "fastload._loader", "fastload._doctor", "fastload._apps"],
    "fastload._metrics": ["fastload._storage", "fastload._remote", "fastload._shards", "fastload._formats", "fastload._sampling", "fastload._collate", "fastload._engine", "fastload._loader", "fastload._doctor", "fastload._apps", "fastload._integrations"],
    "fastload._device": ["fastload._engine", "fastload._loader", "fastload._metrics", "fastload._doctor", "fastload._apps"],
    "fastload._loader": ["fastload._apps"],
    "fastload._doctor": ["fastload._apps", "fastload._loader"],
}
PROCESSES_ALLOWED = ("fastload._engine", "fastload._apps._convert")


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


# The packages from the bottom up, as the README's layout lists them: each imports only those
# before it (its own modules aside).
ORDER = [
    "_types", "_threads", "_protocols", "_capabilities", "errors", "_storage", "_remote", "_shards", "_formats", "_sampling",
    "_collate", "_engine", "_metrics", "_device", "_doctor", "_loader", "_integrations", "hf",
    "accelerate", "_apps", "cli", "__main__",
]  # fmt: skip


@pytest.mark.parametrize(("name", "tree"), [m for m in MODULES if m[0] != "fastload"], ids=lambda m: str(m))
def test_each_package_imports_only_the_packages_below_it(name: str, tree: ast.Module) -> None:
    mine = name.split(".")[1]
    assert mine in ORDER, f"{name}: a new package; place it in ORDER and in the README's layout"
    above = set(ORDER[ORDER.index(mine) + 1 :])
    bad = sorted(i for i in _imports(tree) if i.startswith("fastload.") and i.split(".")[1] in above)
    assert bad == [], f"{name} imports a package above it: {bad}"


APPLICATIONS = ("fastload._apps", "fastload.cli", "fastload.__main__")


@pytest.mark.parametrize(("name", "tree"), MODULES, ids=[m for m, _ in MODULES])
def test_nothing_in_the_library_imports_the_applications(name: str, tree: ast.Module) -> None:
    if name.startswith(APPLICATIONS):
        return
    bad = sorted(i for i in _imports(tree) if i.startswith(APPLICATIONS))
    assert bad == [], f"{name} imports the applications: {bad}"


@pytest.mark.parametrize(("name", "tree"), [m for m in MODULES if m[0].startswith("fastload._metrics")], ids=lambda m: str(m))
def test_the_metrics_import_neither_torch_nor_the_package_above_them(name: str, tree: ast.Module) -> None:
    bad = sorted(i for i in _imports(tree) if i.split(".")[0] == "torch" or i == "fastload" or (i.startswith("fastload.") and i.split(".")[1] not in ("_metrics", "_types", "errors")))
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


@pytest.mark.parametrize(("name", "tree"), MODULES, ids=[m for m, _ in MODULES])
def test_every_thread_the_library_starts_is_made_by_own_thread(name: str, tree: ast.Module) -> None:
    # A finalizer tells fastload's threads from the caller's by it (NOTE [closing from a
    # finalizer]): a thread made elsewhere would close an iterator where it may wait on itself.
    if name == "fastload._threads":
        return
    made = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)) in ("Thread", "Timer")
    ]
    assert made == [], f"{name} starts a thread on lines {made}: use fastload._threads.own_thread"


# -- packages talk through what they make public ----------------------------------------------
# A package is a folder of fastload (``_engine``, ``_formats``, ``_loader``, ...); ``fastload.cli``
# and the package's ``__init__`` are one more. A name that starts with one underscore is private
# to the package that defines it: another package may not import it, reach it as an attribute,
# or ``getattr`` it.


def _package(module: str) -> str:
    parts = module.split(".")
    return "fastload" if len(parts) == 1 else parts[1]


# Python's own protocols that happen to start with one underscore (named tuples).
_PROTOCOL_NAMES = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in _PROTOCOL_NAMES


def _assigned(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _assigned(element)]
    return [target]


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, methods, module and class
    attributes, and attributes it sets on ``self``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in (t for tt in targets for t in _assigned(tt)):
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    names.add(target.attr)
    return {n for n in names if _private(n)}


_PRIVATE_BY_PACKAGE: dict[str, set[str]] = {}
for _name, _tree in MODULES:
    _PRIVATE_BY_PACKAGE.setdefault(_package(_name), set()).update(_defined_private_names(_tree))


def _private_reach_ins(name: str, tree: ast.Module) -> list[str]:
    own = _package(name)
    mine = _PRIVATE_BY_PACKAGE.get(own, set())
    others = set().union(*(v for k, v in _PRIVATE_BY_PACKAGE.items() if k != own)) - mine
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastload"):
            source = _package(node.module)
            for alias in node.names:
                if source != own and _private(alias.name) and not _is_module(node.module, alias.name):
                    found.append(f"line {node.lineno}: imports {alias.name} from {node.module}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in others
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in others
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def _is_module(package: str, name: str) -> bool:
    base = PACKAGE.parent.joinpath(*package.split("."))
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


@pytest.mark.parametrize(("name", "tree"), MODULES, ids=[m for m, _ in MODULES])
def test_no_package_reaches_into_another_ones_private_names(name: str, tree: ast.Module) -> None:
    assert _private_reach_ins(name, tree) == [], f"{name} reaches into other packages' private names"


def test_the_reach_in_check_catches_a_private_attribute_of_another_package() -> None:
    source = "def f(ds):\n    return ds._mapped_ragged()\n"  # how the engine once read the readers
    _PRIVATE_BY_PACKAGE.setdefault("_formats", set()).add("_mapped_ragged")
    try:
        assert _private_reach_ins("fastload._engine._fake", ast.parse(source)) == ["line 2: ._mapped_ragged"]
        imported = "from fastload._collate._pad import _Prepared\n"
        assert _private_reach_ins("fastload._engine._fake", ast.parse(imported)) != []
    finally:
        _PRIVATE_BY_PACKAGE["_formats"].discard("_mapped_ragged")


# -- no import cycles ---------------------------------------------------------------------------
# An import inside a function counts too: a cycle broken only by importing late is still two
# modules that cannot be read apart. Checked over the whole library, imports inside functions and
# under TYPE_CHECKING included.
_ACYCLIC = ("fastload",)
_NAMES = {name for name, _ in MODULES}
# Compiled extension modules (a C source beside the package's Python): modules, not packages.
_NATIVE = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in PACKAGE.rglob("*.c")}


def _edges(tree: ast.Module) -> set[str]:
    """The fastload modules ``tree`` imports (``from package import module`` names the module)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in _NAMES)
        elif isinstance(node, ast.ImportFrom) and node.module in _NAMES:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & (_NAMES | _NATIVE)
            out.update(subs & _NAMES)
            if len(subs) < len(node.names):
                out.add(node.module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph(prefix: str) -> dict[str, set[str]]:
    inside = {n for n in _NAMES if n.startswith(prefix + ".")}
    return {name: _edges(tree) & inside for name, tree in MODULES if name in inside}


@pytest.mark.parametrize("package", _ACYCLIC)
def test_no_import_cycles(package: str) -> None:
    assert _cycles(_graph(package)) == []


def test_the_cycle_check_finds_a_cycle_through_a_late_import() -> None:
    a = ast.parse("from fastload._collate._pad import PadCollate\n")
    b = ast.parse("def f():\n    from fastload._collate import _kernels\n")
    graph = {"fastload._collate._kernels": _edges(a), "fastload._collate._pad": _edges(b)}
    assert _cycles(graph) == [["fastload._collate._kernels", "fastload._collate._pad"]]
