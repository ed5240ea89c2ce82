"""Warm-up before serving (issue 20 item 3) and the static-shape memory guard (item 1, in part).

``Engine.warm_up`` runs every configured static shape once on every rank, before the first request: on CPU
eagerly (``static_steps=on``), under a faked capture as a capture. It must cover every shape, leave KV at 0,
change no output and add nothing to the coverage or step counts of real requests."""

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.loop import make_runner, worker_loop
from model.loader import load_model
from parallelism.comm import build_groups
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation
from tests.engine.test_engine import PROMPTS, run_requests
from tests.spec_decode.test_spec_engine import specs, static_steps
from tests.support.layouts import layout

CFG = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=256,
                      static_steps="on")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _warm_job(ctx, lay, path, spec_list, cfg=CFG, fake=False):
    """Per spec: a warmed-up and a cold engine over the same requests. Rank 0 returns per spec ((tokens,
    coverage, blocks after warm-up, blocks at the end, warm-up shapes, every rank's static step counts (from the
    step records), steps) warm, (…) cold)."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    from contextlib import nullcontext

    from tests.support.fake_capture import faked_capture

    model = load_model(path, ctx.groups(lay) if lay.world_size > 1 else build_groups(lay))
    if fake:  # as the Triton kernel set is
        from model.kernel_select import reference_kernels

        model.use_kernels(dataclasses.replace(reference_kernels(), graph_safe=True))
    out = []
    for spec in spec_list:
        speculation = load_speculation(spec, model)
        pair = []
        for warm in (True, False):
            with faked_capture() if fake else nullcontext():
                if ctx.rank != 0:
                    worker_loop(make_runner(model, cfg, speculation))
                    continue
                engine, records = Engine(model, cfg, speculation=speculation), []
                engine.subscribe(records.append)
                if warm:
                    engine.warm_up()
                after_warm = engine.scheduler.blocks_in_use()
                res = run_requests(engine, [(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
                pair.append((res, engine.stats.coverage.summary(), after_warm, engine.scheduler.blocks_in_use(),
                             engine.stats.warmup_shapes, static_steps(records) if not fake else None,
                             engine.stats.steps))
                engine.shutdown()
        out.append(pair)
    return out


@pytest.mark.parametrize("preset", ["single", "dp8_ep8", "tp2xdp4_ep8"])
def test_warm_up_covers_every_shape_and_changes_nothing(pool, tiny_ckpts, random_drafter, preset):
    """Plain decoding warms a decode per batch size (1, 2, 4, 8), DDTree a verify (draft + verify + commit) per
    batch size at its tree size, both then a prefill per attention-DP rank; every rank enters the same shapes
    (under dp8_ep8 / tp2xdp4_ep8 a rank that skipped one would hang the collectives). Tokens, coverage and step
    counts equal a cold engine's."""
    spec_list = [specs(random_drafter)[0], specs(random_drafter)[2]]
    out = pool.run(_warm_job, layout(preset), tiny_ckpts["tiny_deepseek"], spec_list)[0]
    dp = layout(preset).attn_dp
    for (warm, cold), (kind, tree_size) in zip(out, (("decode", 1), ("verify", 13)), strict=True):
        res, cov, after_warm, blocks, shapes, static_cov, steps = warm
        assert [(s["kind"], s["batch"], s.get("tree_size", s.get("tokens"))) for s in shapes] == [
            (kind, b, tree_size) for b in (1, 2, 4, 8)] + [("prefill", dp, 64)]  # and one prompt of
        # max_num_batched_tokens per attention-DP rank
        assert all(s["seconds"] > 0 and not s["graph"] for s in shapes)
        assert all(s["reason"] == "no CUDA device" for s in shapes[:-1])
        assert after_warm == 0 and blocks == 0
        assert res == cold[0] and cov == cold[1] and static_cov == cold[5] and steps == cold[6]
        assert static_cov[0].get(kind, 0) > 0  # the requests' static steps, on every rank alike (static_steps)
        assert cold[4] == []


def test_warm_up_captures_every_shape_so_requests_only_replay(pool, tiny_ckpts, random_drafter):
    """Under a faked capture (``tests/support/fake_capture.py``) the warm-up captures each decode shape, and each verify
    shape's draft, verify and commit; the requests then replay 100 % of those steps, and their coverage counts
    only their own steps."""
    spec_list = [specs(random_drafter)[0], specs(random_drafter)[2]]
    out = pool.run(_warm_job, layout("dp8_ep8", "dispatcher=allgather"), tiny_ckpts["tiny_deepseek"], spec_list,
                   CFG, True)[0]
    for (warm, cold), kinds in zip(out, (("decode",), ("verify", "draft", "commit")), strict=True):
        res, cov, _, blocks, shapes, _, steps = warm
        assert all(s["graph"] and s["reason"] == "" for s in shapes[:-1]) and len(shapes) == 5
        assert res == cold[0] and blocks == 0 and steps == cold[6]
        for kind in kinds:
            assert cov[kind]["replays"] == cov[kind]["steps"] == cold[1][kind]["steps"] > 0, cov


def test_static_step_bytes_and_the_memory_verdict_on_fake_numbers():
    """Verify logits grow as batch × nodes × vocab: a Kimi-K2-sized vocab at batch 64 × 257 nodes needs over 100
    GiB, a decode step of batch 1 a few MiB; the verdict keeps 10 % of the free memory back and sets no limit
    off CUDA."""
    from engine.worker.capture import SAMPLING_BYTES_PER_LOGIT, memory_blocker, static_step_bytes

    dims = dict(vocab=163840, hidden=7168, intermediate=18432, dtype_bytes=2)
    decode = static_step_bytes(batch=1, tree_size=1, **dims)
    verify = static_step_bytes(batch=64, tree_size=257, feature_width=3 * 7168, draft_rows=256, **dims)
    assert decode == 163840 * (4 + SAMPLING_BYTES_PER_LOGIT) + (8 * 7168 + 3 * 18432) * 2 + 2
    assert 4 * 2**20 < decode < 8 * 2**20
    assert static_step_bytes(batch=2, tree_size=257, **dims) - static_step_bytes(batch=1, tree_size=257, **dims) > \
        257 * 163840 * 4  # at least a logits row block per sequence
    assert 100 * 2**30 < verify < 200 * 2**30
    gib = 2**30
    assert memory_blocker(9 * gib, 10 * gib) == ""  # 9 GiB <= 90 % of 10 GiB
    why = memory_blocker(int(9.5 * gib), 10 * gib)
    assert why == ("needs ~9.50 GiB of buffers, 10.00 GiB free on the device (keeping 10% back): skipped, its "
                   "steps run the dynamic path")
    assert memory_blocker(verify, None) == ""  # CPU: no limit


def _guard_job(ctx, lay, path, free_on_rank3):
    """Rank 3 reports ``free_on_rank3`` free bytes (the others: no limit); warm-up then runs the requests."""
    import engine.worker.runner as runner_mod

    saved = runner_mod.free_device_memory
    runner_mod.free_device_memory = lambda device: free_on_rank3 if ctx.rank == 3 else None
    try:
        return _warm_job(ctx, lay, path, [SpecConfig()])
    finally:
        runner_mod.free_device_memory = saved


def test_shapes_that_do_not_fit_on_one_rank_are_skipped_on_every_rank(pool, tiny_ckpts):
    """Rank 3 has room for the batch-1 and batch-2 decode shapes only: every rank skips 4 and 8 (the verdict is
    agreed over the control group, or the ranks would enter different steps), the reason names rank 3 and is
    logged and recorded; a batch of 6 then runs the dynamic path with that reason, and the tokens are the cold
    engine's."""
    from engine.worker.capture import static_step_bytes

    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    cfg = model.cfg
    need = [static_step_bytes(batch=b, tree_size=1, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
                              intermediate=max(cfg.intermediate_size, cfg.moe.intermediate_size * cfg.moe.top_k),
                              dtype_bytes=4) for b in (2, 4)]
    free = int(sum(need) / 2 / 0.9)  # between the batch-2 and batch-4 needs, after the 10 % reserve
    (warm, cold), = pool.run(_guard_job, layout("tp8"), tiny_ckpts["tiny_deepseek"], free)[0]
    res, cov, _, blocks, shapes, _, _ = warm
    assert [s["skipped"] for s in shapes] == [False, False, True, True, False]  # the prefill is not static
    assert shapes[3]["reason"].startswith("rank 3: needs ~") and shapes[3]["reason"].endswith("dynamic path")
    assert res == cold[0] and blocks == 0
    assert cov["decode"]["eager_reason"].startswith("static shape skipped: rank 3: needs ~")
