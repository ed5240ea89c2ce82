"""A class fits on a screen and has one job: none in ``engine/``, ``rpc/`` or ``spec_decode/`` has more than 20
methods (properties and dunders counted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_METHODS = 20


def method_counts(paths: list[Path]) -> dict[str, int]:
    counts = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.relative_to(ROOT)}:{node.name}"] = sum(
                    isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
    return counts


def test_no_class_has_more_than_twenty_methods():
    paths = sorted(p for pkg in ("engine", "rpc", "spec_decode") for p in (ROOT / pkg).rglob("*.py"))
    counts = method_counts(paths)
    big = {name: n for name, n in counts.items() if n > MAX_METHODS}
    assert counts and not big, big
