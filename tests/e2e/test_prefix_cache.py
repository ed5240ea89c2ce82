"""Prefix caching, on-demand blocks and recompute preemption (``engine/core/kv_manager.py``,
``engine/core/scheduler.py``).

- Bit-exact warm turns: with ``engine.batch_invariant`` and static steps, a turn that re-sends an earlier turn's
  prompt and output (a hit on generated, DDTree-accepted tokens) and one that shares part of a prompt (a hit
  inside the prompt) give the tokens and log-probs of a cold engine, bit for bit, under single, tp8 and dp8_ep8, for
  plain decoding, DFlash and DDTree; each asserts its warm turn reported cached tokens, and DFlash's τ warm = cold.
- A preemption storm on a pool of 3 max-length requests: every request completes (or is aborted) with the tokens of
  an unconstrained run, preemptions happen, and afterwards no block is referenced or leaked.
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


# ----------------------------------------------------------------------------------------------- bit-exact turns


def _drive(engine, requests):
    """{rid: (tokens, logprobs, cached_tokens)} of ``requests`` submitted together."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out = {rid: ([], [], 0) for rid, _, _ in requests}
    while engine.has_work():
        for o in engine.step():
            toks, lps, _ = out[o.request_id]
            out[o.request_id] = (toks + o.new_tokens, lps + o.new_logprobs, o.num_cached_tokens)
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)


def first_turn(prompts):
    return [("a0", prompts[0], GREEDY), ("a1", prompts[1], SEEDED)]


def second_turn(prompts, outputs):
    """The agents' next turns (history + their output + new text) and a prompt sharing 40 tokens with one."""
    return [("b0", prompts[0] + outputs["a0"] + prompts[2][:7], GREEDY),
            ("b1", prompts[1] + outputs["a1"] + prompts[2][7:12], SEEDED),
            ("c0", prompts[0][:40] + prompts[2][:20], GREEDY)]


def _engines(ctx, lay, arms, cfg, flag: str):
    """Rank 0: an Engine per arm (a SpecConfig) with ``cfg.<flag>`` on, then off, each shut down once the caller
    moves on; the other ranks serve them (and yield nothing)."""

    if lay.world_size == 1 and ctx.rank != 0:
        return
    model = load_model(ZOO / "target", ctx.groups(lay) if lay.world_size > 1 else build_groups(lay), torch.bfloat16)
    for spec in arms:
        speculation = load_speculation(spec, model)
        for on in (True, False):
            arm_cfg = cfg.replace(**{flag: on})
            if ctx.rank != 0:
                worker_loop(make_runner(model, arm_cfg, speculation))
                continue
            engine = Engine(model, arm_cfg, speculation=speculation)
            try:
                yield engine
            finally:  # releases the other ranks also when the caller fails
                engine.shutdown()


def _turns_job(ctx, lay, arms, prompts, cfg):
    """Per arm: a warm engine runs the first turn then the second; a cold one (prefix caching off) does the same,
    re-prefilling everything. Rank 0 returns per arm and mode (second turn, its τ, blocks in use)."""
    out = []
    for engine in _engines(ctx, lay, arms, cfg, "prefix_caching"):
        turn1 = _drive(engine, first_turn(prompts))
        s = engine.stats
        steps, tokens = s.spec_request_steps, s.spec_tokens
        turn2 = _drive(engine, second_turn(prompts, {rid: o[0] for rid, o in turn1.items()}))
        tau = (s.spec_tokens - tokens) / max(s.spec_request_steps - steps, 1)
        out.append((turn2, tau, engine.scheduler.blocks_in_use()))
    return out if ctx.rank == 0 else None


@pytest.mark.engine
@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
@pytest.mark.parametrize("preset", ["single", "tp8", "dp8_ep8"])
def test_warm_turns_are_bit_identical_to_cold_ones(pool, preset):
    drafter = str(ZOO / "drafter")
    arms = [SpecConfig(), SpecConfig("dflash", drafter_path=drafter),
            SpecConfig("ddtree", budget=16, drafter_path=drafter)]
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:3]]
    cfg = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, block_size=16,
                          num_blocks=256, static_steps="on", batch_invariant=True)
    out = pool.run(_turns_job, layout(preset), arms, prompts, cfg)[0]
    for i, spec in enumerate(arms):
        (warm, tau_warm, used_warm), (cold, tau_cold, used_cold) = out[2 * i], out[2 * i + 1]
        for rid in warm:
            assert warm[rid][:2] == cold[rid][:2], (spec.method, rid)  # tokens and log-probs, bit for bit
            assert warm[rid][2] > 0 and cold[rid][2] == 0, (spec.method, rid, warm[rid][2])
        assert warm["b0"][2] > len(prompts[0]) and warm["c0"][2] == 32  # generated tokens hit; 2 prompt blocks
        assert tau_warm == tau_cold and used_warm == used_cold == 0


def test_waiting_for_a_prefix_being_prefilled_is_reported_as_deferred():
    """Scheduler alone: of four requests sharing 100 tokens, the first prefills (32-token chunks) and the other three
    wait as ``deferred`` (``vllm:num_requests_waiting_by_reason``) until its blocks are committed, then start at the
    shared 96 tokens — also with ``engine.overlap=on``, where a chunk's blocks are committed a step after it is
    planned; a fifth with its own prompt is admitted past them; nothing is deferred with the setting off."""
    import dataclasses

    from engine.core.scheduler import Scheduler
    from engine.step import StepResult

    def result(plan):
        return {w.request_id: StepResult([5], [0.0], [[]]) for w in plan.work[0] if w.sample}

    for share, overlap in ((True, "off"), (True, "on"), (False, "off")):
        cfg = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512, block_size=16,
                              num_blocks=64, share_inflight_prefix=share, overlap=overlap)
        sched = Scheduler(cfg, 1, 4096, (1,))
        shared = list(range(10, 110))
        for i in range(4):
            sched.add(f"s{i}", shared + [200 + i] * 6, dataclasses.replace(GREEDY, max_tokens=2), 0)
        sched.add("own", list(range(300, 320)), dataclasses.replace(GREEDY, max_tokens=2), 0)
        starts, deferred, in_flight = {}, [], None
        while sched.has_work() or in_flight is not None:
            plan = sched.schedule() if sched.has_work() else None
            if in_flight is not None:  # overlap: the previous plan's results come back after this one is planned
                sched.update(in_flight, result(in_flight))
            deferred.append(sched.stats().per_dp[0].deferred)
            for w in plan.work[0] if plan is not None else ():
                starts.setdefault(w.request_id, w.start)
            if overlap == "on":
                in_flight = plan
            elif plan is not None:
                sched.update(plan, result(plan))
        if share:
            waited = deferred.index(0)
            assert waited >= 1 and set(deferred[:waited]) == {3} and not any(deferred[waited:]), (overlap, deferred)
            assert starts == {"s0": 0, "own": 0, "s1": 96, "s2": 96, "s3": 96}, overlap
        else:
            assert not any(deferred) and set(starts.values()) == {0}
        assert sched.blocks_in_use() == 0


def _fan_out_job(ctx, lay, arms, prompts, cfg):
    """Per arm, with ``engine.share_inflight_prefix`` on then off: four requests sharing a 100-token prefix arrive
    together. Rank 0 returns per arm and setting ({rid: (tokens, logprobs, cached)}, prefill tokens computed,
    admissions put off, blocks in use)."""
    shared = (prompts[0] + prompts[3])[:100]
    requests = [(f"s{i}", shared + prompts[1 + i % 2][i:i + 6], GREEDY if i % 2 else SEEDED) for i in range(4)]
    out = []
    for engine in _engines(ctx, lay, arms, cfg, "share_inflight_prefix"):
        got = _drive(engine, requests)
        out.append((got, engine.stats.prefill_tokens, engine.scheduler.stats().prefix_waits,
                    engine.scheduler.blocks_in_use()))
    return out if ctx.rank == 0 else None


@pytest.mark.engine
@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
@pytest.mark.parametrize("preset", ["single", "dp8_ep8"])
def test_requests_arriving_together_compute_their_shared_prefix_once(pool, preset):
    """Four agents' requests with one 100-token prefix (6 full blocks) arrive at once, in 32-token chunks: with
    ``engine.share_inflight_prefix`` the first computes the prefix and the others wait for its blocks, then hit them
    (under dp8_ep8 they follow it to its DP rank) — 3 × 96 prefill tokens fewer — with the tokens and log-probs of
    the setting off, bit for bit (``engine.batch_invariant``), plain and DDTree."""
    arms = [SpecConfig()]
    if preset == "single":
        arms.append(SpecConfig("ddtree", budget=16, drafter_path=str(ZOO / "drafter")))
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:4]]
    cfg = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512, block_size=16,
                          num_blocks=256, static_steps="on", batch_invariant=True)
    out = pool.run(_fan_out_job, layout(preset), arms, prompts, cfg)[0]
    for i, spec in enumerate(arms):
        (shared, prefill_on, waits, used_on), (alone, prefill_off, none, used_off) = out[2 * i], out[2 * i + 1]
        assert {rid: o[:2] for rid, o in shared.items()} == {rid: o[:2] for rid, o in alone.items()}, spec.method
        assert sorted(o[2] for o in shared.values()) == [0, 96, 96, 96], (spec.method, shared)
        assert all(o[2] == 0 for o in alone.values()) and none == 0 and waits > 0
        assert prefill_off - prefill_on == 3 * 96 and used_on == used_off == 0


def test_without_the_flag_a_warm_turn_still_gives_hfs_greedy_tokens(tiny_ckpts):
    from tests.support.rpc_helpers import hf_greedy

    path = tiny_ckpts["tiny_deepseek"]
    model = load_model(path, build_groups(layout("single")))
    engine = Engine(model, EngineConfig.flat(max_num_batched_tokens=16, block_size=4, num_blocks=256))
    first = [5, 17, 3, 99, 150, 7, 64, 31, 2, 4, 6]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = _drive(engine, [("a", first, greedy)])["a"][0]
    second = first + out + [77, 90]
    got = _drive(engine, [("b", second, greedy)])["b"]
    assert got[2] >= 16 and got[0] == hf_greedy(path, [second], 8)[0]
    engine.shutdown()


# ----------------------------------------------------------------------------------------------- preemption


def _storm(model, cfg, requests, abort_at, spec=None):
    """Runs ``requests`` (24 at once) with aborts ``{rid: step}``; returns ({rid: tokens}, preemptions, blocks used,
    pools consistent)."""
    engine = Engine(model, cfg, speculation=load_speculation(spec, model) if spec else None)
    tokens, steps = {rid: [] for rid, _, _ in requests}, 0
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_tokens
        steps += 1
        for rid, at in abort_at.items():
            if at == steps and engine.scheduler.knows(rid):
                engine.abort_all(rid)
    sched = engine.scheduler
    result = tokens, sched.stats().preemptions, sched.blocks_in_use(), all(p.consistent() for p in sched.kv.pools)
    engine.shutdown()
    return result


@pytest.mark.parametrize("mode", ["plain", "overlap", "ddtree"])
def test_a_preemption_storm_loses_and_repeats_nothing(tiny_ckpts, random_drafter, mode):
    import random

    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    rng = random.Random(0)
    requests = []
    for i in range(24):
        prompt = [rng.randrange(2, 203) for _ in range(rng.randrange(8, 40))]
        params = SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=rng.randrange(8, 40),
                                ignore_eos=True)
        requests.append((f"r{i}", prompt, params))
    aborts = {"r3": 4, "r11": 9}  # ~10 % cancelled mid-stream
    spec = SpecConfig("ddtree", budget=8, block_size=5, drafter_path=random_drafter) if mode == "ddtree" else None
    base = EngineConfig.flat(max_num_seqs=24, max_num_batched_tokens=64, max_model_len=96, block_size=8,
                           static_steps="off", batch_invariant=True, overlap="on" if mode == "overlap" else "off")
    free_run, *_ = _storm(model, base.replace(num_blocks=1024), requests, {}, spec)
    scratch = 8 if spec else 0  # a pool for 3 max-length requests (and their trees)
    tight = base.replace(num_blocks=3 * -(-(96 + scratch) // 8))
    got, preemptions, used, consistent = _storm(model, tight, requests, aborts, spec)
    assert preemptions > 0 and used == 0 and consistent
    for rid, toks in got.items():
        if rid in aborts:
            assert toks == free_run[rid][:len(toks)], rid
        else:
            assert toks == free_run[rid], rid
