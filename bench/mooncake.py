"""A ``mooncake_master`` on loopback (the wheel in the test extra ships it) and an HTTP metadata server beside it, for
the shared-store tests and the agentic benchmark; metrics on a port of its own (the default 0.0.0.0:9003 would stop
a second master). The master's own metadata server (``--enable_http_metadata_server``) listens on every interface
whatever ``--http_metadata_server_host`` says (mooncake 0.3.13), so the wheel's standalone
``mooncake_http_metadata_server --host 127.0.0.1`` serves the metadata instead."""

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
    def __init__(self, binary: str, log: Path, ports: tuple[int, int, int] | None = None):
        """``ports``: RPC, metadata and metrics ports (default: free ones)."""
        self.rpc, self.http, self.metrics = ports or free_ports(3)
        out = open(log, "w")
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}"], stdout=out, stderr=subprocess.STDOUT)
        self.metadata_proc = subprocess.Popen(
            [str(Path(binary).parent / "mooncake_http_metadata_server"), "--host", "127.0.0.1", "--port",
             str(self.http), "--log-level", "WARNING"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.rpc), timeout=0.5).close()
                socket.create_connection(("127.0.0.1", self.http), timeout=0.5).close()
                break
            except OSError:
                dead = self.proc.poll() is not None or self.metadata_proc.poll() is not None
                if dead or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"mooncake_master did not come up; see {log}") from None
                time.sleep(0.1)

    @property
    def pids(self) -> list[int]:
        """The master's and the metadata server's processes."""
        return [self.proc.pid, self.metadata_proc.pid]

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
        for proc in (self.proc, self.metadata_proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
