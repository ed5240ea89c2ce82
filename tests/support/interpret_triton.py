"""Triton kernels on a CPU box run under Triton's interpreter. A kernel test module imports this before triton
(``import interpret_triton`` sorts first; it sets ``TRITON_INTERPRET=1``), calls :func:`require` and takes its
kernel modules from :func:`module`.

Importing it also replaces the interpreter's ``tl.dot`` with :func:`fixed_order_dot`: the stock one is a numpy
matmul, i.e. the host's BLAS, whose micro-kernels (chosen per CPU at run time: OpenBLAS's ``Haswell``, ``Zen``,
``SkylakeX`` …) may round a row differently by where it sits in the tile. A row-invariance test would then check
the host's BLAS, not the kernel's tiling and K walk — the property the GPU kernels must have."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel

import importlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tests.support.paths import REPO_ROOT


def fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``tl.dot(a, b, d)`` = ``a @ b + d`` with every product rounded in the accumulator's dtype and summed over K
    in index order (``np.add.accumulate``: sequential by definition), whatever the CPU: entry ``[m, n]`` depends on
    row m of ``a``, column n of ``b`` and K alone — not on the tile's other rows, nor the host's vector width.
    A kernel whose K tiling or split-K follows the launch's row count still rounds differently (and fails)."""
    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
       (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # fp8 operands as the stock interpreter widens them
        a_data = interpreter._convert_float(a_data, a.dtype, triton.language.float16, None).view(np.float16)
        b_data = interpreter._convert_float(b_data, b.dtype, triton.language.float16, None).view(np.float16)
    acc = d.data.dtype
    products = a_data.astype(acc)[..., :, :, None] * b_data.astype(acc)[..., None, :, :]  # [..., M, K, N]
    total = np.add.accumulate(products, axis=-2)[..., -1, :]  # [..., M, N]
    return interpreter.TensorHandle(total + d.data, d.dtype.scalar)


interpreter.InterpreterBuilder.create_dot = fixed_order_dot


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

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend, so there is no compiler to run")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, text=True, capture_output=True,
                          cwd=REPO_ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]
