"""A ``mooncake_master`` on loopback (the wheel in the test extra ships it) with its HTTP metadata server, for the
shared-store tests and the agentic benchmark; metrics on a port of its own (the default 0.0.0.0:9003 would stop a
second master)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from parallelism.launch import free_ports


def installed_master() -> str | None:
    """The ``mooncake_master`` next to this interpreter, or None."""
    return shutil.which("mooncake_master", path=str(Path(sys.executable).parent))


class MooncakeMaster:
    def __init__(self, binary: str, log: Path):
        self.rpc, self.http, self.metrics = free_ports(3)
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
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
