"""Every file the repository cites is in the repository.

Citations are read from the Markdown pages (``README.md``, ``docs/**/*.md``: backticked spans, fenced blocks, link
targets and prose), from the comments, docstrings and string constants of every ``*.py`` file, and from the string
values of ``docs/*.json`` (the ``source`` fields of ``docs/kernel_efficiency.json``). A citation of ours is

- a path whose first component is one of our top-level names (:data:`TOP_LEVEL`) — ``engine/core/scheduler.py``,
  ``docs/kv_cache.md``, ``conf/parallel/``, globs such as ``tests/test_rpc*.py`` — resolved from the repository
  root, or from the citing page's folder for a Markdown link target;
- a bare ``*.md`` name with no folder (``NOTES.md``), which must be some file of the repository; in Markdown and
  in ``*.py`` comments and docstrings also a bare ``*.json`` or ``*.yaml`` name (``kernel_efficiency.json``);
- a path under ``outputs/``: what runs write there is never committed (the folder is git-ignored), so it is accepted
  only where the text gives it to the command that writes it (``--out outputs/agentic``,
  ``bench.output_dir=outputs/demo``); anywhere else it cites a file the repository does not have.

Paths of other projects do not start with our names (vLLM's ``v1/core/kv_cache_manager.py``,
``python/sglang/...``, ``crates/...``), and a path inside a URL or after another folder is not read as ours.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
# The repository's top-level names, and `outputs/`, where runs write (git-ignored: see WRITTEN_BY_A_COMMAND).
TOP_LEVEL = ("parallelism", "model", "engine", "spec_decode", "rpc", "bench", "conf", "scripts", "tests", "docs",
             ".ci", "outputs")
WRITTEN_BY_A_COMMAND = re.compile(r"(?:--out(?:put)?[ =]|output_dir=|--output-dir[ =])$")
NOT_IN_THE_REPOSITORY = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "outputs", "multirun"}
# Names of file formats that pages cite as what a Hugging Face checkpoint or tokenizer directory holds (ours has some
# of them, not all): the format, not a file of this repository.
FORMAT_NAMES = {"model.safetensors.index.json", "special_tokens_map.json", "chat_template.json"}
# Bare names of what a command writes (under its --out / output directory), each with the module that writes it: a
# test below checks that the module does, so a name stays accepted only while a command really writes it.
RUN_PRODUCTS = {"summary.md": "bench/report.py", "gpu_report.md": "bench/gpu/report.py",
                "gpu_report.json": "bench/gpu/report.py", "agentic.json": "scripts/bench_agentic.py"}
SELF = Path(__file__).resolve().relative_to(ROOT)  # its planted citations are the point

_START = r"(?<![\w./$~-])"  # not inside a longer path, a URL or an environment variable's path
_TOP = "|".join(re.escape(t) for t in TOP_LEVEL)
OUR_PATH = re.compile(_START + rf"((?:{_TOP})/[\w.*{{}},=<>-]*(?:/[\w.*{{}},=<>-]+)*/?)")
BARE_MD = re.compile(_START + r"([\w-][\w.-]*\.md)\b(?!/)")
BARE_DATA = re.compile(_START + r"([\w-][\w.-]*\.(?:json|yaml))\b(?!/)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Citation:
    where: str  # citing file and line
    cited: str  # as written
    base: Path  # the folder it resolves from
    written: bool = False  # handed to a command's output option (outputs/ only)


def repository_files(root: Path) -> list[Path]:
    """Every file of the repository (ignored folders left out), relative to ``root``."""
    out = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and not NOT_IN_THE_REPOSITORY.intersection(rel.parts) and not any(
                p.endswith(".egg-info") for p in rel.parts):
            out.append(rel)
    return out


def _paths_in(text: str, data_names: bool) -> Iterator[tuple[str, bool]]:
    """``(cited, written by a command)`` for each citation in ``text``."""
    for m in OUR_PATH.finditer(text):
        yield m.group(1).rstrip(".,"), bool(WRITTEN_BY_A_COMMAND.search(text[:m.start()]))
    yield from ((m.group(1), False) for m in BARE_MD.finditer(text))
    if data_names:
        yield from ((m.group(1), False) for m in BARE_DATA.finditer(text))


def markdown_citations(root: Path, page: Path) -> Iterator[Citation]:
    for n, line in enumerate((root / page).read_text().splitlines(), 1):
        where = f"{page}:{n}"
        for cited, written in _paths_in(line, data_names=True):
            yield Citation(where, cited, root, written)
        for target in LINK.findall(line):
            target = target.split("#")[0]
            if target and not re.match(r"[a-z]+:", target):
                yield Citation(where, target, root / page.parent)


def python_citations(root: Path, source: Path) -> Iterator[Citation]:
    """Comments and docstrings (bare data names too) and every other string constant (our paths and bare
    ``*.md`` names only: code builds file names such as ``config.json`` that are not citations; a path under
    ``outputs/`` there is where that code writes)."""
    text = (root / source).read_text()
    tree = ast.parse(text)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            doc = id(node) in docstrings
            for cited, written in _paths_in(node.value, data_names=doc):
                # a string in code naming a place under outputs/ is where that code writes (an --out default)
                yield Citation(f"{source}:{node.lineno}", cited, root, written or not doc)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            for cited, written in _paths_in(tok.string, data_names=True):
                yield Citation(f"{source}:{tok.start[0]}", cited, root, written)


def json_citations(root: Path, data: Path) -> Iterator[Citation]:
    def strings(value) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    for s in strings(json.loads((root / data).read_text())):
        for cited, written in _paths_in(s, data_names=True):
            yield Citation(str(data), cited, root, written)


def citations(root: Path) -> list[Citation]:
    files = repository_files(root)
    out = []
    for f in files:
        if f.suffix == ".md" and (f.parts[0] == "docs" or f == Path("README.md")):
            out += markdown_citations(root, f)
        elif f.suffix == ".py" and f != SELF:
            out += python_citations(root, f)
        elif f.suffix == ".json" and f.parts[0] == "docs":
            out += json_citations(root, f)
    return out


def _expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def placeholder(name: str) -> bool:
    """``IN.json``, ``OUT.json``: a data file the reader supplies (an upper-case stem; never a ``*.md`` page)."""
    stem, _, ext = name.rpartition(".")
    return ext in ("json", "yaml") and stem.isupper()


def resolves(c: Citation, root: Path, names: set[str]) -> bool:
    """A bare name: some file of the repository has it (or it is a format name, a run's product, a placeholder).
    A path (``<X>`` placeholders and globs allowed, ``{a,b}`` expanded): it matches a file or folder; under
    ``outputs/``, it is handed to the command that writes it."""
    if c.cited.split("/")[0] == "outputs":
        return c.written
    if "/" not in c.cited:
        return (c.cited in names or c.cited in FORMAT_NAMES or c.cited in RUN_PRODUCTS or placeholder(c.cited)
                or (c.base / c.cited).is_file())
    for pattern in _expand_braces(re.sub(r"<[^<>/]*>", "*", c.cited)):
        target = (c.base / pattern).resolve()
        if any(ch in pattern for ch in "*?["):
            if any(True for _ in c.base.glob(pattern.rstrip("/"))):
                continue
            return False
        try:
            rel = target.relative_to(root.resolve())
        except ValueError:
            return False
        if not target.exists() or NOT_IN_THE_REPOSITORY.intersection(rel.parts):
            return False
    return True


def missing(root: Path) -> list[str]:
    names = {f.name for f in repository_files(root)}
    return sorted({f"{c.where}: {c.cited}" for c in citations(root) if not resolves(c, root, names)})


def test_every_cited_file_is_in_the_repository():
    absent = missing(ROOT)
    assert not absent, "cited but not in the repository:\n" + "\n".join(absent)


def test_run_products_are_written_by_their_module():
    for name, writer in RUN_PRODUCTS.items():
        assert name in (ROOT / writer).read_text(), f"{writer} no longer writes {name}"


def test_the_citations_are_read_from_every_kind_of_source():
    found = {(c.where.split(":")[0], c.cited) for c in citations(ROOT)}
    assert ("README.md", "docs/kv_cache.md") in found
    assert ("docs/cost_model.md", "kernel_efficiency.json") in found  # a link relative to its page
    assert ("engine/worker/spec_contract.py", "tests/architecture/test_speculation_contract.py") in found  # a docstring
    assert ("docs/kernel_efficiency.json", "docs/records/gpu_first_run.md") in found  # a source field
    assert any(w == "bench/cost/hardware.py" and c == "docs/records/field_notes.md" for w, c in found)  # a data string


@pytest.mark.parametrize("plant", [
    ("docs/page.md", "See `engine/nowhere.py` for the rest.\n"),
    ("docs/page.md", "Figures from [the run](missing_run.md).\n"),
    ("docs/page.md", "As `DESIGN.md` says.\n"),
    ("README.md", "Numbers in `gone_table.json`.\n"),
    ("engine/mod.py", "# after spec_decode/nowhere.py\nX = 1\n"),
    ("engine/mod.py", '"""See GPU_FINDINGS.md."""\n'),
    ("bench/data.py", 'REF = "REFERENCES.md"\n'),
    ("docs/data.json", '{"rows": [{"source": "docs/absent_run.md"}]}\n'),
])
def test_a_planted_citation_of_a_missing_file_fails(tmp_path, plant):
    path, text = plant
    for f in ("engine/present.py", "docs/present.md"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n" if f.endswith(".py") else "`engine/present.py`, `present.md`\n")
    assert missing(tmp_path) == []
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
    assert len(missing(tmp_path)) == 1, missing(tmp_path)


def test_other_projects_paths_are_not_ours(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "vLLM's `v1/core/kv_cache_manager.py`, SGLang's `python/sglang/srt/mem_cache/radix_cache.py`, "
        "smg's `crates/grpc/src/lib.rs`, https://github.com/vllm-project/vllm/blob/main/docs/design/metrics.md, "
        "rtx6kpro's models/kimi-k25.md, `$OUT/gpu_report.md`.\n")
    assert missing(tmp_path) == []


def test_a_run_product_is_cited_only_with_the_command_that_writes_it(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_agentic.py").write_text("x = 1\n")
    page.write_text("`python scripts/bench_agentic.py --out outputs/agentic`, `bench.output_dir=outputs/demo`\n")
    assert missing(tmp_path) == []
    page.write_text("The figures are in `outputs/agentic/agentic.json`.\n")
    assert missing(tmp_path) == ["docs/page.md:1: outputs/agentic/agentic.json"]
