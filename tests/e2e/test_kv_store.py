"""The shared KV store (``engine.kv_store=mooncake``) against a real ``mooncake_master`` on loopback: a prompt one
worker process computed hits on a second worker process through the store and decodes the cold run's tokens and
log-probs bit for bit (``engine.batch_invariant=true``; plain and DDTree), counted on the store tier; a block whose
bytes were changed in the store fails its checksum and the request computes the tokens instead; under attention TP 2 ×
DP 4 a prefix computed on one DP rank hits on another (MLA's latent written once per block, by TP rank 0); with the
master killed mid-stream every request completes and later lookups give up within ``engine.kv_store_timeout_s``.
"""

import json
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.loop import make_runner, worker_loop
from model.loader import load_model
from parallelism.comm import build_groups
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation
from tests.support.layouts import layout
from tests.support.mooncake import start_master
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, block_size=16, num_blocks=24,
            static_steps="on", batch_invariant=True)
pytestmark = pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(),
                                reason="the trained tiny_kimi pair is absent")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = start_master(tmp_path_factory.mktemp("mooncake") / "master.log")
    yield m
    m.kill()


def _prompt() -> list[int]:
    return json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][0]["ids"][:70]  # 4 full blocks + 6


def _run(engine: Engine, rid: str, prompt: list[int]) -> tuple[list, list, int]:
    engine.add_request(rid, prompt, GREEDY)
    tokens, lps, cached = [], [], 0
    while engine.has_work():
        for o in engine.step():
            tokens, lps, cached = tokens + o.new_tokens, lps + o.new_logprobs, o.num_cached_tokens
    return tokens, lps, cached


def _engine(method: str, store: dict) -> Engine:
    model = load_model(ZOO / "target", build_groups(layout("single")), torch.bfloat16)
    spec = SpecConfig() if method == "none" else SpecConfig(method, budget=16, drafter_path=str(ZOO / "drafter"))
    return Engine(model, EngineConfig.flat(**BASE, **store), speculation=load_speculation(spec, model))


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the other worker never wrote {path.name}"
        time.sleep(0.05)


def _two_workers_job(ctx, store: dict, method: str, prompt: list[int], handshake: str, corrupt: bool):
    """Rank 0 is worker A: the cold run, then it waits until the store holds the prompt's blocks (puts run in the
    background) and — ``corrupt`` — flips a byte of the third block's value there. Rank 1 is worker B: the same
    prompt once A is done. Both stay up until B has read (a Mooncake client's share of the store leaves with it)."""
    if ctx.rank > 1:
        return None
    engine, d = _engine(method, store), Path(handshake)
    try:
        if ctx.rank == 0:
            cold = _run(engine, "cold", prompt)
            client, hashes = engine.runner.loads.store, engine.scheduler.kv.index.hashes(prompt)
            deadline = time.monotonic() + 30
            while client.held(hashes) < len(hashes):
                assert time.monotonic() < deadline, "the prompt's blocks never reached the store"
                time.sleep(0.05)
            if corrupt:  # what a bad disk or a bad copy would leave: the value's bytes changed, its digest not
                key = client.key(hashes[2])
                value = bytearray(client._call("read", lambda c: c.get(key)))
                value[100] ^= 0xFF
                assert client._call("corrupt", lambda c: c.upsert(key, bytes(value))) == 0
            (d / "written").touch()
            _wait_for(d / "read")
            return cold
        _wait_for(d / "written")
        prefilled = engine.stats.prefill_tokens
        warm = _run(engine, "warm", prompt)
        (d / "read").touch()
        counts, client = engine.scheduler.kv.store_counts, engine.runner.loads.store
        return warm, counts.hit_tokens, dict(client.errors), engine.transfers.failed_loads, \
            engine.stats.prefill_tokens - prefilled, engine.scheduler.blocks_in_use()
    finally:
        engine.shutdown()


@pytest.mark.engine
@pytest.mark.parametrize(("method", "corrupt"), [("none", False), ("ddtree", False), ("none", True)])
def test_a_prefix_written_by_one_worker_hits_on_another_through_the_store(pool, master, tmp_path, method, corrupt):
    prompt = _prompt()
    cold, (warm, hit_tokens, errors, failed_loads, prefilled, in_use), *_ = pool.run(
        _two_workers_job, master.overrides(), method, prompt, str(tmp_path), corrupt)
    assert warm[:2] == cold[:2]  # tokens and log-probs, bit for bit
    assert in_use == 0
    if corrupt:  # the load failed its checksum: nothing came from the store, every token was computed
        assert errors.get("checksum") == 1 and failed_loads == 1, errors
        assert warm[2] == 0 and prefilled == len(prompt)
    else:
        assert warm[2] == 64 and hit_tokens == 64, (warm[2], hit_tokens)  # the store tier served four blocks
        assert prefilled == len(prompt) - 64 and not errors and failed_loads == 0, errors


def _cross_dp_job(ctx, store: dict, prompt: list[int]):
    """tp2xdp4_ep8: the prompt on attention-DP rank 0, then (once its blocks are in the store) on rank 3, whose device
    pool never saw it. MLA's latent is the same on both TP ranks of a DP group, so only TP rank 0 writes it and both
    read it. Rank 0 returns both runs, the store tier's hit tokens and the failed loads."""
    model = load_model(ZOO / "target", ctx.groups(layout("tp2xdp4_ep8")), torch.bfloat16)
    cfg = EngineConfig.flat(**BASE, **store)
    if ctx.rank != 0:
        worker_loop(make_runner(model, cfg))
        return None
    engine = Engine(model, cfg)
    try:
        runs = []
        for rid, dp in (("first", 0), ("second", 3)):
            engine.add_request(rid, prompt, GREEDY, dp_rank=dp)
            tokens, lps, cached = [], [], 0
            while engine.has_work():
                for o in engine.step():
                    tokens, lps, cached = tokens + o.new_tokens, lps + o.new_logprobs, o.num_cached_tokens
            runs.append((tokens, lps, cached))
            client, hashes = engine.runner.loads.store, engine.scheduler.kv.index.hashes(prompt)
            deadline = time.monotonic() + 30
            while client.held(hashes) < len(hashes):
                assert time.monotonic() < deadline, "the prompt's blocks never reached the store"
                time.sleep(0.05)
        store = engine.runner.loads.store
        return runs, engine.scheduler.kv.store_counts.hit_tokens, engine.transfers.failed_loads, \
            [p.suffix for p in store.parts], store.puts
    finally:
        engine.shutdown()


@pytest.mark.engine
def test_a_prefix_computed_on_one_dp_rank_hits_on_another_through_the_store(pool, master):
    prompt = _prompt()
    (first, second), hit_tokens, failed, parts, puts = pool.run(_cross_dp_job, master.overrides(gb=0.05), prompt)[0]
    assert second[:2] == first[:2] and first[2] == 0 and second[2] == 64
    assert hit_tokens == 64 and failed == 0
    assert parts == ["rep"] and puts >= 4  # MLA without a drafter: one value per block, written by TP rank 0


def test_a_store_killed_mid_stream_fails_no_request(tmp_path):
    """One worker, its own master: a stream runs, the master is killed, the stream and a new request complete; the new
    request's lookup gave up within the timeout and the outage is counted."""
    own = start_master(tmp_path / "master.log")
    engine = _engine("none", own.overrides(timeout_s=0.5))
    try:
        prompt = _prompt()
        engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        tokens = []
        for _ in range(3):
            tokens += [t for o in engine.step() for t in o.new_tokens]
        own.kill()
        while engine.has_work():
            tokens += [t for o in engine.step() for t in o.new_tokens]
        assert len(tokens) == 24
        t0 = time.monotonic()
        after = _run(engine, "after", prompt[:40] + prompt[:30])
        assert len(after[0]) == GREEDY.max_tokens
        errors = engine.runner.loads.store.errors
        assert errors["timeout"] + errors["unreachable"] >= 1, errors
        assert time.monotonic() - t0 < 30
    finally:
        engine.shutdown()
        own.kill()
