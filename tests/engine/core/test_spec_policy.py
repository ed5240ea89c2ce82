"""``spec_decode.adaptive``'s rule (``engine.core.spec_policy.MeasuredSpeculation``) on hand-worked step records, and
an adaptive engine whose speculation hardly pays (an untrained drafter at T = 1) running plain decode steps too, and
writing plain decoding's tokens."""

from __future__ import annotations

from engine.core.spec_policy import AlwaysSpeculate, MeasuredSpeculation
from engine.core.step_record import StepRecord, TokenCounts
from engine.step import StepKind


def verify(batch: int, committed: int, seconds: float) -> StepRecord:
    return StepRecord(step_id=0, kind=StepKind.VERIFY, t_end=0.0, gap_s=0.0, wall_s=seconds,
                      tokens=TokenCounts(decoded=committed, spec_requests=batch, spec_committed=committed))


def decode(batch: int, seconds: float) -> StepRecord:
    return StepRecord(step_id=0, kind=StepKind.DECODE, t_end=0.0, gap_s=0.0, wall_s=seconds,
                      tokens=TokenCounts(decoded=batch))


def test_speculates_where_acceptance_pays_for_the_verify():
    policy = MeasuredSpeculation(alpha=0.5, probe=3)
    assert policy.speculate(1)  # nothing measured: verify first
    policy.observe(verify(1, committed=2, seconds=0.030))  # τ 2, 30 ms
    assert not policy.speculate(1)  # decode not measured yet at batch 1
    policy.observe(decode(1, seconds=0.010))  # 10 ms: τ × 10 = 20 < 30
    assert [policy.speculate(1) for _ in range(4)] == [False, False, False, True]  # the 4th probes
    policy.observe(verify(1, committed=4, seconds=0.030))  # τ 2 + 0.5 × (4 - 2) = 3: 3 × 10 ≥ 30
    assert policy.speculate(1) and policy.plain_run == 0
    assert policy.speculate(4)  # another batch size: measured apart (verify first)
    policy.observe(verify(4, committed=12, seconds=0.040))
    policy.observe(decode(4, seconds=0.020))  # τ 3 + 0.5 × (3 - 3) = 3: 3 × 20 ≥ 40
    assert policy.speculate(4)


def test_mixed_and_idle_records_are_not_measured():
    policy = MeasuredSpeculation()
    policy.observe(StepRecord(step_id=0, kind=StepKind.MIXED, t_end=0.0, gap_s=0.0, wall_s=9.0,
                              tokens=TokenCounts(decoded=1, spec_requests=1, spec_committed=5)))
    policy.observe(StepRecord(step_id=None, kind=None, t_end=0.0, gap_s=0.0, wall_s=9.0))
    assert policy.tau is None and policy.seconds == {}
    assert AlwaysSpeculate().speculate(3)


def _adaptive_job(ctx, lay, path, drafter):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.params import SamplingParams
    from model.loader import load_model
    from parallelism.comm import build_groups
    from spec_decode.config import SpecConfig
    from spec_decode.speculation import load_speculation
    from tests.engine.test_engine import run_requests

    if ctx.rank != 0:
        return None
    model = load_model(path, build_groups(lay))
    cfg = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                            num_blocks=256)
    requests = [(str(i), p, SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True))
                for i, p in enumerate([[5, 17, 3, 99], [2, 4, 6], [200, 1, 77]])]
    adaptive = SpecConfig("ddtree", budget=32, block_size=5, drafter_path=drafter, adaptive=True)
    out = []
    for spec, static in ((SpecConfig(), "off"), (adaptive, "off"), (adaptive, "on")):
        engine = Engine(model, cfg.replace(static_steps=static), speculation=load_speculation(spec, model))
        engine.warm_up()
        warmed = {s["kind"] for s in engine.stats.warmup_shapes if "tree_size" in s}  # static shapes' kinds
        out.append((run_requests(engine, requests), dict(engine.stats.step_kinds), warmed))
        engine.shutdown()
    return out


def test_an_adaptive_engine_mixes_plain_and_speculative_steps_losslessly(pool, tiny_ckpts, random_drafter):
    """An untrained drafter at T = 1 accepts little while a 33-node verify costs more than a decode step: after
    measuring both, the engine runs plain decode steps as well as verify steps (on a quiet box: 33 decode steps and
    4 verify steps; how many of each depends on the timings, so only both is asserted), and the tokens are plain
    decoding's — dynamic steps, and static ones (the warm-up runs the decode shapes beside the verify shapes)."""
    from tests.support.layouts import layout

    (plain, _, _), *adaptive = pool.run(_adaptive_job, layout("single"), tiny_ckpts["tiny_deepseek"],
                                        random_drafter)[0]
    for tokens, kinds, _ in adaptive:
        assert tokens == plain
        assert kinds.get(StepKind.DECODE, 0) > 0 and kinds.get(StepKind.VERIFY, 0) > 0, kinds
    assert adaptive[0][2] == set() and adaptive[1][2] == {"decode", "verify"}, adaptive
