"""Helpers for the gRPC tests: a real ``scripts/serve.py`` subprocess on loopback, HF greedy references, and a tiny
tokenizer for the tiny checkpoints (which ship none).

Run as a script to give a checkpoint dir a tokenizer (for trying smg by hand):

    python tests/support/rpc_helpers.py SRC_CKPT_DIR DST_DIR      # copies SRC into DST and writes the tokenizer files
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.support.patience import patience

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from model.tiny import CHAT_TEMPLATE, write_char_tokenizer  # noqa: E402,F401 - after the path insert; CHAT_TEMPLATE for the tests
from parallelism.launch import free_port, free_ports  # noqa: E402,F401 - free_port for the tests


def with_tokenizer(src: str | Path, dst: str | Path) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with :func:`model.tiny.write_char_tokenizer`'s files."""
    dst = Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    write_char_tokenizer(dst)
    return dst


def hf_greedy(ckpt: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF transformers' greedy continuation (``n`` tokens, EOS banned like ``min_tokens=n``)."""
    import torch

    from model.tiny import load_hf

    hf = load_hf(ckpt)
    return [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


SMG = Path(sys.executable).parent / "smg"


@contextlib.contextmanager
def smg_gateway(worker_target: str | tuple[str, str], ckpt: str | Path, log_path: str | Path, *options: str,
                model: str | None = None) -> Iterator[str]:
    """``smg launch`` on 127.0.0.1 in front of the gRPC worker at ``worker_target`` (``host:port``; passthrough
    policy), or of a ``(prefill, decode)`` pair in PD mode, plus ``options``; yields its base URL once ``/v1/models``
    lists a model (``model``: that one, and ``/v1/tokenizers`` its tokenizer). Killed on exit (smg's graceful stop
    waits a 5 s load-balancer window)."""
    log_path, (port, prometheus_port) = Path(log_path), free_ports(2)
    workers = (["--pd-disaggregation", "--prefill", f"grpc://{worker_target[0]}", "--decode",
                f"grpc://{worker_target[1]}"] if isinstance(worker_target, tuple)
               else ["--worker-urls", f"grpc://{worker_target}", "--policy", "passthrough"])
    with open(log_path, "w") as log:
        smg = subprocess.Popen([str(SMG), "launch", *workers, "--model-path", str(ckpt), "--host", "127.0.0.1",
                                "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                str(prometheus_port), "--log-level", "warn", *options],
                               stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + patience(60)
        while True:
            assert smg.poll() is None, log_path.read_text()[-3000:]
            try:
                listed = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=2)).get("data", [])
                tokenizers = json.load(urllib.request.urlopen(f"{base}/v1/tokenizers", timeout=2)).get("tokenizers", [])
                if any(model is None or m["id"] == model for m in listed) and (
                        model is None or any(t["name"] == model for t in tokenizers)):
                    break  # a request for the served name before its tokenizer is registered gets a 503
            except OSError:
                pass
            assert time.monotonic() < deadline, "smg never listed the model:\n" + log_path.read_text()[-3000:]
            time.sleep(0.2)
        yield base
    finally:
        smg.kill()
        smg.wait()


def layout_args(world: int) -> list[str]:
    """A TP-attention / EP-experts layout of ``world`` ranks (``parallel=single`` for 1)."""
    if world == 1:
        return ["parallel=single"]
    return [f"parallel.world_size={world}", f"parallel.attn_tp={world}", "parallel.attn_dp=1",
            "parallel.moe_tp=1", f"parallel.moe_ep={world}"]


class ServerProcess:
    """``scripts/serve.py`` as a subprocess on 127.0.0.1, its ``/metrics`` on a free port (:attr:`metrics_url`); its
    log goes to ``log_path``. Ports are picked free, then bound by the server: another process (a gloo connection of
    the server's own ranks) can take one in between, so a server that could not bind a picked port is started again
    on fresh ports by :meth:`wait_ready` (twice at most); a port given by the caller is never changed."""

    RELAUNCHES = 2

    def __init__(self, ckpt: str, args: list[str], log_path: str | Path, port: int | None = None):
        self.ckpt, self.args, self.fixed_port = ckpt, args, port
        self.log_path = Path(log_path)
        self.relaunches = 0
        self._launch()

    def _launch(self) -> None:
        ports = free_ports(2)
        self.port, self.metrics_port = self.fixed_port or ports[0], ports[1]
        self.target = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"model.path={self.ckpt}", "server.host=127.0.0.1",
               f"server.port={self.port}", f"server.metrics_port={self.metrics_port}", *self.args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(self.log_path, "a" if self.relaunches else "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text()[-tail:]

    def wait_ready(self, timeout: float = 120.0):
        """A connected :class:`rpc.client.Client` once grpc health says SERVING."""
        from rpc.client import Client

        client = Client(self.target)
        timeout = patience(timeout)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                lost_a_port = "Address already in use" in self.log()
                if lost_a_port and self.fixed_port is None and self.relaunches < self.RELAUNCHES:
                    self.relaunches += 1
                    self._launch()
                    client = Client(self.target)
                    continue
                raise RuntimeError(f"server exited {self.proc.returncode} before SERVING:\n{self.log()}")
            try:
                client.wait_ready(timeout=1.0, poll_s=0.1)
                return client
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not SERVING after {timeout}s:\n{self.log()}") from None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        """Stops the server and every process it started (kills after 20 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(with_tokenizer(sys.argv[1], sys.argv[2]))
