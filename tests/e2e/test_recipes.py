"""Every documented multi-process recipe listens on loopback only: the README's agent and prefill/decode recipes and
the shared store's (``docs/kv_cache.md``) run as written, answer one request under the model id the docs state, and
no process of theirs (the workers, their ranks, smg, the Mooncake master and metadata server) holds a socket open on
another interface. The README's "Serve it" is checked the same way in ``test_readme_serve.py``; a socket planted on
every interface is caught.

One named exception, :data:`MOONCAKE_TRANSFER_ENGINE`: the Mooncake transfer engine (0.3.13) that a prefill/decode
worker or a shared-store client starts listens for its handshake and its TCP transport on every interface, whatever
address it is given (``MC_TCP_BIND_ADDRESS`` and ``MC_LEGACY_RPC_PORT_BINDING`` change nothing); its ports fall in the
engine's RPC range.
``docs/serving.md`` ("What listens where") says how to fence it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.listeners import Listener, exposed, listeners
from tests.support.recipes import background, runnable, section_blocks, stop, wait_for_model, wait_for_worker
from tests.support.rpc_helpers import SMG

pytestmark = pytest.mark.skipif(not SMG.exists(), reason="smg is not installed (the test extra)")


def _start(commands: list[str], tmp: Path, first: int = 0) -> tuple[list[subprocess.Popen], list[Path]]:
    logs = [tmp / f"{first + i}.log" for i in range(len(commands))]
    return [background(c, log) for c, log in zip(commands, logs, strict=True)], logs


def _ask(http_port: int, model: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "def add(a, b):"}])
    assert chat.choices[0].finish_reason in ("stop", "length"), chat
    return chat.choices[0].message.content or ""


MOONCAKE_TRANSFER_ENGINE = range(15000, 17001)  # MC_MIN_RPC_PORT .. MC_MAX_RPC_PORT: handshake and TCP transport


def _not_excepted(found: list[Listener], transfer_engine: bool) -> list[Listener]:
    """``found`` less the named exception (in a worker that starts a transfer engine, ``transfer_engine``)."""
    return [x for x in found if not (transfer_engine and "scripts/serve.py" in x.command
                                      and x.port in MOONCAKE_TRANSFER_ENGINE)]


def _check_and_stop(procs: list[subprocess.Popen], transfer_engine: bool = False) -> None:
    try:
        found = listeners([p.pid for p in procs])
        assert found, "no listener seen: the /proc walk is broken"
        wide = _not_excepted(exposed([p.pid for p in procs]), transfer_engine)
        assert not wide, "\n".join(map(str, wide))
    finally:
        for p in reversed(procs):
            stop(p, signal.SIGKILL if "smg" in " ".join(map(str, p.args)) else signal.SIGINT)


@pytest.mark.parametrize("section,workers", [("Agents: Kimi tool calls through smg", 1),
                                             ("Prefill and decode on two workers", 2)])
def test_readme_recipe_answers_under_target_and_listens_on_loopback_only(tmp_path, section, workers):
    (block,) = section_blocks("README.md", section)
    commands = block.strip().splitlines()
    assert len(commands) == workers + 1 and "smg launch" in commands[-1]
    assert "--prometheus-host 127.0.0.1" in commands[-1], "smg's metrics would listen on 0.0.0.0"
    runs, ports = runnable(commands)
    procs, logs = _start(runs[:workers], tmp_path)
    try:
        for proc, log, cmd in zip(procs, logs, commands, strict=False):
            wait_for_worker(proc, log, ports[int(cmd.split("server.port=")[1].split()[0])])
        gateway, gateway_logs = _start(runs[workers:], tmp_path, first=workers)
        procs += gateway
        http = ports[int(commands[-1].split(" --port ")[1].split()[0])]
        wait_for_model(gateway[0], gateway_logs[0], http, "target")
        assert isinstance(_ask(http, "target"), str)
    finally:
        _check_and_stop(procs, transfer_engine="kv_role" in block)


def test_the_shared_store_recipe_listens_on_loopback_only(tmp_path):
    from rpc.client import Client

    pytest.importorskip("mooncake.store", reason="the mooncake wheel does not load (make sysdeps)")
    (block,) = section_blocks("docs/kv_cache.md", "The shared store")
    commands = block.strip().splitlines()
    assert [c.split()[0].rsplit("/", 1)[1] for c in commands] == ["mooncake_master", "mooncake_http_metadata_server",
                                                                   "python"]
    runs, ports = runnable(commands)
    procs, logs = _start(runs, tmp_path)
    try:
        grpc = ports[int(commands[2].split("server.port=")[1].split()[0])]
        wait_for_worker(procs[2], logs[2], grpc)
        with Client(f"127.0.0.1:{grpc}") as client:  # a put and a lookup: the store's client and transfer engine
            done = client.generate(list(range(5, 45)), max_tokens=2, temperature=0.0)
        assert len(done.token_ids) == 2
    finally:
        _check_and_stop(procs, transfer_engine=True)


def test_a_socket_on_every_interface_is_caught():
    """The check itself: a child that listens on 0.0.0.0 is reported, its loopback socket is not."""
    code = ("import socket, sys, time\n"
            "a = socket.socket(); a.bind(('0.0.0.0', 0)); a.listen()\n"
            "b = socket.socket(); b.bind(('127.0.0.1', 0)); b.listen()\n"
            "print(a.getsockname()[1], b.getsockname()[1], flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        wide, narrow = (int(p) for p in child.stdout.readline().split())
        assert [x.port for x in exposed([child.pid])] == [wide]
        assert {x.port for x in listeners([child.pid])} == {wide, narrow}
    finally:
        child.kill()
        child.wait()
