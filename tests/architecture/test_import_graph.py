"""Arrows point down (docs/ARCHITECTURE.md, "Rooms"): no import cycle between modules or between top-level packages,
``parallelism ← model ← engine ← spec_decode, rpc``, and ``bench/`` (tooling) imported by no runtime package.

Every ``import`` statement counts, wherever it stands: a function-level (lazy) import or one under
``if TYPE_CHECKING:`` is still an arrow, and a lazy import that only dodges a cycle is what this test exists to
catch. Read with ``ast`` (nothing is imported), except the last check, which imports ``engine.engine`` in a
fresh interpreter and looks at what came with it.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
# Each top-level package and the packages it may import (bench/ sits beside scripts/: it may import them all).
ALLOWED = {
    "parallelism": set(),
    "model": {"parallelism"},
    "engine": {"parallelism", "model"},
    "spec_decode": {"parallelism", "model", "engine"},
    "rpc": {"parallelism", "model", "engine", "spec_decode"},
    "bench": {"parallelism", "model", "engine", "spec_decode", "rpc"},
}
PACKAGES = tuple(ALLOWED)
# Inside engine/, packages by where code runs: rank 0's core and every rank's worker share only the modules below them
# (wire types, params, config) and never import each other; sampling (every rank) imports neither.
NEVER = {"engine.core": ("engine.worker",), "engine.worker": ("engine.core",),
         "engine.sampling": ("engine.core", "engine.worker")}
NOT_WITH_THE_RUNTIME = ("matplotlib", "pynvml", "bench")  # import engine.engine must not pull these in

@functools.cache
def module_graph() -> dict[str, dict[str, int]]:
    return graph_of(ROOT, PACKAGES)


def graph_of(root: Path, packages: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Module → {imported module of ours: line of the first such import}, over every ``.py`` of ``packages``.
    ``from a.b import c`` is an arrow to ``a.b.c`` when that is a module, else to ``a.b``; importing a module also
    runs its parent packages' ``__init__``, so they are arrows too (except the importer's own parents)."""
    def module_name(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {module_name(p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package, one level up per extra dot
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import a.b.attr`-like spellings: the module part
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for i in range(len(parts), 0, -1):  # the module itself first: it is the arrow shown
                    mod = ".".join(parts[:i])
                    if mod in files and mod != name and not name.startswith(mod + "."):
                        edges.setdefault(mod, node.lineno)
        graph[name] = edges
    return graph


def package_graph() -> dict[str, dict[str, str]]:
    """Top-level package → {package it imports: one ``importer:line → imported`` arrow as evidence}."""
    out: dict[str, dict[str, str]] = {p: {} for p in PACKAGES}
    for mod, edges in module_graph().items():
        for target, line in edges.items():
            src, dst = mod.split(".")[0], target.split(".")[0]
            if src != dst:
                out[src].setdefault(dst, f"{mod}:{line} → {target}")
    return out


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan), each as ``[a, b, …, a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_cycle_in(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_in(graph: dict[str, dict], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first node, staying inside the component (breadth-first)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in component and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle found in component {sorted(component)}")


def _show(cycle: list[str], graph: dict[str, dict]) -> str:
    return " → ".join(f"{a} (line {graph[a][b]})" if isinstance(graph[a][b], int) else f"{a} [{graph[a][b]}]"
                      for a, b in zip(cycle, cycle[1:], strict=False)) + f" → {cycle[-1]}"


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path):
    """The walker itself, on a made-up package: function-level, ``TYPE_CHECKING``, relative and
    ``from package import module`` imports are arrows, and the lazy one closes a cycle."""
    files = {"pkg/__init__.py": "", "pkg/sub/__init__.py": "",
             "pkg/a.py": "import os\nfrom pkg.sub import b\n",
             "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n",
             "pkg/c.py": "def f():\n    from .a import g  # lazy\n    return g\n",
             "pkg/d.py": "import pkg.sub.b as b\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = graph_of(tmp_path, ("pkg",))
    assert graph == {"pkg": {}, "pkg.a": {"pkg.sub.b": 2, "pkg.sub": 2}, "pkg.c": {"pkg.a": 2},
                     "pkg.d": {"pkg.sub.b": 1, "pkg.sub": 1}, "pkg.sub": {}, "pkg.sub.b": {"pkg.c": 3}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert "pkg.a (line 2) → pkg.sub.b (line 3) → pkg.c (line 2) → pkg.a" == _show(cycles(graph)[0], graph)
    assert "model.triton.attention" in module_graph()["model.kernel_select"]  # imported inside a function


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_import_cycle_through(package):
    """No cycle of module imports passes through a module of ``package``."""
    graph = module_graph()
    bad = [c for c in cycles(graph) if any(m.split(".")[0] == package for m in c)]
    assert not bad, "import cycles:\n" + "\n".join(_show(c, graph) for c in bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_import_cycle_through(package):
    """No cycle between top-level packages passes through ``package`` (each arrow shown with one import)."""
    graph = package_graph()
    bad = [c for c in cycles(graph) if package in c]
    assert not bad, "package cycles:\n" + "\n".join(_show(c, graph) for c in bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_the_packages_below_it(package):
    wrong = {dst: why for dst, why in package_graph()[package].items() if dst not in ALLOWED[package]}
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}; it imports: {wrong}"


def forbidden_arrows(graph: dict[str, dict[str, int]]) -> list[str]:
    """``importer:line → imported`` for every arrow :data:`NEVER` rules out."""
    def inside(mod: str, pkg: str) -> bool:
        return mod == pkg or mod.startswith(pkg + ".")

    return [f"{mod}:{line} → {target}" for mod, edges in sorted(graph.items()) for target, line in edges.items()
            for src, banned in NEVER.items() if inside(mod, src) and any(inside(target, b) for b in banned)]


def test_core_and_worker_never_import_each_other():
    """Rank 0's core (scheduler, KV manager, recorder) and every rank's worker (runner, KV cache, graphs) meet only
    in the wire types below them; sampling imports neither."""
    bad = forbidden_arrows(module_graph())
    assert not bad, "engine/core and engine/worker import each other:\n" + "\n".join(bad)


@pytest.mark.parametrize("spelling", ["from engine.core.scheduler import Scheduler",
                                      "from ..core import scheduler", "import engine.core.kv_manager as kv"])
def test_a_planted_worker_to_core_import_fails(tmp_path, spelling):
    """The rule sees absolute, relative and aliased spellings."""
    files = {"engine/__init__.py": "", "engine/core/__init__.py": "", "engine/core/scheduler.py": "",
             "engine/core/kv_manager.py": "", "engine/worker/__init__.py": "",
             "engine/worker/runner.py": f"def f():\n    {spelling}\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = forbidden_arrows(graph_of(tmp_path, ("engine",)))
    assert bad and all(b.startswith("engine.worker.runner:2 → engine.core") for b in bad), bad


@functools.cache
def _modules_after(statement: str) -> frozenset[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return frozenset(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("tooling", ("matplotlib", "bench"))
def test_importing_the_engine_does_not_import(tooling):
    """What ``import engine.engine`` adds to ``import torch``."""
    added = _modules_after("import engine.engine") - _modules_after("import torch")
    pulled = sorted(m for m in added if m == tooling or m.startswith(tooling + "."))
    assert not pulled, f"`import engine.engine` imports {pulled[:5]}"


def _module_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of the imports a module runs when it is imported: its body, including ``if`` and
    ``try`` blocks, but not function or class bodies."""
    found, todo = [], list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]
    return found


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "bench"])
def test_runtime_modules_import_tooling_only_lazily(package):
    """pynvml (which ``import torch`` loads by itself where it is installed, so a module-count check cannot see
    our own import of it), matplotlib and bench are imported inside the functions that need them, never when a
    runtime module is imported."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in sorted((ROOT / package).rglob("*.py")) for line, name in _module_level_imports(path)
           if name in NOT_WITH_THE_RUNTIME]
    assert not bad, bad
