"""One way to run a command in the README and ``docs/``: the project's tools spelled from ``.venv/bin/``
(``.venv/bin/python``, ``.venv/bin/smg``, ``.venv/bin/mooncake_master``), never a bare ``python``, ``smg`` or
``pytest`` that a fresh shell resolves elsewhere (the README says so under Quickstart). Records of past runs
(``docs/NOTES.md``, ``docs/records/``) keep the commands as they were run, and ``docs/smg_protocol.md`` quotes
smg's and vLLM's own."""

from __future__ import annotations

import re

import pytest

from tests.support.paths import REPO_ROOT

TOOLS = r"(?:python3?|smg|pytest|pip|mooncake_master|mooncake_http_metadata_server)"
BARE = re.compile(rf"(?:^|[`(]|^\s+|&& |; |\| ){TOOLS} (?:scripts/|tests/|-m |launch --|--|[\w./-]+\.py)")
RECORDS = ("NOTES.md", "smg_protocol.md")  # smg_protocol.md: research notes on another project's commands
DOCS = ["README.md", *sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").glob("*.md")
                             if p.name not in RECORDS)]


def bare_commands(text: str) -> list[str]:
    """Lines of ``text`` whose command starts with a tool not spelled from ``.venv/bin/``."""
    return [line.strip() for line in text.splitlines() if BARE.search(line)]


@pytest.mark.parametrize("doc", DOCS)
def test_commands_run_the_venv_tools(doc):
    assert not bare_commands((REPO_ROOT / doc).read_text()), doc


def test_a_bare_command_is_caught():
    planted = "Run `python scripts/bench_agentic.py --out x` or\n    smg launch --worker-urls grpc://127.0.0.1:1\n"
    assert len(bare_commands(planted)) == 2
    assert not bare_commands("`.venv/bin/python scripts/serve.py` and .venv/bin/smg launch --port 1; python is fine")
