"""The engine under every layout: greedy tokens equal HF transformers', batch invariance, seeded sampling,
chunked prefill, abort, and KV blocks back to zero after every run."""

import pytest
import torch

from engine.config import EngineConfig, RequestError
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.loop import worker_loop
from engine.worker.runner import ModelRunner
from model.loader import load_model
from model.tiny import load_hf
from parallelism.comm import build_groups
from tests.support.layouts import layout

PROMPTS = [[5, 17, 3, 99, 150, 7, 64, 31, 8, 202, 11], [2, 4, 6], [200, 1, 77, 90, 13, 45, 46], [9],
           [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [120, 121]]
N_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
SMALL = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=128)


@pytest.fixture(scope="module")
def hf_greedy(tiny_ckpts):
    out = {}
    for name, path in tiny_ckpts.items():
        hf = load_hf(path)
        out[name] = [hf.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                                 do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    return out


def run_requests(engine, requests, abort_after=None):
    """requests: list of (id, prompt, params). Returns {id: (tokens, finish_reason)}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens, reasons, steps = {rid: [] for rid, _, _ in requests}, {}, 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_tokens
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if abort_after and steps == abort_after[1] and engine.scheduler.knows(abort_after[0]):
            reasons[abort_after[0]] = engine.abort_all(abort_after[0])[-1].finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def _engine_job(ctx, lay, path, jobs, cfg=SMALL):
    """Runs each job (a list of requests, optional abort) on a fresh engine; rank 0 returns results."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    groups = ctx.groups(lay) if lay.world_size > 1 else build_groups(lay)
    model = load_model(path, groups)
    if ctx.rank != 0:
        for _ in jobs:
            worker_loop(ModelRunner(model, cfg.cache.num_blocks, cfg.cache.block_size))
        return None
    results = []
    for requests, abort_after in jobs:
        engine = Engine(model, cfg)
        results.append((run_requests(engine, requests, abort_after), engine.scheduler.blocks_in_use(),
                        dict(engine.stats.step_kinds)))
        engine.shutdown()
    return results


def greedy_job():
    return [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)], None


@pytest.mark.parametrize("ckpt", ["tiny_deepseek", "tiny_qwen3_moe"])
@pytest.mark.parametrize("preset", ["single", "tp8", "ep8", "dp8_ep8", "tp2_ep4", "tp2xdp4_ep8"])
def test_greedy_matches_hf(pool, tiny_ckpts, hf_greedy, ckpt, preset):
    (results, blocks, kinds), = pool.run(_engine_job, layout(preset), tiny_ckpts[ckpt], [greedy_job()])[0]
    for i, ref in enumerate(hf_greedy[ckpt]):
        tokens, reason = results[f"r{i}"]
        assert tokens == ref, f"{preset} prompt {i}: {tokens} != HF {ref}"
        assert reason == "length"
    assert blocks == 0
    assert kinds.get("decode", 0) > 0


def test_batch_invariance_chunked_prefill_seeds_and_abort(pool, tiny_ckpts):
    """One engine lifetime per job on dp8_ep8: alone vs in a batch of 8, chunked prefill, seeded sampling
    alone vs in a batch (different order), and an abort mid-stream — all leave zero blocks in use."""
    target = PROMPTS[4]
    others = [(f"o{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4] + PROMPTS[5:] + [[7, 7], [8]])]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    jobs = [
        ([("t", target, GREEDY)], None),
        (others[:3] + [("t", target, GREEDY)] + others[3:], None),
        ([("s", target, seeded)], None),
        ([(rid, p, SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True))
          for i, (rid, p, _) in enumerate(others)] + [("s", target, seeded)], None),
        (others + [("t", target, GREEDY)], ("o2", 3)),
    ]
    chunked = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=5, max_model_len=128, block_size=4,
                              num_blocks=128)
    res = pool.run(_engine_job, layout("dp8_ep8"), tiny_ckpts["tiny_deepseek"], jobs)[0]
    res_chunked = pool.run(_engine_job, layout("dp8_ep8"), tiny_ckpts["tiny_deepseek"], jobs[:2], chunked)[0]
    alone, batched, s_alone, s_batched, aborted = (r[0] for r in res)
    assert batched["t"] == alone["t"]
    assert res_chunked[0][0]["t"] == alone["t"] and res_chunked[1][0]["t"] == alone["t"]
    assert res_chunked[0][2].get("prefill", 0) >= 3  # the 18-token prompt took several 5-token chunks
    assert s_batched["s"] == s_alone["s"] and len(s_alone["s"][0]) == 16
    assert s_alone["s"][0] != alone["t"][0][:16]  # T=1 sampling is not greedy
    assert aborted["o2"][1] == "abort" and len(aborted["o2"][0]) < N_TOKENS
    assert aborted["t"] == alone["t"]
    assert all(blocks == 0 for _, blocks, _ in res + res_chunked)


def test_request_validation_names_the_field(tiny_ckpts):
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    engine = Engine(model, SMALL)
    cases = [([], GREEDY, "prompt is empty"), ([1, 500], GREEDY, r"token ids must be in \[0, 203\)"),
             ([1] * 120, GREEDY, "exceeds max_model_len 128")]
    for prompt, params, words in cases:
        with pytest.raises(RequestError, match=words):
            engine.add_request("x", prompt, params)
    with pytest.raises(RequestError, match="unknown request_id 'nope'"):
        engine.abort_all("nope")
    assert engine.scheduler.blocks_in_use() == 0 and not engine.has_work()


@pytest.mark.parametrize("allocation", ["on_demand", "reserve"])
def test_stop_token_and_admission_limits(tiny_ckpts, allocation):
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    tight = EngineConfig.flat(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48, block_size=4, num_blocks=12,
                            kv_allocation=allocation)
    engine = Engine(model, tight)
    free_run = run_requests(engine, [("a", PROMPTS[0], GREEDY)])["a"][0]
    stop_at = free_run[5]
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, stop_token_ids=(stop_at,))
    res = run_requests(engine, [("b", PROMPTS[0], params)])
    assert res["b"] == (free_run[:free_run.index(stop_at) + 1], "stop")
    # 4 requests of 9 blocks each with 12 blocks (reserve: one at a time; on demand: preempting), all finish,
    # nothing leaks
    many = run_requests(engine, [(f"m{i}", PROMPTS[0], GREEDY) for i in range(4)])
    assert all(v == (free_run, "length") for v in many.values())
    assert engine.scheduler.blocks_in_use() == 0


def test_graph_coverage_reports_eager_with_reason(tiny_ckpts):
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    engine = Engine(model, SMALL)
    run_requests(engine, [("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    cov = engine.stats.coverage.summary()
    assert cov["prefill"]["steps"] == 1 and cov["decode"]["steps"] == 3
    assert all(c["coverage"] == 0.0 and c["eager_reason"] == "no CUDA device" for c in cov.values())
