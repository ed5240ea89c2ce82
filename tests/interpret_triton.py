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
