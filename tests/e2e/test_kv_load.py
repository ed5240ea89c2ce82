"""KV that moves: blocks read out of the caches of every rank (``Engine.read_prefix_kv``, target and drafter layer
groups), the prefix cache emptied, and a request that loads them (``add_request(kv=)``) decodes the tokens and
log-probs of the cold run bit for bit — plain, DFlash and DDTree, greedy and seeded, on one rank and under tp2_ep4 ×
… (tp8) — while a request whose load has not finished waits without changing the other requests' steps.
"""

import dataclasses
import json
import threading

import pytest
import torch

from engine.config import EngineConfig, RequestError
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.kv_loads import HostKV
from engine.worker.loop import make_runner, worker_loop
from model.loader import load_model
from parallelism.comm import build_groups
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)
CFG = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=16, num_blocks=64,
                      static_steps="on", batch_invariant=True)
pytestmark = pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(),
                                reason="the trained tiny_kimi pair is absent")


def _prompts(n: int) -> list[list[int]]:
    return [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:n]]


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, kv=None) -> tuple[list, list, int]:
    """Tokens, log-probs and cached-token count of one request run alone to its end."""
    engine.add_request(rid, prompt, params, kv=kv)
    tokens, lps, cached = [], [], 0
    while engine.has_work():
        for o in engine.step():
            tokens, lps, cached = tokens + o.new_tokens, lps + o.new_logprobs, o.num_cached_tokens
    return tokens, lps, cached


def _arms() -> list[SpecConfig]:
    drafter = str(ZOO / "drafter")
    return [SpecConfig(), SpecConfig("dflash", drafter_path=drafter),
            SpecConfig("ddtree", budget=16, drafter_path=drafter)]


def _round_trip_job(ctx, lay, prompt):
    """Per arm and sampling: the cold run, then its prompt's blocks read out, the cache flushed, and the loaded run;
    rank 0 returns (arm, params, cold, loaded, source tokens, prefill tokens the loaded run computed, whether the
    loaded blocks read back equal the source, blocks in use at the end)."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(ZOO / "target", ctx.groups(lay) if lay.world_size > 1 else build_groups(lay), torch.bfloat16)
    out = []
    for spec in _arms():
        speculation = load_speculation(spec, model)
        if ctx.rank != 0:
            worker_loop(make_runner(model, CFG, speculation))
            continue
        engine = Engine(model, CFG, speculation=speculation)
        try:
            for params in (GREEDY, SEEDED):
                cold = _run(engine, "cold", prompt, params)
                host = engine.read_prefix_kv(prompt)
                assert engine.flush_cache().flushed
                prefilled = engine.stats.prefill_tokens
                loaded = _run(engine, "loaded", prompt, params, kv=host)
                again = engine.read_prefix_kv(prompt)  # the loaded blocks, indexed once written
                same = again.num_tokens == host.num_tokens and all(
                    torch.equal(again.per_rank[r], host.per_rank[r]) for r in host.per_rank)
                out.append((spec.method, params.temperature, cold, loaded, host.num_tokens,
                            engine.stats.prefill_tokens - prefilled, same, engine.scheduler.blocks_in_use()))
                assert engine.flush_cache().flushed
        finally:
            engine.shutdown()
    return out


@pytest.mark.engine
@pytest.mark.parametrize("preset", ["single", "tp8"])
def test_blocks_read_out_and_loaded_decode_bit_identically(pool, preset):
    prompt = _prompts(1)[0][:70]  # 4 full blocks of 16 and 6 tokens
    rows = pool.run(_round_trip_job, layout(preset), prompt)[0]
    assert len(rows) == 6
    for method, temperature, cold, loaded, source_tokens, prefilled, same, in_use in rows:
        what = (method, temperature)
        assert source_tokens == 64, what
        assert loaded[:2] == cold[:2], what  # tokens and log-probs, bit for bit
        assert loaded[2] == 0, what  # nothing came from the prefix cache: it was flushed
        assert prefilled == len(prompt) - 64, what  # only the tokens past the loaded blocks were computed
        assert same and in_use == 0, what


class GatedHostKV(HostKV):
    """A host source whose reads wait until ``gate`` is set (a slow tier or a remote worker)."""

    gate: threading.Event

    def __init__(self, host: HostKV, gate: threading.Event):
        super().__init__(host.per_rank, host.num_tokens)
        object.__setattr__(self, "gate", gate)

    def read(self, at, blocks: list[int]) -> torch.Tensor:
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().read(at, blocks)


def test_a_request_waiting_for_its_kv_does_not_hold_up_the_others():
    """One rank, DDTree: ``other`` alone takes N steps; with a request whose load is held back it takes the same N
    steps and tokens while that request counts as loading (and waiting, not running); opened, the held request
    gives the cold run's tokens. An aborted load's blocks are freed, and a source that fits no cache is refused."""
    model = load_model(ZOO / "target", build_groups(layout("single")), torch.bfloat16)
    engine = Engine(model, CFG, speculation=load_speculation(_arms()[2], model))
    try:
        first, second = _prompts(2)
        first = first[:70]
        cold = _run(engine, "cold", first, GREEDY)
        host = engine.read_prefix_kv(first)
        assert engine.flush_cache().flushed

        def steps_of_other(held: str | None) -> tuple[int, list[int]]:
            engine.add_request("other", second[:40], SEEDED)
            steps, tokens = 0, []
            while engine.scheduler.knows("other"):
                for o in engine.step():
                    if o.request_id == "other":
                        tokens += o.new_tokens
                steps += 1
                if held is not None:
                    s = engine.scheduler.stats()
                    assert (s.loading, s.per_dp[0].loading) == (1, 1) and s.waiting == 1 and s.running <= 1
            return steps, tokens

        alone = steps_of_other(None)
        assert engine.flush_cache().flushed  # "other" computes its prompt again
        gate = threading.Event()
        engine.add_request("held", first, GREEDY, kv=GatedHostKV(host, gate))
        assert steps_of_other("held") == alone
        gate.set()
        tokens = []
        while engine.has_work():
            tokens += [t for o in engine.step() for t in o.new_tokens]
        assert tokens == cold[0] and engine.scheduler.stats().loading == 0

        assert engine.flush_cache().flushed  # an abort while loading frees the reserved blocks
        gate = threading.Event()
        engine.add_request("dropped", first, GREEDY, kv=GatedHostKV(host, gate))
        engine.step()
        assert engine.scheduler.stats().loading == 1 and engine.scheduler.blocks_in_use() > 0
        engine.abort_all("dropped")
        gate.set()
        assert engine.scheduler.blocks_in_use() == 0
        _run(engine, "after", second[:20], GREEDY)  # the next step waits for the dropped load, then runs

        bad = HostKV({0: host.per_rank[0][:, :-1]}, host.num_tokens)
        with pytest.raises(RequestError, match="do not fit this engine's KV cache"):
            engine.add_request("bad", first, GREEDY, kv=bad)
        with pytest.raises(RequestError, match="runs one sample"):
            engine.add_request("many", first, dataclasses.replace(SEEDED, n=2), kv=host)
    finally:
        engine.shutdown()
