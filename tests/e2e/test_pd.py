"""Prefill and decode on two workers behind real smg (``--pd-disaggregation``), the KV handed over by the Mooncake
transfer engine over loopback TCP: every request through the PD gateway — completions and chat, streaming and not,
greedy and seeded T=1 — answers bit for bit what the same request gets from an aggregated worker behind its own
gateway (``engine.batch_invariant=true``; tiny_kimi, MLA), the decode worker computes no prompt token but the last
(``switchyard:pd_prompt_tokens_recomputed_total`` stays 0) while it receives the prompts' blocks, a session's second
turn fetches only its new blocks, the prefill worker's leases are all released, and a DDTree pair answers the
aggregated worker's greedy tokens; a one-rank prefill worker and a DP2/EP2 decode worker are greedy-equal, the
received KV kept out of the decode worker's own prefix cache. Faults: a lease whose reader is killed mid-read
expires; a dead prefill worker fails only its outstanding hand-off, UNAVAILABLE and named, leaking no block on the
decode worker (or is recomputed when asked); a stalled one times out (``server.kv_transfer_timeout_s``) while the
decode worker serves on, and one killed during a read fails it at once; smg's retry of a timed-out decode leg streams
every token once; smg refuses a pair whose block sizes differ, as the workers report them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from bench.pd import pd_samples
from rpc.client import Client, generate_request
from tests.support.metrics_doc import assert_documented
from tests.support.mooncake import master_binary
from tests.support.paths import REPO_ROOT
from tests.support.recording_worker import RecordingWorker
from tests.support.rpc_helpers import ServerProcess, smg_gateway

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
MODEL = "tiny"
BASE = ["parallel=single", "model=tiny_kimi", "engine.batch_invariant=true", "engine.max_model_len=512",
        "engine.num_blocks=128", "engine.block_size=16", f"server.served_model_name={MODEL}"]
SMG_OPTIONS = ("--disable-retries", "--disable-circuit-breaker")
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"

pytestmark = pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(),
                                reason="the trained tiny_kimi pair is absent")


def _metrics(srv: ServerProcess) -> dict[str, float]:
    """The worker's ``switchyard:pd_*`` samples (``bench.pd.pd_samples``)."""
    return pd_samples(srv.metrics_url)


def _metrics_once(srv: ServerProcess, ready) -> dict[str, float]:
    """:func:`_metrics` once ``ready(samples)`` holds (the engine publishes its figures just after it hands a step's
    outputs on, so a client can be a moment ahead of them); the last samples after 10 s."""
    deadline = time.monotonic() + 10
    while not ready(m := _metrics(srv)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """(PD gateway, aggregated gateway, prefill, decode) of plain workers."""
    master_binary()  # the mooncake wheel and its library: skipped without them, failed under CI=true
    tmp = tmp_path_factory.mktemp("pd")
    servers = [ServerProcess(str(ZOO / "target"), [*BASE, f"server.kv_role={role}"], tmp / f"{role}.log")
               for role in ("prefill", "decode", "both")]
    try:
        for srv in servers:
            srv.wait_ready().close()
        prefill, decode, aggregated = servers
        with smg_gateway((prefill.target, decode.target), ZOO / "target", tmp / "smg_pd.log", *SMG_OPTIONS,
                         model=MODEL) as pd, \
                smg_gateway(aggregated.target, ZOO / "target", tmp / "smg.log", *SMG_OPTIONS, model=MODEL) as agg:
            yield pd, agg, prefill, decode
    finally:
        for srv in servers:
            srv.close()


def _completions(base: str, **kw) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps({"model": MODEL, **kw}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_every_request_through_pd_answers_what_an_aggregated_worker_does(gateways):
    from openai import OpenAI

    pd, agg, prefill, decode = gateways
    before = _metrics(decode)
    clients = [OpenAI(base_url=f"{b}/v1", api_key="none", max_retries=0) for b in (pd, agg)]
    asks = [dict(temperature=0.0), dict(temperature=1.0, seed=7)]
    for ask in asks:
        got = [c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **ask) for c in clients]
        assert got[0].choices[0].text == got[1].choices[0].text
        streamed = ["".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt=PROMPT + " ", max_tokens=12, stream=True, **ask) if ch.choices) for c in clients]
        assert streamed[0] == streamed[1]
        messages = [{"role": "user", "content": PROMPT}]
        chats = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True, **ask)
                 for c in clients]
        assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
        logprobs = [[t.logprob for t in c.choices[0].logprobs.content] for c in chats]
        assert logprobs[0] == logprobs[1] and len(logprobs[0]) == 10  # bit for bit
    after = _metrics_once(decode, lambda m: m["switchyard:pd_kv_blocks_received_total"] -
                          before["switchyard:pd_kv_blocks_received_total"] >= 3)
    assert after["switchyard:pd_prompt_tokens_recomputed_total"] == 0
    assert after["switchyard:pd_kv_blocks_received_total"] - before["switchyard:pd_kv_blocks_received_total"] >= 3
    assert not any(k.startswith("switchyard:pd_transfer_failures") for k in after)
    leases = _metrics(prefill)
    assert leases["switchyard:pd_leased_blocks"] == 0
    assert leases['switchyard:pd_leases_ended_total{how="released"}'] >= 6


def test_a_sessions_second_turn_fetches_only_its_new_blocks(gateways):
    pd, _, _, decode = gateways
    first = PROMPT * 3  # a session of its own (its blocks are new to both workers)
    _completions(pd, prompt=first, max_tokens=2, temperature=0.0)
    mid = _metrics(decode)["switchyard:pd_kv_blocks_received_total"]
    second = _completions(pd, prompt=first + "print(fibonacci(10))\n" * 3, max_tokens=2, temperature=0.0)
    end = _metrics(decode)
    new_blocks = end["switchyard:pd_kv_blocks_received_total"] - mid
    total = -(-second["usage"]["prompt_tokens"] // 16)
    assert 0 < new_blocks < total  # the first turn's full blocks were not fetched
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (total - new_blocks) * 16  # but reported
    assert end["switchyard:pd_prompt_tokens_recomputed_total"] == 0


def test_an_n_2_request_comes_without_a_hand_off_and_counts_as_recomputed(gateways):
    pd, agg, _, decode = gateways
    prompt = "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 2
    before = _metrics(decode)
    got = _completions(pd, prompt=prompt, max_tokens=4, n=2, temperature=1.0, seed=3)
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in _completions(
        agg, prompt=prompt, max_tokens=4, n=2, temperature=1.0, seed=3)["choices"]]
    after = _metrics_once(decode, lambda m: m["switchyard:pd_prompt_tokens_recomputed_total"] >
                          before["switchyard:pd_prompt_tokens_recomputed_total"])
    cached = (got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    recomputed = after["switchyard:pd_prompt_tokens_recomputed_total"] - \
        before["switchyard:pd_prompt_tokens_recomputed_total"]
    assert recomputed == got["usage"]["prompt_tokens"] - 1 - cached > 0  # smg relays no hand-off for n > 1
    assert after["switchyard:pd_kv_blocks_received_total"] == before["switchyard:pd_kv_blocks_received_total"]


def test_a_ddtree_pair_answers_the_aggregated_workers_greedy_tokens(gateways, tmp_path):
    _, agg, _, _ = gateways
    ddtree = [*BASE, "spec_decode=ddtree"]
    servers = [ServerProcess(str(ZOO / "target"), [*ddtree, f"server.kv_role={role}"], tmp_path / f"{role}.log")
               for role in ("prefill", "decode")]
    try:
        for srv in servers:
            srv.wait_ready().close()
        with smg_gateway((servers[0].target, servers[1].target), ZOO / "target", tmp_path / "smg.log",
                         *SMG_OPTIONS, model=MODEL) as pd:
            for prompt in (PROMPT, PROMPT * 2):
                want = _completions(agg, prompt=prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]
                assert _completions(pd, prompt=prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"] == want
        m = _metrics(servers[1])
        assert m["switchyard:pd_kv_blocks_received_total"] > 0 and not any("failures" in k for k in m)
    finally:
        for srv in servers:
            srv.close()


def _prefill_leg(client, prompt: list[int], rid: str) -> str:
    """What smg sends a prefill worker; returns the hand-off JSON its Complete carries."""
    req = generate_request(prompt, False, rid, max_tokens=1, temperature=0.0, ignore_eos=True)
    (complete,) = [r.complete for r in client.stub.Generate(req, timeout=60)]
    assert complete.kv_transfer_params_json
    return complete.kv_transfer_params_json


def _decode_leg(client, prompt: list[int], rid: str, blob: str) -> list[int]:
    req = generate_request(prompt, False, rid, max_tokens=8, temperature=0.0, ignore_eos=True)
    req.kv_transfer_params_json = blob
    return [list(r.complete.output_ids) for r in client.stub.Generate(req, timeout=60)][-1]


def test_a_lease_whose_reader_dies_expires_and_a_dead_prefill_fails_only_its_hand_off(gateways, tmp_path):
    """A prefill worker of its own (leases of 1.5 s): a decode side killed while it reads a lease
    (``tests/support/kv_reader.py``) leaves the lease to end by itself, and the prefill worker serves on; then it is
    killed with a hand-off outstanding — the decode worker ends that request UNAVAILABLE naming the cause,
    holds no block for it and serves on; a decode worker with ``server.kv_recompute_on_failure=true`` computes the
    prompt instead and answers the aggregated worker's tokens."""
    _, _, _, decode = gateways
    prefill = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=prefill", "server.kv_lease_s=1.5",
                                                   "server.heartbeat_s=0.3"], tmp_path / "prefill.log")
    lenient = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=decode",
                                                   "server.kv_recompute_on_failure=true"], tmp_path / "lenient.log")
    clients, reader = [], None
    try:
        p, lenient_client = prefill.wait_ready(), lenient.wait_ready()
        d = Client(decode.target)
        clients += [p, lenient_client, d]
        prompt = [(5 * k) % 140 + 3 for k in range(40)]
        reader = subprocess.Popen([sys.executable, "-m", "tests.support.kv_reader"], cwd=REPO_ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert reader.stdout.readline().strip() == "ready"
        reader.stdin.write(_prefill_leg(p, prompt, "forgotten") + "\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "reading"
        time.sleep(0.3)
        reader.kill()  # a decode side killed while it reads (batches back to back)
        reader.wait()
        assert _metrics(prefill)["switchyard:pd_leased_blocks"] == 3
        ok, why = p.flush_cache(timeout_s=0.0)
        assert not ok and "leases for decode workers hold 3 block(s)" in why
        deadline = time.monotonic() + 20
        while _metrics(prefill)['switchyard:pd_leases_ended_total{how="expired"}'] < 1:
            assert time.monotonic() < deadline, _metrics(prefill)
            time.sleep(0.2)
        assert _metrics(prefill)["switchyard:pd_leased_blocks"] == 0
        blob = _prefill_leg(p, prompt, "orphan")
        prefill.proc.kill()
        prefill.proc.wait()
        with pytest.raises(grpc.RpcError) as err:
            _decode_leg(d, prompt, "orphan", blob)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "KV hand-off unreachable" in err.value.details()
        assert d.engine_info()["kv"]["per_dp"][0]["blocks_used"] == 0
        assert _metrics(decode)['switchyard:pd_transfer_failures_total{reason="unreachable"}'] >= 1
        want = d.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids  # it serves on
        assert _decode_leg(lenient_client, prompt, "orphan", blob) == want
        assert _metrics(lenient)["switchyard:pd_prompt_tokens_recomputed_total"] == len(prompt) - 1
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
        for c in clients:
            c.close()
        prefill.close()
        lenient.close()


def _failed_decode_leg(client, prompt: list[int], rid: str, blob: str) -> tuple[grpc.RpcError, float]:
    """The decode leg's error and when it came (``time.monotonic``)."""
    with pytest.raises(grpc.RpcError) as err:
        _decode_leg(client, prompt, rid, blob)
    return err.value, time.monotonic()


def _used_blocks(client) -> int:
    return client.engine_info()["kv"]["per_dp"][0]["blocks_used"]


def _wait_for_used_blocks(client, n: int, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while _used_blocks(client) != n:
        assert time.monotonic() < deadline, f"{_used_blocks(client)} blocks used, not {n}"
        time.sleep(0.05)


def test_a_stalled_prefill_times_out_and_one_killed_during_a_read_fails_only_its_hand_off(tmp_path):
    """A decode worker (``server.kv_transfer_timeout_s=3``) reading from a prefill worker that stops answering
    (SIGSTOP, after one hand-off went through): the read gives up at the timeout, the request ends UNAVAILABLE naming
    it, while another request on the decode worker is answered meanwhile; then a prefill worker killed while a read
    from it is outstanding fails that hand-off at once, ``unreachable``. Each time the decode worker holds no block
    afterwards and serves on."""
    from concurrent.futures import ThreadPoolExecutor

    prefill = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=prefill"], tmp_path / "prefill.log")
    decode = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=decode", "server.kv_transfer_timeout_s=3"],
                           tmp_path / "decode.log")
    clients, pool = [], ThreadPoolExecutor(1)
    try:
        p, d = clients[:] = [srv.wait_ready() for srv in (prefill, decode)]
        prompt, other = [(7 * k) % 140 + 3 for k in range(60)], [(11 * k) % 140 + 3 for k in range(30)]
        assert _decode_leg(d, prompt, "warm", _prefill_leg(p, prompt, "warm"))  # the two endpoints know each other
        blob = _prefill_leg(p, prompt, "stalled")
        prefill.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        failing = pool.submit(_failed_decode_leg, d, prompt, "stalled", blob)
        _wait_for_used_blocks(d, 4)  # admitted, its blocks reserved, waiting for the read
        assert len(d.generate(other, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids) == 8
        answered = time.monotonic()
        err, failed_at = failing.result(timeout=30)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "KV hand-off timeout" in err.details()
        assert answered < failed_at and 3 <= failed_at - t0 < 10
        assert _used_blocks(d) == 0
        prefill.proc.send_signal(signal.SIGCONT)
        blob = _prefill_leg(p, prompt, "killed")
        prefill.proc.send_signal(signal.SIGSTOP)
        failing = pool.submit(_failed_decode_leg, d, prompt, "killed", blob)
        _wait_for_used_blocks(d, 4)
        time.sleep(0.2)  # the read is under way
        prefill.proc.kill()
        killed = time.monotonic()
        prefill.proc.wait()
        err, failed_at = failing.result(timeout=30)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "KV hand-off unreachable" in err.details()
        assert failed_at - killed < 2  # the kill ended it, not the timeout
        assert _used_blocks(d) == 0
        assert len(d.generate(other, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids) == 8
        m = _metrics(decode)
        assert m['switchyard:pd_transfer_failures_total{reason="timeout"}'] == 1
        assert m['switchyard:pd_transfer_failures_total{reason="unreachable"}'] == 1
    finally:
        pool.shutdown(wait=False)
        for c in clients:
            c.close()
        if prefill.proc.poll() is None:
            prefill.proc.send_signal(signal.SIGCONT)
        for srv in (prefill, decode):
            srv.close()


def test_smg_retries_a_decode_leg_whose_read_timed_out_and_the_stream_has_every_token_once(gateways, tmp_path):
    """smg with its retries on, in front of a prefill worker and (through a recording proxy) a decode worker with
    ``server.kv_transfer_timeout_s=2``: when the first decode leg arrives the prefill worker is stopped for 2.5 s, so
    that leg's read times out (UNAVAILABLE); smg runs the prefill again and a second decode leg, whose hand-off is
    read. The client's stream holds the aggregated worker's tokens exactly once (a decode leg fails only before its
    first token: the read comes first), and both leases end released."""
    _, agg, _, _ = gateways
    prefill = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=prefill"], tmp_path / "prefill.log")
    decode = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=decode", "server.kv_transfer_timeout_s=2"],
                           tmp_path / "decode.log")
    proxy, timers = None, []

    def stall_the_prefill_once(req) -> None:
        if req.kv_transfer_params_json and not timers:
            prefill.proc.send_signal(signal.SIGSTOP)
            timers.append(threading.Timer(2.5, prefill.proc.send_signal, (signal.SIGCONT,)))
            timers[0].start()

    try:
        for srv in (prefill, decode):
            srv.wait_ready().close()
        proxy = RecordingWorker(decode.target)
        proxy.on_generate = stall_the_prefill_once
        want = _completions(agg, prompt=PROMPT, max_tokens=16, temperature=0.0)["choices"][0]["text"]
        with smg_gateway((prefill.target, proxy.target), ZOO / "target", tmp_path / "smg.log",
                         "--disable-circuit-breaker", model=MODEL) as pd:
            req = urllib.request.Request(f"{pd}/v1/completions", json.dumps(
                {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "stream": True}).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: {")]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events if json.loads(e)["choices"]) == want
        legs = [json.loads(r.kv_transfer_params_json)["lease"] for r in proxy.requests]
        assert len(legs) == 2 and len(set(legs)) == 2  # the retry read a fresh lease of the re-run prefill
        m = _metrics(decode)
        assert m['switchyard:pd_transfer_failures_total{reason="timeout"}'] == 1
        assert m["switchyard:pd_prompt_tokens_recomputed_total"] == 0
        leases = _metrics_once(prefill, lambda m: m['switchyard:pd_leases_ended_total{how="released"}'] == 2)
        assert leases["switchyard:pd_leased_blocks"] == 0  # the unread lease too (smg's Abort after the failure)
        assert leases['switchyard:pd_leases_ended_total{how="released"}'] == 2
    finally:
        for t in timers:
            t.join()
        if proxy is not None:
            proxy.close()
        for srv in (prefill, decode):
            srv.close()


def test_a_two_rank_pair_hands_each_attention_tp_rank_its_shard(gateways, tmp_path):
    """Prefill and decode workers of two ranks each (attention TP2, experts EP2): each decode rank reads the
    prefill's rank of its own TP place; the decode leg answers what the decode worker then computes cold. MLA's
    latent is the same on both TP ranks, so the module's one-rank decode worker takes the TP2 prefill's hand-off too
    (reading shard 0) and answers the same greedy tokens."""
    tp2 = [*BASE, "parallel.world_size=2", "parallel.attn_tp=2", "parallel.attn_dp=1", "parallel.moe_tp=1",
           "parallel.moe_ep=2"]
    servers = [ServerProcess(str(ZOO / "target"), [*tp2, f"server.kv_role={role}"], tmp_path / f"{role}.log")
               for role in ("prefill", "decode")]
    clients = []
    try:
        p, d = clients[:] = [srv.wait_ready() for srv in servers]
        prompt = [(3 * k) % 150 + 3 for k in range(50)]
        blob = _prefill_leg(p, prompt, "tp2")
        assert len(json.loads(blob)["shards"]) == 2
        handed = _decode_leg(d, prompt, "tp2", blob)
        # before its own run below, which (no hand-off) counts as recomputed
        m = _metrics_once(servers[1], lambda m: m["switchyard:pd_kv_blocks_received_total"] > 0)
        assert m["switchyard:pd_kv_blocks_received_total"] == 4
        assert m["switchyard:pd_prompt_tokens_recomputed_total"] == 0
        assert d.flush_cache()[0]  # the received blocks leave its prefix cache: the next run computes everything
        own = d.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert handed == own.token_ids and own.cached_tokens == 0
        with Client(gateways[3].target) as single:
            assert _decode_leg(single, prompt, "tp2-to-1", _prefill_leg(p, prompt, "tp2-to-1")) == handed
    finally:
        for c in clients:
            c.close()
        for srv in servers:
            srv.close()


def test_a_mixed_pair_is_greedy_equal_and_keeps_the_received_kv_out_of_its_own_prefix_cache(gateways, tmp_path):
    """The module's one-rank prefill worker behind smg with a decode worker of two ranks (attention DP2, experts
    EP2; MLA: each DP rank reads the whole latent): the same greedy tokens as the aggregated worker, no prompt token
    recomputed. The received blocks are indexed apart (another layout's numerics): a second hand-off of the prompt
    fetches only its last block, while the decode worker's own run of it hits nothing and answers the same tokens."""
    _, agg, prefill, _ = gateways
    dp2 = [*BASE, "parallel.world_size=2", "parallel.attn_tp=1", "parallel.attn_dp=2", "parallel.moe_tp=1",
           "parallel.moe_ep=2", "server.kv_role=decode"]
    decode = ServerProcess(str(ZOO / "target"), dp2, tmp_path / "decode.log")
    try:
        decode.wait_ready().close()
        with smg_gateway((prefill.target, decode.target), ZOO / "target", tmp_path / "smg.log", *SMG_OPTIONS,
                         model=MODEL) as pd:
            prompt = PROMPT * 2
            want = _completions(agg, prompt=prompt, max_tokens=16, temperature=0.0)
            assert _completions(pd, prompt=prompt, max_tokens=16, temperature=0.0)["choices"] == want["choices"]
            first = _metrics_once(decode, lambda m: m["switchyard:pd_kv_blocks_received_total"] > 0)
            assert first["switchyard:pd_kv_blocks_received_total"] == -(-want["usage"]["prompt_tokens"] // 16)
            assert _completions(pd, prompt=prompt, max_tokens=16, temperature=0.0)["choices"] == want["choices"]
            again = _metrics_once(decode, lambda m: m["switchyard:pd_kv_blocks_received_total"] >
                                  first["switchyard:pd_kv_blocks_received_total"])
            assert again["switchyard:pd_kv_blocks_received_total"] - first[
                "switchyard:pd_kv_blocks_received_total"] == 1
            assert again["switchyard:pd_prompt_tokens_recomputed_total"] == 0
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ZOO / "target")
        ids = tok.encode(prompt, add_special_tokens=False)
        assert len(ids) == want["usage"]["prompt_tokens"]  # what smg sent
        with Client(decode.target) as d:
            own = d.generate(ids, max_tokens=16, temperature=0.0)
        assert own.cached_tokens == 0 and tok.decode(own.token_ids) == want["choices"][0]["text"]
    finally:
        decode.close()


def test_smg_refuses_a_pair_whose_block_sizes_differ_before_any_request_runs(gateways, tmp_path):
    """What this worker reports in GetServerInfo is what smg pairs by: a decode worker with 32-token blocks behind
    the module's 16-token prefill worker gets every request refused (503 ``no_compatible_pd_pair``), and neither
    worker runs one."""
    _, _, prefill, _ = gateways
    other = ServerProcess(str(ZOO / "target"), [*BASE, "server.kv_role=decode", "engine.block_size=32"],
                          tmp_path / "decode.log")
    try:
        other.wait_ready().close()
        served = prefill.log_path.read_text().count("[rpc.requests]")  # one line per request it ended
        with smg_gateway((prefill.target, other.target), ZOO / "target", tmp_path / "smg.log", *SMG_OPTIONS,
                         model=MODEL) as pd:
            with pytest.raises(urllib.error.HTTPError) as err:
                _completions(pd, prompt=PROMPT, max_tokens=4, temperature=0.0)
            assert err.value.code == 503 and "no_compatible_pd_pair" in err.value.read().decode()
        assert prefill.log_path.read_text().count("[rpc.requests]") == served
        assert "[rpc.requests]" not in other.log(100_000)
    finally:
        other.close()


def test_unread_leases_give_their_blocks_back_when_a_small_prefill_pool_runs_short(tmp_path):
    """``n > 1`` through smg: the decode leg computes the prompt itself and nobody reads the prefill's lease. A
    prefill pool of 24 blocks holds two such 9-block leases; the third request and those after it are answered at
    once (``kv_lease_s`` is 120 s) because the oldest unread leases end first, counted as ``reclaimed``."""
    master_binary()
    small = [*BASE[:-2], "engine.num_blocks=24", "engine.max_model_len=384", f"server.served_model_name={MODEL}",
             "server.kv_lease_s=120"]
    servers = [ServerProcess(str(ZOO / "target"), [*small, f"server.kv_role={role}"], tmp_path / f"{role}.log")
               for role in ("prefill", "decode")]
    try:
        for srv in servers:
            srv.wait_ready().close()
        prefill, decode = servers
        with smg_gateway((prefill.target, decode.target), ZOO / "target", tmp_path / "smg.log", *SMG_OPTIONS,
                         model=MODEL) as pd:
            started = time.monotonic()
            for i in range(6):  # distinct 130-token prompts: 9 blocks each, none shared (their first token differs)
                got = _completions(pd, prompt=f"# request {i}\n" + PROMPT * 3, max_tokens=2, n=2, temperature=1.0,
                                   seed=i)
                assert len(got["choices"]) == 2
            assert time.monotonic() - started < 60  # no request waited for a lease to expire
            m = _metrics_once(prefill, lambda m: m.get('switchyard:pd_leases_ended_total{how="reclaimed"}', 0) >= 3)
            assert m['switchyard:pd_leases_ended_total{how="reclaimed"}'] >= 3
            assert m["switchyard:pd_leased_blocks"] <= 24
            assert m.get('switchyard:pd_leases_ended_total{how="expired"}', 0) == 0
            for srv in servers:  # every PD series and label value on both roles' pages is in docs/metrics.md
                with urllib.request.urlopen(srv.metrics_url, timeout=10) as page:
                    assert_documented(page.read().decode())
    finally:
        for srv in servers:
            srv.close()
