"""The quantized tiny checkpoints as tests use them, written by the shipped script (not by engine code)."""

import importlib.util
from pathlib import Path

from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "make_quant_checkpoints.py"


def script():
    spec = importlib.util.spec_from_file_location("make_quant_checkpoints", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_all(root: Path) -> dict[str, tuple[str, str]]:
    mod = script()
    return {name: tuple(str(d) for d in mod.write_preset(name, root)) for name in mod.PRESETS}
