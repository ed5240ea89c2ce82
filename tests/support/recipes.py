"""Documented multi-process recipes run as written: their fenced blocks read from a Markdown file, started in the
background, waited on and stopped as a user would.

Two substitutions, both for running beside other jobs, never of the commands' shape: a recipe's ports are replaced by
free ones only when one of them is taken on this machine, and ``.venv/bin/`` by this interpreter's directory only when
the checkout has no ``.venv`` (``make test`` creates it)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.paths import REPO_ROOT
from tests.support.rpc_helpers import free_ports

PORT_FLAGS = r"(?:port=| --port |-port |127\.0\.0\.1:)(\d+)"  # every port a recipe names


def section_blocks(doc: str, heading: str) -> list[str]:
    """The fenced blocks under ``heading`` (a ``## `` heading's text) of ``doc`` (a path under the repository)."""
    text = (REPO_ROOT / doc).read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```\n(.*?)^```$", section, flags=re.S | re.M)


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def runnable(commands: list[str]) -> tuple[list[str], dict[int, int]]:
    """``commands`` with their ports (only if one is taken) and the venv path (only if absent) substituted; returns
    them and the map from each documented port to the one used."""
    ports = sorted({int(p) for c in commands for p in re.findall(PORT_FLAGS, c)})
    used = dict(zip(ports, ports, strict=True))
    if not all(bindable(p) for p in ports):
        used = dict(zip(ports, free_ports(len(ports)), strict=True))
        for old, new in used.items():
            commands = [re.sub(rf"(?<=[=:\s]){old}\b", str(new), c) for c in commands]
    if not (REPO_ROOT / ".venv" / "bin" / "python").exists():
        commands = [c.replace(".venv/bin/", f"{Path(sys.executable).parent}/") for c in commands]
    return commands, used


def background(cmd: str, log: Path) -> subprocess.Popen:
    """``cmd`` in a shell of its own session (so Ctrl-C reaches its process group), output to ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        return subprocess.Popen(["bash", "-c", cmd], cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def stop(proc: subprocess.Popen, sig: int, timeout: float = 30) -> int | None:
    """Sends ``sig`` to ``proc``'s process group; SIGKILL if it has not ended within ``timeout``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    return proc.returncode


def wait_for_model(proc: subprocess.Popen, log: Path, http_port: int, model: str, timeout_s: float = 120) -> None:
    """Until the gateway on ``http_port`` lists ``model`` and its tokenizer; fails with the log's tail if ``proc``
    ends or the time runs out."""
    deadline = time.monotonic() + timeout_s
    base = f"http://127.0.0.1:{http_port}"
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=2))["data"]
            tokenizers = json.load(urllib.request.urlopen(f"{base}/v1/tokenizers", timeout=2)).get("tokenizers", [])
            if any(m["id"] == model for m in models) and any(t["name"] == model for t in tokenizers):
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def wait_for_worker(proc: subprocess.Popen, log: Path, grpc_port: int, timeout_s: float = 180) -> None:
    """Until the gRPC worker on ``grpc_port`` answers health SERVING."""
    from rpc.client import Client

    client = Client(f"127.0.0.1:{grpc_port}")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                client.wait_ready(timeout=1.0, poll_s=0.2)
                return
            except TimeoutError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
    finally:
        client.close()
