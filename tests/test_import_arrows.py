"""Package arrows point down (parallelism ← model ← engine ← spec_decode ← scripts): every import statement of
engine/ and spec_decode/, lazy and TYPE_CHECKING ones included, read with ast."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABOVE = {"engine": ("spec_decode", "rpc", "scripts"), "spec_decode": ("rpc", "scripts")}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in ``path``, wherever it sits."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_import_reaches_up(package):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in sorted((ROOT / package).rglob("*.py")) for line, module in imported(path)
           if module.split(".")[0] in ABOVE[package]]
    assert not bad, bad
