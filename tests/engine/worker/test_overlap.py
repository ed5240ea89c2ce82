"""``engine.overlap=on`` (issue 20 item 4): the host schedules step n+1 before step n's tokens are back, and the
device feeds them by reference. Outputs must equal ``overlap=off`` token for token under every layout kind, with
chunked prefill mixed into decode steps, requests arriving mid-stream, stop tokens, length limits, seeded
sampling and aborts issued after a request's N-th token; blocks are freed exactly once and end at zero.
Speculative steps drain, and stay lossless with overlap on. All comparisons are bit-exact (fp32, CPU)."""

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.loop import make_runner, worker_loop
from model.loader import load_model
from parallelism.comm import build_groups
from tests.spec_decode.test_spec_engine import specs
from tests.support.layouts import layout

# 8-token chunks: the 18- and 11-token prompts prefill over several steps, mixed with the others' decodes
CFG = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=128, block_size=4, num_blocks=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
LONG = [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
ABORT_AFTER = 4  # d is aborted once the client holds its 4th token


def drive(engine, stop_token: int | None, abort: bool) -> dict:
    """A fixed script, keyed to what the client has seen (not to step counts, which overlap shifts): a..e start
    together; f and g arrive once a holds 3 tokens; d is aborted after its ABORT_AFTER-th token. Returns
    ``{id: (tokens, finish reason)}``; fails if a request gets a token after it finished."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=(stop_token,) if stop_token else ())
    start = [("a", LONG, GREEDY), ("b", [5, 17, 3, 99, 150, 7, 64, 31, 8, 202, 11], stop), ("c", [2, 4, 6], seeded),
             ("d", [200, 1, 77, 90, 13], GREEDY), ("e", [9], dataclasses.replace(GREEDY, max_tokens=3))]
    late = [("f", [120, 121, 122, 7, 7, 8, 9, 10, 11, 12], GREEDY), ("g", [3], seeded)]
    for rid, prompt, params in start:
        engine.add_request(rid, prompt, params)
    tokens, reasons = {}, {}
    while engine.has_work():
        for out in engine.step():
            assert out.request_id not in reasons, f"{out.request_id} got tokens after it finished"
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if late and len(tokens.get("a", [])) >= 3:
            for rid, prompt, params in late:
                engine.add_request(rid, prompt, params)
            late = []
        if abort and "d" not in reasons and len(tokens.get("d", [])) >= ABORT_AFTER:
            reasons["d"] = engine.abort_all("d")[-1].finish_reason
    return {rid: (tokens.get(rid, []), reasons[rid]) for rid in sorted(reasons)}


def _overlap_job(ctx, lay, path, cfg=CFG):
    """Engine lifetimes on every rank: a probe (overlap off, no abort) that picks b's stop token, then overlap off
    and on, each with static steps off and on. Rank 0 returns the probe and ``{(overlap, static): (outputs,
    blocks in use, free list has no duplicates, host seconds per phase, steps, placeholders planned)}``."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(path, ctx.groups(lay) if lay.world_size > 1 else build_groups(lay))
    modes = [("off", "off"), ("off", "off"), ("on", "off"), ("off", "on"), ("on", "on")]
    out, probe, stop = {}, None, None
    for i, (overlap, static) in enumerate(modes):
        run_cfg = cfg.replace(overlap=overlap, static_steps=static)
        if ctx.rank != 0:
            worker_loop(make_runner(model, run_cfg))
            continue
        engine = Engine(model, run_cfg)
        refs, schedule = [0], engine.scheduler.schedule

        def counted(schedule=schedule, refs=refs):  # placeholders planned: decodes fed from the device
            plan = schedule()
            refs[0] += sum(w.prev_row >= 0 for per_rank in plan.work for w in per_rank)
            return plan
        engine.scheduler.schedule = counted
        res = drive(engine, stop, abort=i > 0)
        if i == 0:
            probe, stop = res, res["b"][0][5]  # b stops at its 6th greedy token (or earlier, if repeated)
        else:
            pools = engine.scheduler.kv.pools
            out[overlap, static] = (res, engine.scheduler.blocks_in_use(),
                                    all(p.consistent() for p in pools), dict(engine.stats.host_s),
                                    engine.stats.steps, refs[0])
        engine.shutdown()
    return probe, out


@pytest.mark.parametrize("preset", ["single", "tp8", "dp8_ep8", "tp2xdp4_ep8"])
def test_overlap_gives_the_same_tokens_as_no_overlap(pool, tiny_ckpts, preset):
    probe, out = pool.run(_overlap_job, layout(preset), tiny_ckpts["tiny_deepseek"])[0]
    reference = out["off", "off"][0]
    assert set(reference) == set("abcdefg")
    assert reference["b"][1] == "stop" and reference["b"][0][-1] == probe["b"][0][5]
    assert reference["d"] == (probe["d"][0][:ABORT_AFTER], "abort")
    assert reference["e"] == (probe["e"][0], "length") and len(probe["e"][0]) == 3
    for rid in "acefg":  # the abort and b's stop change nothing for the others
        assert reference[rid] == probe[rid], rid
    for (overlap, static), (res, blocks, no_double_free, host, steps, refs) in out.items():
        assert res == reference, (overlap, static)
        assert blocks == 0 and no_double_free, (overlap, static)
        assert all(v > 0 for v in host.values()) and steps > 0
        assert (refs > 20) if overlap == "on" else (refs == 0), (overlap, static, refs)


def test_overlap_with_speculation_drains_and_stays_lossless(pool, tiny_ckpts, random_drafter):
    """With speculation the next step's start depends on the accepted count, so ``overlap=on`` drains every
    step: DFlash and DDTree still give plain decoding's tokens (greedy and seeded), under dp8_ep8."""
    from tests.spec_decode.test_spec_engine import PROMPTS, _job

    cfg = CFG.replace(max_num_batched_tokens=64, overlap="on")
    for params in (SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)):
        (plain, _, b0), (chain, _, b1), (tree, _, b2) = pool.run(
            _job, layout("dp8_ep8"), tiny_ckpts["tiny_deepseek"], PROMPTS, specs(random_drafter), params, cfg)[0]
        (plain_off, _, _), = pool.run(_job, layout("dp8_ep8"), tiny_ckpts["tiny_deepseek"], PROMPTS,
                                      specs(random_drafter)[:1], params, cfg.replace(overlap="off"))[0]
        assert plain == plain_off and chain == plain and tree == plain
        assert b0 == b1 == b2 == 0


def test_scheduler_plans_the_next_step_before_the_tokens_are_back():
    """Hand-worked: with overlap the second plan feeds a placeholder that points at the first plan's row; a
    request whose in-flight token reaches max_tokens is not planned again; one that stops while the next step is
    in flight gets no token from it and frees its blocks once."""
    from engine.core.scheduler import Scheduler
    from engine.step import StepResult

    sched = Scheduler(CFG.replace(overlap="on", max_num_batched_tokens=64), 1, 203, (1,))
    sched.add("x", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), 0)
    sched.add("y", [8, 9], SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(42,)), 0)
    p0 = sched.schedule()
    assert [(w.token_ids, w.start, w.prev_row, w.num_generated) for w in p0.work[0]] == [
        ([5, 6, 7], 0, -1, 0), ([8, 9], 0, -1, 0)]
    p1 = sched.schedule()  # before p0's tokens: both decode from p0's rows 0 and 1
    assert [(w.request_id, w.token_ids, w.start, w.prev_row, w.num_generated) for w in p1.work[0]] == [
        ("x", [0], 3, 0, 1), ("y", [0], 2, 1, 1)]

    def result(token):
        return StepResult([token], [0.0], [[]])

    out0 = sched.update(p0, {"x": result(11), "y": result(12)})
    assert [(o.request_id, o.new_tokens, o.finished) for o in out0] == [("x", [11], False), ("y", [12], False)]
    p2 = sched.schedule()  # x's in-flight token is its 2nd = max_tokens: only y goes on, from p1's row 1
    assert [(w.request_id, w.start, w.prev_row, w.num_generated) for w in p2.work[0]] == [("y", 3, 1, 2)]
    out1 = sched.update(p1, {"x": result(13), "y": result(42)})  # y stops with p2 in flight
    assert [(o.request_id, o.new_tokens, o.finish_reason) for o in out1] == [("x", [13], "length"),
                                                                            ("y", [42], "stop")]
    assert sched.blocks_in_use() == 0
    assert sched.update(p2, {"y": result(99)}) == []  # its extra token is dropped; nothing is freed twice
    pool = sched.kv.pools[0]
    assert pool.num_used == 0 and pool.consistent() and pool.num_free == CFG.cache.num_blocks
    assert not sched.has_work() and sched.schedule().num_tokens == 0


def _replay_job(ctx, lay, path):
    """Warmed-up static steps with capture faked (every decode shape "captured" at warm-up, each replay re-runs
    the step from its buffers), overlap off then on. Rank 0 returns per mode (outputs, coverage, blocks)."""
    from model.kernel_select import reference_kernels
    from tests.support.fake_capture import faked_capture

    model = load_model(path, ctx.groups(lay))
    model.use_kernels(dataclasses.replace(reference_kernels(), graph_safe=True))  # as the Triton set is
    out = {}
    with faked_capture():
        for overlap in ("off", "on"):
            cfg = CFG.replace(overlap=overlap, static_steps="on")
            if ctx.rank != 0:
                worker_loop(make_runner(model, cfg))
                continue
            engine = Engine(model, cfg)
            engine.warm_up()
            out[overlap] = (drive(engine, None, abort=True), engine.stats.coverage.summary(),
                            engine.scheduler.blocks_in_use())
            engine.shutdown()
    return out if ctx.rank == 0 else None


def test_overlap_feeds_replayed_graphs_through_their_input_buffers(pool, tiny_ckpts):
    """The previous step's tokens are written into a captured decode graph's input buffer before its replay
    (capture faked), under DP attention with idle padding ranks: same tokens as without overlap, every decode
    step replayed."""
    out = pool.run(_replay_job, layout("dp8_ep8", "dispatcher=allgather"), tiny_ckpts["tiny_deepseek"])[0]
    (off, cov_off, b_off), (on, cov_on, b_on) = out["off"], out["on"]
    assert on == off and b_on == b_off == 0
    for cov in (cov_off, cov_on):
        assert cov["decode"]["replays"] == cov["decode"]["steps"] > 0, cov
