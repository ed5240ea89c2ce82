"""A real ``mooncake_master`` on loopback for the shared-store tests (the wheel in the test extra ships it), with its
HTTP metadata server; metrics on a port of its own (the default 9003 on 0.0.0.0 would stop a second master)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.rpc_helpers import free_port


def master_binary() -> str:
    """The wheel's ``mooncake_master``; skipped when the wheel or ``libibverbs.so.1`` is missing — failed under
    ``CI=true``, where the Makefile installs both."""
    found = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
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


class MooncakeMaster:
    def __init__(self, log: Path):
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [master_binary(), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.rpc), timeout=0.5).close()
                socket.create_connection(("127.0.0.1", self.http), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master did not come up; see {log}") from None
                time.sleep(0.1)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def overrides(self, timeout_s: float = 1.0, gb: float = 0.25) -> dict:
        """The engine keys that point a worker at this master."""
        return dict(kv_store="mooncake", kv_store_master=self.address, kv_store_metadata=self.metadata,
                    kv_store_gb=gb, kv_store_timeout_s=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
