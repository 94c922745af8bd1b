"""The package layout is the architecture: imports point one way, and only the API reaches the runtime.

The layers of ``shmemx/``, bottom up: ``errors`` (leaf), ``shm`` (shared-memory substrate), ``udma`` (the data
plane), ``observe`` (recorders and readers), ``runtime`` (the wiring), ``api`` (the public calls), and the package
itself (``__init__``, ``__main__``), which re-exports the API. A module may import from its own layer and the ones
below; every import counts, function-level ones included (a function-level import that dodges a cycle is a
cycle). Only ``api`` and ``runtime`` may use ``runtime()``. ``kernels/`` uses only the public ``shmemx`` names.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import shmemx

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"errors": 0, "shm": 1, "udma": 2, "observe": 3, "runtime": 4, "api": 5, "__init__": 6, "__main__": 6}
RUNTIME_USERS = {"api", "runtime", "__init__"}


def _modules(pkg_dir: Path, pkg: str) -> dict[str, Path]:
    out = {}
    for path in pkg_dir.rglob("*.py"):
        rel = path.relative_to(pkg_dir).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([pkg, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module of ``known``, line) for every import in the file, function-level ones included."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                mod = anchor + ("." + node.module if node.module else "")
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names]
            # ``from pkg import module`` depends on the module, not on the package's __init__
            targets = subs if all(t in known for t in subs) else [mod] + subs
        for t in targets:
            if t in known and t != name:
                found.append((t, node.lineno))
    return found


def _layer(name: str, pkg: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def layering_violations(pkg_dir: Path, pkg: str) -> list[str]:
    """Every import of ``pkg`` that points up a layer, and every cycle (as text); empty when the layout holds."""
    mods = _modules(pkg_dir, pkg)
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    out = []
    for m, edges in graph.items():
        lm = LAYERS[_layer(m, pkg)]
        for t, line in edges:
            lt = LAYERS[_layer(t, pkg)]
            if lt > lm:
                out.append(f"{mods[m].relative_to(pkg_dir)}:{line}: {m} ({_layer(m, pkg)}) imports {t} "
                           f"({_layer(t, pkg)}), a layer above it")
    out += [f"import cycle: {' -> '.join(c)}" for c in _cycles({m: {t for t, _ in e} for m, e in graph.items()})]
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def runtime_users(pkg_dir: Path, pkg: str) -> list[str]:
    """Modules outside ``api`` / ``runtime`` that import or call ``runtime()`` (file:line)."""
    out = []
    for name, path in _modules(pkg_dir, pkg).items():
        if _layer(name, pkg) in RUNTIME_USERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "runtime" for a in node.names):
                out.append(f"{path.relative_to(pkg_dir)}:{node.lineno}: imports runtime")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "runtime":
                out.append(f"{path.relative_to(pkg_dir)}:{node.lineno}: calls runtime()")
    return out


def test_imports_point_down_and_have_no_cycle():
    assert layering_violations(ROOT / "shmemx", "shmemx") == []


def test_only_the_api_reaches_the_runtime():
    assert runtime_users(ROOT / "shmemx", "shmemx") == []


def test_every_folder_is_a_layer():
    folders = {p.name for p in (ROOT / "shmemx").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "shmemx").glob("*.py")}
    assert folders | modules == set(LAYERS)


def test_the_checker_catches_wrong_way_imports(tmp_path):
    pkg = tmp_path / "pkg"
    for folder in ("shm", "udma", "api"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime.py").write_text("def runtime():\n    pass\n")
    (pkg / "shm" / "waits.py").write_text("def f():\n    from ..udma import queues\n")  # up, inside a function
    (pkg / "udma" / "queues.py").write_text("from ..shm import waits\nfrom ..runtime import runtime\n")
    (pkg / "api" / "rma.py").write_text("from ..udma import queues\n")
    found = layering_violations(pkg, "pkg")
    assert any("shm/waits.py:2: pkg.shm.waits (shm) imports pkg.udma.queues (udma)" in f for f in found), found
    assert any("udma/queues.py:2" in f and "imports pkg.runtime" in f for f in found), found
    assert any(f.startswith("import cycle: pkg.shm.waits -> pkg.udma.queues") for f in found), found
    assert not any("api/rma.py" in f for f in found), found
    assert runtime_users(pkg, "pkg") == ["udma/queues.py:2: imports runtime"]


def _public_import(node: ast.AST) -> str | None:
    """Why an import of a kernel module reaches past the public API, or None when it does not."""
    if isinstance(node, ast.Import):
        bad = [a.name for a in node.names if a.name.startswith("shmemx.") and not a.name.startswith("shmemx.kernels")]
        return f"import {', '.join(bad)}" if bad else None
    if isinstance(node, ast.ImportFrom) and not node.level:
        mod = node.module or ""
        if mod == "shmemx":
            private = [a.name for a in node.names if a.name not in shmemx.__all__]
            return f"from shmemx import {', '.join(private)}" if private else None
        if mod.startswith("shmemx.") and not mod.startswith("shmemx.kernels"):
            return f"from {mod} import ..."
    return None


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_use_only_the_public_api(path):
    tree = ast.parse(path.read_text())
    bad = [f"{path.relative_to(ROOT)}:{n.lineno}: {why}" for n in ast.walk(tree) if (why := _public_import(n))]
    private = [f"{path.relative_to(ROOT)}:{n.lineno}: shmemx.{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "shmemx"
               and n.attr not in shmemx.__all__ and not n.attr.startswith("__")]
    assert bad + private == []


def test_public_import_paths_of_the_readme():
    from shmemx.launcher import launch  # noqa: F401
    from shmemx.layout import decode_wqe, pack_wqe  # noqa: F401

    assert shmemx.layout.pack_wqe is pack_wqe
    assert os.path.basename(shmemx.layout.__file__) == "layout.py"
