"""The host KV tier (``engine.host_kv_cache_gb``): a prompt's blocks evicted from a small device pool are copied to
host slots, and the next turn on that prompt loads them back — its tokens and log-probs equal the cold run's bit for
bit (``engine.batch_invariant=true``), target and drafter layer groups alike, every block's bytes survive the round
trip on every rank, and the hit is counted on the host tier (a tier silently off fails here). One rank-pool job per
layout runs the cold and host arms: ``single`` plain and DDTree under both write policies, ``tp8`` plain and DDTree.
"""

import json

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
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 12 device blocks of 16 tokens: one 128-token request and its speculative scratch fit, two 70-token prompts do not
SMALL_POOL = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, block_size=16, num_blocks=12,
                  static_steps="on", batch_invariant=True, host_kv_cache_gb=0.02)
pytestmark = pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(),
                                reason="the trained tiny_kimi pair is absent")


def _prompts(n: int, length: int) -> list[list[int]]:
    return [p["ids"][:length] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:n]]


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list, list, int]:
    """Tokens, log-probs and cached-token count of one request run alone to its end."""
    engine.add_request(rid, prompt, params)
    tokens, lps, cached = [], [], 0
    while engine.has_work():
        for o in engine.step():
            tokens, lps, cached = tokens + o.new_tokens, lps + o.new_logprobs, o.num_cached_tokens
    return tokens, lps, cached


def _spec(method: str) -> SpecConfig:
    return SpecConfig() if method == "none" else SpecConfig(method, budget=16, drafter_path=str(ZOO / "drafter"))


def _host_hit_job(ctx, lay, arms, prompt, fillers):
    """Per (method, write policy): the cold run of ``prompt``, its blocks read out of every rank, ``fillers`` run
    until none of its blocks is left in the device pool, then ``prompt`` again. Rank 0 returns, per arm: (arm, cold,
    warm, host stats after, blocks the device pool still held before the warm turn, prefill tokens the warm turn
    computed, whether every rank's blocks read back equal, blocks in use at the end)."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(ZOO / "target", ctx.groups(lay) if lay.world_size > 1 else build_groups(lay), torch.bfloat16)
    out = []
    for method, write in arms:
        cfg = EngineConfig.flat(**SMALL_POOL, host_kv_write=write)
        speculation = load_speculation(_spec(method), model)
        if ctx.rank != 0:
            worker_loop(make_runner(model, cfg, speculation))
            continue
        engine = Engine(model, cfg, speculation=speculation)
        try:
            cold = _run(engine, "cold", prompt, GREEDY)
            before = engine.read_prefix_kv(prompt)
            for i, filler in enumerate(fillers):
                _run(engine, f"filler {i}", filler, GREEDY)
            left = len(engine.scheduler.kv.prefix_blocks(0, prompt))
            prefilled = engine.stats.prefill_tokens
            warm = _run(engine, "warm", prompt, GREEDY)
            after = engine.read_prefix_kv(prompt)
            same = after.num_tokens == before.num_tokens and all(
                torch.equal(after.per_rank[r], before.per_rank[r]) for r in before.per_rank)
            out.append(((method, write), cold, warm, engine.scheduler.kv.host.stats(), left,
                        engine.stats.prefill_tokens - prefilled, same, engine.scheduler.blocks_in_use()))
            assert engine.flush_cache().flushed and engine.scheduler.kv.host.stats().blocks == 0
        finally:
            engine.shutdown()
    return out


@pytest.mark.engine
@pytest.mark.parametrize(("preset", "arms"), [
    ("single", [("none", "evict"), ("none", "through"), ("ddtree", "evict")]),
    ("tp8", [("none", "evict"), ("ddtree", "through")]),
])
def test_a_turn_restored_from_host_memory_decodes_the_cold_turn_bit_for_bit(pool, preset, arms):
    prompt, *fillers = _prompts(4, 70)  # 4 full blocks of 16 and 6 tokens each
    rows = pool.run(_host_hit_job, layout(preset), arms, prompt, fillers)[0]
    assert [r[0] for r in rows] == [tuple(a) for a in arms]
    for arm, cold, warm, host, left, prefilled, same, in_use in rows:
        assert left == 0, arm  # the fillers evicted every block of the prompt from the device pool
        assert warm[:2] == cold[:2], arm  # tokens and log-probs, bit for bit
        assert warm[2] == 64, arm  # cached_tokens counts the host hit
        assert host.hit_tokens == 64 and host.load_blocks == 4 and host.store_blocks >= 4, (arm, host)
        assert prefilled == len(prompt) - 64, arm  # only the tokens past the restored blocks were computed
        assert same and in_use == 0, arm
