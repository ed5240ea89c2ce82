"""The op-level and interpreter row-invariance tests again, under the other CPU code paths of
:data:`bench.cpu_paths.CODE_PATHS` (one pytest process per path, both at once): a row's result must not depend on
what shares its launch on any of them. The engine's token tests (marked ``engine``) run on the native path only."""

import os
import subprocess
import sys

import pytest

from bench.cpu_paths import CODE_PATHS
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
ROW_TESTS = ("tests/model/test_fixed_math.py", "tests/e2e/test_batch_invariance.py",
             "tests/model/test_batch_invariance_triton.py", "tests/model/test_row_attention_triton.py")


@pytest.mark.timeout(900)  # two pytest processes on a loaded 2-core box: ~62 s quiet, minutes under load
def test_row_invariance_holds_under_every_cpu_code_path():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    runs = {name: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not engine",
                                    "-k", "not compile", *ROW_TESTS], cwd=ROOT, env={**env, **switches},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, switches in CODE_PATHS.items()}
    failed = {}
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            failed[name] = out[-4000:]
    assert not failed, "\n".join(f"--- code path {name} ({CODE_PATHS[name]}) ---\n{out}"
                                  for name, out in failed.items())
