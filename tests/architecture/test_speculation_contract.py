"""engine/ uses speculative decoding only through the contract in ``engine/worker/spec_contract.py``: every attribute
the engine reads off an injected speculator is a member of the :class:`engine.worker.spec_contract.Speculator`
Protocol, every one it reads off a :class:`~engine.worker.spec_contract.Speculation` or its facts is a field of theirs,
the contract names no ``Any`` (nor an untyped ``Callable[..., …]``), and the implementations on both sides have the
Protocols' members with their parameters. Read with ``ast`` (the engine side) and ``inspect`` (the signatures)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from engine.worker import runner
from engine.worker import spec_contract as speculation
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
CONTRACT = ROOT / "engine" / "worker" / "spec_contract.py"


def protocol_members(cls: type) -> set[str]:
    """The members a Protocol class declares itself (methods, properties, annotated attributes)."""
    own = {name for name in vars(cls) if not name.startswith("_")}
    return own | set(getattr(cls, "__annotations__", {}))


# what the engine may read off each kind of injected object, by the attribute it is held under
ALLOWED = {
    "speculator": protocol_members(speculation.Speculator),
    "speculation": {f.name for f in dataclasses.fields(speculation.Speculation)},
    "facts": {f.name for f in dataclasses.fields(speculation.SpeculationFacts)},
}


def attribute_uses(tree: ast.AST, holders: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """``(holder, attribute, line)`` for every ``<expr>.holder.attribute`` and ``holder.attribute`` (a variable so
    named) in ``tree``, and every ``name.attribute`` where ``name`` was assigned ``<expr>.holder`` (or ``<expr>.holder
    if … else …``) in the same function."""
    uses = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        aliases: dict[str, str] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                value = node.value.body if isinstance(node.value, ast.IfExp) else node.value
                values = value.elts if isinstance(value, ast.Tuple) else [value]
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                for target, v in zip(targets, values, strict=False):
                    v = v.body if isinstance(v, ast.IfExp) else v
                    if isinstance(target, ast.Name) and isinstance(v, ast.Attribute) and v.attr in holders:
                        aliases[target.id] = v.attr
        for node in ast.walk(scope):
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            if isinstance(inner, ast.Attribute) and inner.attr in holders:
                uses.append((inner.attr, node.attr, node.lineno))
            elif isinstance(inner, ast.Name) and inner.id in holders and scope is tree:  # a parameter so named
                uses.append((inner.id, node.attr, node.lineno))
            elif isinstance(inner, ast.Name) and inner.id in aliases and scope is not tree:
                uses.append((aliases[inner.id], node.attr, node.lineno))
    return sorted(set(uses))


def violations(path: Path) -> list[str]:
    uses = attribute_uses(ast.parse(path.read_text(), str(path)), tuple(ALLOWED))
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line} .{holder}.{attr}"
            for holder, attr, line in sorted(uses, key=lambda use: use[2]) if attr not in ALLOWED[holder]]


def test_the_walker_sees_direct_and_aliased_uses(tmp_path):
    """The walker on a made-up engine module: a direct use of a non-Protocol method, one through an alias, and
    a fact that does not exist are flagged; the Protocol's own members are not."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self, work):\n"
                   "    self.speculator.speculate(work, None)\n"
                   "    trees = self.speculator.propose(work)\n"
                   "    spec = self.speculator\n"
                   "    spec.add_context(work[0], None, 0)\n"
                   "    n = self.speculation.facts.num_nodes\n"
                   "    return spec.feature_layers, trees, n\n"
                   "def g(speculation):\n"
                   "    return speculation.config, speculation.facts.tree_size\n")
    assert violations(bad) == ["bad.py:3 .speculator.propose", "bad.py:5 .speculator.add_context",
                               "bad.py:6 .facts.num_nodes", "bad.py:9 .speculation.config"]


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT / "engine")))
def test_engine_uses_the_speculator_only_through_the_protocol(path):
    assert not violations(path), violations(path)


def test_the_runner_uses_the_speculator():
    """The check has something to check: the runner drives the speculator through each Protocol method."""
    uses = {attr for holder, attr, _ in attribute_uses(ast.parse(Path(runner.__file__).read_text()), ("speculator",))
            if holder == "speculator"}
    assert uses == ALLOWED["speculator"], uses


def test_the_contract_names_no_any():
    tree = ast.parse(CONTRACT.read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "Any" not in names and "Any" not in CONTRACT.read_text().split()
    untyped = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
               and n.value.id == "Callable" and isinstance(n.slice, ast.Tuple)
               and isinstance(n.slice.elts[0], ast.Constant) and n.slice.elts[0].value is Ellipsis]
    assert not untyped, f"Callable[..., …] at lines {untyped}"


def _signature_matches(impl: type, protocol: type) -> list[str]:
    """Members of ``protocol`` that ``impl`` lacks or takes with other parameter names."""
    wrong = []
    for name in sorted(protocol_members(protocol)):
        want = getattr(protocol, name)
        if isinstance(want, property):  # a read-only attribute: the implementation may set it per instance
            continue
        got = getattr(impl, name, None)
        if got is None:
            wrong.append(f"{impl.__name__} lacks {name}")
        elif list(inspect.signature(got).parameters) != list(inspect.signature(want).parameters):
            wrong.append(f"{impl.__name__}.{name}{inspect.signature(got)} vs {inspect.signature(want)}")
    return wrong


def test_the_implementations_have_the_protocols_members():
    from spec_decode.speculation import DFlashSpeculator

    assert not _signature_matches(DFlashSpeculator, speculation.Speculator)
    assert not _signature_matches(runner._DynamicTarget, speculation.TargetForward)
    assert not _signature_matches(runner._StaticTarget, speculation.StaticTarget)
    from engine.sampling.logits_processors import TreeSampling

    assert not _signature_matches(TreeSampling, speculation.NodeSampler)
    assert "feature_layers" in inspect.getsource(DFlashSpeculator.__init__)
