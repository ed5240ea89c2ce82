"""The server talks to the engine through one door: ``rpc/`` imports the engine only through ``engine/api.py``
(requests and verbs, params, outputs, facts, snapshot, records), in the style of the speculation contract. Read with
``ast``: every import counts, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = "engine.api"


def engine_imports(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """``file:line`` → the ``engine`` modules it imports (``from engine import x`` counts as ``engine.x``)."""
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if node.module == "engine" else node.module for a in node.names]
            else:
                continue
            mods = {n for n in names if n == "engine" or n.startswith("engine.")}
            if mods:
                found.setdefault(f"{path.relative_to(root)}:{node.lineno}", set()).update(mods)
    return found


def test_rpc_imports_the_engine_only_through_its_api():
    found = engine_imports(sorted((ROOT / "rpc").rglob("*.py")))
    wrong = {where: mods - {API} for where, mods in found.items() if mods - {API}}
    assert not wrong, f"rpc/ reaches past {API}: {wrong}"
    assert found, "rpc/ should import the engine's API somewhere"


def test_rpc_imports_at_most_three_engine_modules():
    modules = set().union(*engine_imports(sorted((ROOT / "rpc").rglob("*.py"))).values())
    assert len(modules) <= 3, sorted(modules)


@pytest.mark.parametrize("spelling", ["from engine.core.scheduler import Scheduler",
                                      "import engine.engine", "from engine import engine"])
def test_a_planted_reach_through_fails(tmp_path, spelling):
    planted = tmp_path / "planted.py"
    planted.write_text(f"def f():\n    {spelling}\n")
    found = engine_imports([planted], root=tmp_path)
    assert list(found) == ["planted.py:2"] and found["planted.py:2"] - {API}


def test_every_name_the_api_exports_exists():
    import engine.api as api

    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing and len(set(api.__all__)) == len(api.__all__), missing
