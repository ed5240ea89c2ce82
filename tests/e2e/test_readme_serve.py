"""The README's "Serve it" commands, run as written: its three fenced blocks are the engine, the smg gateway and an
OpenAI SDK client. The first two run in the background until they are ready (grpc health SERVING; the model listed
on /v1/models), the third must exit 0 and print both answers; then both are stopped as a user would (Ctrl-C = SIGINT
to the engine's process group) and the engine exits 0.

Substitutions as ``tests/support/recipes.py`` makes them (free ports only when one is taken, the interpreter's
directory only without ``.venv``). Every socket the engine (its ranks included) and smg listen on is on loopback.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request

from tests.support.listeners import exposed, listeners
from tests.support.paths import REPO_ROOT
from tests.support.patience import patience
from tests.support.recipes import background, runnable, section_blocks, stop

ROOT = REPO_ROOT


def serve_it_blocks() -> list[str]:
    return section_blocks("README.md", "Serve it")


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
    (engine_cmd, gateway_cmd, client_cmd), used = runnable(blocks)
    documented = {"grpc": (r"server\.port=(\d+)", 0), "metrics": (r"server\.metrics_port=(\d+)", 0),
                  "http": (r" --port (\d+)", 1)}
    ports = {k: used[int(re.search(rx, blocks[i]).group(1))] for k, (rx, i) in documented.items()}
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
        assert listeners([engine.pid, gateway.pid]) and not exposed([engine.pid, gateway.pid]), \
            "\n".join(map(str, exposed([engine.pid, gateway.pid])))  # ranks, store, gloo, gRPC, metrics, smg
    finally:
        if gateway is not None:
            stop(gateway, signal.SIGKILL)  # smg's graceful stop waits a 5 s load-balancer window
        rc = stop(engine, signal.SIGINT)  # Ctrl-C in the engine's terminal
    log = (tmp_path / "engine.log").read_text()
    assert rc == 0, log[-3000:]
    # the two README calls and the long chat
    assert len(re.findall(r"request \S+ OK: prompt \d+ tokens, output \d+ tokens", log)) == 3, log[-3000:]
    assert "Traceback" not in log and "FutureWarning" not in log, log[-3000:]
