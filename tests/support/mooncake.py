"""The shared-store tests' ``mooncake_master`` (``bench/mooncake.py``): skipped when the wheel or its library is
missing, failed under ``CI=true``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.mooncake import MooncakeMaster, installed_master


def master_binary() -> str:
    """The wheel's ``mooncake_master``; skipped when the wheel or ``libibverbs.so.1`` is missing — failed under
    ``CI=true``, where the Makefile installs both."""
    found = installed_master()
    why = None
    if found is None:
        why = "mooncake_master is not installed (pip install the test extra)"
    else:
        try:
            import mooncake.store  # noqa: F401 - needs libibverbs.so.1
        except ImportError as e:
            why = f"the mooncake wheel does not load ({e}); apt-get install libibverbs1 (make sysdeps)"
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found


def start_master(log: Path, ports: tuple[int, int, int] | None = None) -> MooncakeMaster:
    return MooncakeMaster(master_binary(), log, ports)
