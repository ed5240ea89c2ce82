"""The README's "Serve it" commands, run as written: its three fenced blocks are the engine, the smg gateway and an
OpenAI SDK client. The first two run in the background until they are ready (grpc health SERVING; the model listed
on /v1/models), the third must exit 0 and print both answers; then both are stopped as a user would (Ctrl-C = SIGINT
to the engine's process group) and the engine exits 0.

Two substitutions, both for running beside other jobs, never of the commands' shape: the README's ports are
replaced by free ones only when one of them is taken on this machine, and ``.venv/bin/`` by this interpreter's
directory only when the checkout has no ``.venv`` (``make test`` creates it)."""

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
from tests.support.patience import patience
from tests.support.rpc_helpers import free_port

ROOT = REPO_ROOT


def serve_it_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Serve it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```\n(.*?)^```$", section, flags=re.S | re.M)


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def runnable(blocks: list[str]) -> tuple[list[str], dict[str, int]]:
    """The blocks with ports (only if taken) and the venv path (only if absent) substituted; the ports in use."""
    grpc_port = int(re.search(r"server\.port=(\d+)", blocks[0]).group(1))
    metrics_port = int(re.search(r"server\.metrics_port=(\d+)", blocks[0]).group(1))
    http_port = int(re.search(r" --port (\d+)", blocks[1]).group(1))
    prom_port = int(re.search(r"--prometheus-port (\d+)", blocks[1]).group(1))
    ports = {"grpc": grpc_port, "metrics": metrics_port, "http": http_port, "prometheus": prom_port}
    if not all(bindable(p) for p in ports.values()):
        new = {k: free_port() for k in ports}
        for k in ports:
            blocks = [re.sub(rf"(?<=[=:\s]){ports[k]}\b", str(new[k]), b) for b in blocks]
        ports = new
    if not (ROOT / ".venv" / "bin" / "python").exists():
        blocks = [b.replace(".venv/bin/", f"{Path(sys.executable).parent}/") for b in blocks]
    return blocks, ports


def background(cmd: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        return subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def stop(proc: subprocess.Popen, sig: int, timeout: float = 30) -> int | None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    return proc.returncode


def long_chat(port: int) -> int:
    """A chat whose history is about 900 tokens, through the gateway; returns the prompt tokens it reported."""
    from openai import OpenAI

    from model.tokenizer import load_tokenizer

    tok = load_tokenizer(ROOT / "model" / "zoo" / "tiny_kimi" / "target")
    code = (ROOT / "model" / "tiny_tiktoken_corpus.txt").read_text()  # frozen: the answer does not move with the code
    turns, used = [], 0
    for piece in code.split("\n\n"):
        n = len(tok.encode(piece))
        if used + n > 920:
            continue
        turns.append({"role": "user" if len(turns) % 2 == 0 else "assistant", "content": piece})
        used += n
    if turns[-1]["role"] == "assistant":
        turns.append({"role": "user", "content": "def"})
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    chat = client.chat.completions.create(model="target", max_tokens=32, temperature=0, messages=turns)
    assert chat.choices[0].finish_reason in ("stop", "length"), chat
    return chat.usage.prompt_tokens


def test_readme_serve_it(tmp_path):
    from rpc.client import Client

    blocks = serve_it_blocks()
    assert len(blocks) == 3, f"expected 3 fenced blocks under '## Serve it', found {len(blocks)}"
    assert all("127.0.0.1" in b for b in blocks), "every Serve-it address must be loopback"
    (engine_cmd, gateway_cmd, client_cmd), ports = runnable(blocks)
    engine = background(engine_cmd, tmp_path / "engine.log")
    gateway = None
    try:
        client = Client(f"127.0.0.1:{ports['grpc']}")
        deadline = time.monotonic() + 180
        while True:
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            try:
                client.wait_ready(timeout=1.0, poll_s=0.2)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, (tmp_path / "engine.log").read_text()[-3000:]
        client.close()
        gateway = background(gateway_cmd, tmp_path / "smg.log")
        deadline = time.monotonic() + 120
        while True:
            assert gateway.poll() is None, (tmp_path / "smg.log").read_text()[-3000:]
            try:
                url = f"http://127.0.0.1:{ports['http']}/v1/models"
                if any(m["id"] == "target" for m in json.load(urllib.request.urlopen(url, timeout=2))["data"]):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "smg.log").read_text()[-3000:]
            time.sleep(0.5)
        out = subprocess.run(["bash", "-c", client_cmd], cwd=ROOT, capture_output=True, text=True,
                             timeout=patience(180))
        assert out.returncode == 0, out.stderr[-3000:]
        assert "CompletionUsage(" in out.stdout and out.stdout.strip(), out.stdout
        assert long_chat(ports["http"]) > 900  # the context is the model's (1024), not a smaller default
        page = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
        ended = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                    if line.startswith("vllm:request_success_total{"))
        assert ended == 3, page[-3000:]  # the two README calls and the long chat, on /metrics too
    finally:
        if gateway is not None:
            stop(gateway, signal.SIGKILL)  # smg's graceful stop waits a 5 s load-balancer window
        rc = stop(engine, signal.SIGINT)  # Ctrl-C in the engine's terminal
    log = (tmp_path / "engine.log").read_text()
    assert rc == 0, log[-3000:]
    # the two README calls and the long chat
    assert len(re.findall(r"request \S+ OK: prompt \d+ tokens, output \d+ tokens", log)) == 3, log[-3000:]
    assert "Traceback" not in log and "FutureWarning" not in log, log[-3000:]
