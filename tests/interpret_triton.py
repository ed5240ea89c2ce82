"""Triton kernels on a CPU box run under Triton's interpreter. A kernel test module imports this before triton
(``import interpret_triton`` sorts first; it sets ``TRITON_INTERPRET=1``), calls :func:`require` and takes its
kernel modules from :func:`module`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel

import importlib  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402


def require() -> None:
    """Skips the calling module when ``TRITON_INTERPRET`` is set to a false value."""
    if not triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is set to a false value: these kernels need the interpreter on a CPU box",
                    allow_module_level=True)


def module(module_name: str):
    """The kernel module with interpreted kernels (reloaded if something imported it before the env var)."""
    from triton.runtime.interpreter import InterpretedFunction

    loaded = importlib.import_module(module_name)
    jitted = [v for v in vars(loaded).values() if hasattr(v, "arg_names")]
    return loaded if all(isinstance(v, InterpretedFunction) for v in jitted) else importlib.reload(loaded)


def compile_rows(script: str) -> list[dict]:
    """Runs ``script`` (Python that prints one JSON row per compiled kernel) with the real compiler, outside the
    interpreter, from the repository root; skips where this triton build has no NVIDIA backend."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend, so there is no compiler to run")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, text=True, capture_output=True,
                          cwd=Path(__file__).parents[1], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]
