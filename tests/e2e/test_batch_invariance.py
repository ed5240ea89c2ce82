"""``engine.batch_invariant``: every row's result is bit-identical whatever shares its launch.

Per kernel (:mod:`model.invariant`, and the references it keeps): one row computed alone and inside launches of
2, 9, 17, 64 and 257 rows, bf16 and fp32 — bit-exact (``torch.equal``). Attention also across kernels: a tree node
at depth d equals a decode at its position, and a prefill row equals the decode of its token. The rank-order
reductions over 8 gloo ranks likewise. End to end, the trained tiny_kimi pair in bf16 with static steps: plain,
DFlash and DDTree (budgets 16 and 64), and plain decoding with graphs off, give the same greedy and seeded T=1
tokens at batch 8 (mixed with other requests) and (single) batch 1, under single and tp8. Flag-off differences are
measured, not tested (they depend on the scheduling): docs/batch_invariance.md, scripts/bench_invariance.py.
"""

import dataclasses
import json

import pytest
import torch

from bench.gpu.row_cases import ROW_CASES, TINY
from model import invariant, kernels
from model.kernel_select import QUANT_OPS, batch_invariant_kernels, launch_kernels, reference_kernels
from model.tree_mask import ancestor_mask
from parallelism.dispatch_base import ExpertInput
from tests.engine.test_engine import run_requests
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

SIZES = (2, 9, 17, 64, 257)
DTYPES = (torch.bfloat16, torch.float32)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def probes(n: int) -> list[int]:
    return sorted({0, 1, n // 2, n - 1})


def assert_rows_invariant(fn, n_max: int = max(SIZES)):
    """``fn(lo, hi)`` computes rows ``lo..hi-1`` in one launch (dim 0 = rows): row r alone equals row r of every
    launch ``0..n`` that holds it."""
    for n in SIZES:
        full = fn(0, n)
        for r in probes(n):
            alone = fn(r, r + 1)
            assert torch.equal(alone[0], full[r]), (n, r, (alone[0].float() - full[r].float()).abs().max())


# ----------------------------------------------------------------------------------------------- dense



def test_a_flag_off_engine_gets_the_set_the_invariant_one_was_made_from():
    """``make_runner`` switches a shared model: with the flag off it must get its own kernels back, not keep the
    invariant set a previous engine installed."""
    base = reference_kernels("test")
    invariant_set = launch_kernels(base, True)
    assert invariant_set.batch_invariant and invariant_set.invariant_of is base
    assert launch_kernels(invariant_set, True) is invariant_set
    assert launch_kernels(invariant_set, False) is base and launch_kernels(base, False) is base

@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_head_matmul_rows(dtype):
    x, w, b = randn(257, 96, dtype=dtype), randn(40, 96, dtype=dtype, seed=1, scale=0.1), randn(40, dtype=dtype)
    assert_rows_invariant(lambda lo, hi: invariant.linear(x[lo:hi], w))
    assert_rows_invariant(lambda lo, hi: invariant.linear(x[lo:hi], w, b))
    xh, wh = randn(257, 4, 24, dtype=dtype, seed=2), randn(4, 24, 40, dtype=dtype, seed=3, scale=0.2)
    assert_rows_invariant(lambda lo, hi: invariant.head_matmul(xh[lo:hi], wh))
    want = torch.einsum("thk,hkn->thn", xh.float(), wh.float())
    torch.testing.assert_close(invariant.head_matmul(xh, wh).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_and_norms_rows(dtype):
    """silu_and_mul (invariant: from ``exp``) and the reference RMSNorms the invariant set keeps, measured here."""
    x, r, w = randn(257, 64, dtype=dtype), randn(257, 64, dtype=dtype, seed=1), randn(64, dtype=dtype, seed=2)
    assert_rows_invariant(lambda lo, hi: invariant.silu_and_mul(x[lo:hi]))
    torch.testing.assert_close(invariant.silu_and_mul(x), kernels.silu_and_mul(x), rtol=1e-2, atol=1e-2)
    assert_rows_invariant(lambda lo, hi: kernels.rms_norm(x[lo:hi], w, 1e-6))
    assert_rows_invariant(lambda lo, hi: torch.stack(kernels.add_rms_norm(x[lo:hi], r[lo:hi], w, 1e-6), dim=1))


def test_router_scores_rows():
    """The DeepSeek router's fp32 sigmoid over 16 experts: ``torch.sigmoid`` sends the last 16 values of an odd-sized
    launch through its scalar routine on AVX-512 and differs there (measured on Zen 4); the invariant set's does not."""
    from model.config import MoEConfig
    from model.moe import Router

    # every expert chosen, renormalised: a last-bit difference in any score moves every weight of the row
    cfg = MoEConfig(num_experts=16, top_k=16, intermediate_size=16, scoring="sigmoid", correction_bias=True,
                    norm_topk_prob=True, routed_scaling_factor=2.5)
    router = Router(64, cfg)
    router.weight.copy_(randn(16, 64, seed=1, scale=0.05))  # logits ~ N(0, 1): scores away from 0 and 1
    router.e_score_correction_bias.copy_(torch.rand(16, generator=gen(2)))
    router.kernels = batch_invariant_kernels(reference_kernels("test"))
    router.matmul = router.kernels.linear
    x = randn(257, 64, seed=3, scale=3.0)
    assert_rows_invariant(lambda lo, hi: torch.cat([t.float() for t in router(x[lo:hi])], dim=-1))


def test_rope_and_gumbel_noise_rows():
    """cos/sin come from a table built once (a position's entry does not depend on the step's other positions), and
    the sampler's noise from :mod:`model.fixed_math` logs: row-invariant with 8 frequencies and a vocab of 203.
    (Coverage: torch's ``cos`` and ``log`` did not differ between tail and body on the CPUs measured.)"""
    from engine.sampling.sampler import gumbel_noise
    from model.config import RopeConfig
    from model.rope import Rotary

    rotary = Rotary(RopeConfig(dim=16, theta=10000.0), num_positions=600)
    positions = torch.randint(0, 600, (257,), generator=gen(4))
    assert_rows_invariant(lambda lo, hi: torch.cat(rotary.cos_sin(positions[lo:hi], torch.float32), dim=-1))
    seeds, steps = torch.randint(0, 2**62, (257,), generator=gen(5)), torch.randint(0, 99, (257,), generator=gen(6))
    assert_rows_invariant(lambda lo, hi: gumbel_noise(seeds[lo:hi], steps[lo:hi], 203))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_rows(dtype):
    """Per-pair outputs summed in top-k order; some choices on other ranks (slot −1), one expert hit by every row."""
    run = moe_rows_case(invariant.moe_experts, dtype)
    assert_rows_invariant(run)
    torch.testing.assert_close(run(0, 257).float(), run.reference, rtol=3e-2, atol=3e-2)


def moe_rows_case(experts, dtype):
    """``run(lo, hi)``: ``experts`` over rows lo..hi of 257 routed rows (6 experts, top-3; every 5th row's 2nd
    choice on another rank, slot −1; expert 2 hit by every row); ``run.reference``: the torch reference, fp32."""
    e, h, i, k = 6, 32, 16, 3
    x = randn(257, h, dtype=dtype)
    slots = torch.stack([torch.randperm(e, generator=gen(j))[:k] for j in range(257)])
    slots[::5, 1] = -1
    slots[:, 0] = 2
    weights = torch.rand(257, k, generator=gen(1))
    wgu, wd = randn(e, 2 * i, h, dtype=dtype, seed=2, scale=0.2), randn(e, h, i, dtype=dtype, seed=3, scale=0.2)

    def run(lo, hi):
        return experts(ExpertInput(x[lo:hi], slots[lo:hi], weights[lo:hi]), wgu, wd)
    run.reference = kernels.local_experts(ExpertInput(x.float(), slots, weights), wgu.float(), wd.float())
    run.full = (ExpertInput(x, slots, weights), wgu, wd)
    return run


# ----------------------------------------------------------------------------------------------- quantized

QUANT_DIMS = dataclasses.replace(TINY, hidden=64, inter=32)  # INT4 groups of 32, one 128x128 FP8 scale block


def quant_rows(kernel, op: str, dtype):
    """``run(lo, hi)``: ``kernel`` (the quantized op ``op``) over rows lo..hi of :data:`bench.gpu.row_cases.ROW_CASES`'
    257-row case at :data:`QUANT_DIMS`."""
    case = ROW_CASES[op](257, QUANT_DIMS, gen(0), dtype, "cpu")
    return lambda lo, hi: case.call(kernel, lo, hi)


@pytest.mark.parametrize("fp8_acts", (False, True), ids=("w8a16", "w8a8"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", QUANT_OPS)
def test_quant_ops_rows(op, dtype, fp8_acts):
    """Dequantize, then the invariant linear; the MoE per pair, summed in top-k order. In fp32 the reference itself
    is not row-invariant on this CPU (``F.linear`` picks its kernel by M): the swap is what makes these pass."""
    base = reference_kernels(fp8_acts=fp8_acts)
    inv = batch_invariant_kernels(base)
    assert getattr(inv, op) is invariant.QUANT[getattr(base, op)]  # W8A8 / W8A16 as the base set chose
    assert inv.reasons[op].startswith("batch-invariant")
    run = quant_rows(getattr(inv, op), op, dtype)
    assert_rows_invariant(run)
    ref = quant_rows(getattr(base, op), op, dtype)
    torch.testing.assert_close(run(0, 257), ref(0, 257), rtol=2e-2, atol=2e-2)
    if dtype == torch.float32:
        with pytest.raises(AssertionError):
            assert_rows_invariant(ref)


# ----------------------------------------------------------------------------------------------- attention


def paged_case(dtype, num_seqs=257, block_size=4, seed=0):
    """A cache of ``num_seqs`` sequences with context lengths 1..70 in scattered blocks; MLA latent 16 + rope 8,
    GQA 2 KV heads × 8."""
    g = gen(seed)
    lens = torch.randint(1, 71, (num_seqs,), generator=g)
    max_blocks = 18
    blocks = torch.randperm(num_seqs * max_blocks, generator=g).view(num_seqs, max_blocks).to(torch.int32)
    slots = num_seqs * max_blocks * block_size
    return dict(lens=lens.to(torch.int32), tables=blocks, block_size=block_size,
                latent=randn(slots, 16, dtype=dtype, seed=seed + 1), rope=randn(slots, 8, dtype=dtype, seed=seed + 2),
                k=randn(slots, 2, 8, dtype=dtype, seed=seed + 3), v=randn(slots, 2, 8, dtype=dtype, seed=seed + 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_rows(dtype):
    c = paged_case(dtype)
    q_lat, q_pe, q = randn(257, 4, 16, dtype=dtype, seed=5), randn(257, 4, 8, dtype=dtype, seed=6), \
        randn(257, 4, 8, dtype=dtype, seed=7)
    assert_rows_invariant(lambda lo, hi: invariant.paged_decode_mla(
        q_lat[lo:hi], q_pe[lo:hi], c["latent"], c["rope"], c["tables"][lo:hi], c["lens"][lo:hi], c["block_size"], 0.3))
    assert_rows_invariant(lambda lo, hi: invariant.paged_decode_gqa(
        q[lo:hi], c["k"], c["v"], c["tables"][lo:hi], c["lens"][lo:hi], c["block_size"], 0.3))
    want = kernels.paged_decode_mla(q_lat[:9].float(), q_pe[:9].float(), c["latent"].float(), c["rope"].float(),
                                    c["tables"][:9], c["lens"][:9], c["block_size"], 0.3)
    got = invariant.paged_decode_mla(q_lat[:9], q_pe[:9], c["latent"], c["rope"], c["tables"][:9], c["lens"][:9],
                                     c["block_size"], 0.3)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def random_parents(n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_node_equals_the_decode_at_its_position(dtype):
    """Tree verify over trees of 2…257 nodes (several trees per launch): node i at depth d gives exactly what a
    decode at position past + d gives once its ancestors' entries sit at the positions before it — the property
    that makes DDTree's tokens plain decoding's. GQA and MLA."""
    bs, past = 4, 37
    for n in SIZES:
        parents = torch.stack([random_parents(n, seed) for seed in (n, n + 1)])  # 2 trees in one launch
        mask = ancestor_mask(parents)
        ctx = past + n
        nblk = -(-ctx // bs)
        tables = torch.arange(2 * nblk, dtype=torch.int32).view(2, nblk)
        slots = 3 * nblk * bs  # two trees, then room for one decode copy
        lat, rope = randn(slots, 16, dtype=dtype, seed=n), randn(slots, 8, dtype=dtype, seed=n + 1)
        q_lat, q_pe = randn(2, n, 4, 16, dtype=dtype, seed=n + 2), randn(2, n, 4, 8, dtype=dtype, seed=n + 3)
        lens = torch.tensor([ctx, ctx], dtype=torch.int32)
        tree = invariant.tree_verify_mla(q_lat, q_pe, lat, rope, tables, lens, bs, 0.25, tree_mask=mask)
        for b in (0, 1):
            for i in probes(n):
                path = mask[b, i].nonzero().flatten()  # ancestors in index (= depth) order
                src = tables[b].long().repeat_interleave(bs)[:ctx] * bs + torch.arange(ctx) % bs
                order = torch.cat([src[:past], src[past + path]])
                dblocks = -(-len(order) // bs)
                dtable = torch.arange(2 * nblk, 2 * nblk + dblocks, dtype=torch.int32)[None]
                dslots = dtable[0].long().repeat_interleave(bs)[:len(order)] * bs + torch.arange(len(order)) % bs
                lat2, rope2 = lat.clone(), rope.clone()
                lat2[dslots], rope2[dslots] = lat[order], rope[order]
                dec = invariant.paged_decode_mla(q_lat[b, i][None], q_pe[b, i][None], lat2, rope2, dtable,
                                                 torch.tensor([len(order)], dtype=torch.int32), bs, 0.25)
                assert torch.equal(dec[0], tree[b, i]), (n, b, i)
        alone = invariant.tree_verify_mla(q_lat[1:], q_pe[1:], lat, rope, tables[1:], lens[1:], bs, 0.25,
                                          tree_mask=mask[1:])
        assert torch.equal(alone[0], tree[1])
        want = kernels.tree_verify_mla(q_lat.float(), q_pe.float(), lat.float(), rope.float(), tables, lens, bs, 0.25,
                                       tree_mask=mask)
        torch.testing.assert_close(tree.float(), want, rtol=2e-2, atol=2e-2)
    # GQA: the same property on one tree
    c = paged_case(dtype, num_seqs=1)
    parents = random_parents(17, 3)[None]
    lens = torch.tensor([past + 17], dtype=torch.int32)
    q = randn(1, 17, 4, 8, dtype=dtype, seed=9)
    tree = invariant.tree_verify_gqa(q, c["k"], c["v"], c["tables"], lens, 4, 0.3, parents=parents)
    for i in probes(17):
        path = ancestor_mask(parents)[0, i].nonzero().flatten()
        k = kernels.gather_paged(c["k"], c["tables"][0], past + 17, 4)
        v = kernels.gather_paged(c["v"], c["tables"][0], past + 17, 4)
        keep = torch.cat([torch.arange(past), past + path])
        got = invariant.masked_attention(q[:, i][:, None], k[keep][None], v[keep][None],
                                         torch.ones(1, 1, len(keep), dtype=torch.bool), 0.3)
        assert torch.equal(got[0, 0], tree[0, i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_rows_equal_decodes(dtype):
    """The dynamic path (:func:`model.invariant.sequence_attention`: prefill chunks, mixed steps) gives each causal
    row what the paged decode kernel gives its token: a token's arithmetic does not depend on the step kind."""
    c = paged_case(dtype, num_seqs=1)
    m = 60
    k = kernels.gather_paged(c["k"], c["tables"][0], m, 4)
    v = kernels.gather_paged(c["v"], c["tables"][0], m, 4)
    for n in (2, 9, 17, 60):
        q = randn(n, 4, 8, dtype=dtype, seed=n)
        chunk = invariant.sequence_attention(q, k, v, None, 0.3)
        for i in probes(n):
            dec = invariant.paged_decode_gqa(q[i][None], c["k"], c["v"], c["tables"],
                                             torch.tensor([m - n + i + 1], dtype=torch.int32), 4, 0.3)
            assert torch.equal(dec[0], chunk[i]), (n, i)


def test_the_invariant_set_replaces_every_op_but_the_norms():
    base = reference_kernels()
    inv = batch_invariant_kernels(base)
    assert inv.batch_invariant and batch_invariant_kernels(inv) is inv
    assert inv.rms_norm is base.rms_norm and inv.add_rms_norm is base.add_rms_norm
    for op in ("moe_experts", "paged_decode_gqa", "paged_decode_mla", "tree_verify_gqa", "tree_verify_mla", "linear",
               "head_matmul", "silu_and_mul", "masked_attention"):
        assert getattr(inv, op) is getattr(invariant, op), op
        assert inv.reasons[op].startswith("batch-invariant")


# ----------------------------------------------------------------------------------------------- collectives


def _reduce_job(ctx, lay, dtype):
    """Rank-order all-reduce and reduce-scatter on 8 ranks: a row alone and inside launches of 2…257 rows."""
    groups = ctx.groups(lay)
    comm = groups.world
    x = randn(257, 24, dtype=dtype, seed=100 + ctx.rank)
    groups.mode.ordered = True
    try:
        bad = []
        for n in SIZES:
            full = comm.all_reduce(x[:n].clone())
            chunks = comm.reduce_scatter(x[:n].repeat(8, 1).contiguous())  # every rank's chunk: rows 0..n-1
            for r in probes(n):
                alone = comm.all_reduce(x[r:r + 1].clone())
                bad += [("all_reduce", n, r)] if not torch.equal(alone[0], full[r]) else []
                one = comm.reduce_scatter(x[r:r + 1].repeat(8, 1).contiguous())
                bad += [("reduce_scatter", n, r)] if not torch.equal(one[0], chunks[r]) else []
        want = torch.stack([randn(257, 24, dtype=dtype, seed=100 + q)[:9] for q in range(8)])
        acc = want[0].clone()
        for part in want[1:]:
            acc += part
        bad += [] if torch.equal(comm.all_reduce(x[:9].clone()), acc) else ["not the rank-order sum"]
    finally:
        groups.mode.ordered = False
    full = comm.all_reduce(x.clone())  # the flag off: gloo's own order, which follows the call's size
    flipped = [r for r in probes(257) if not torch.equal(comm.all_reduce(x[r:r + 1].clone())[0], full[r])]
    return bad, bool(flipped)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_order_reductions_rows(pool, dtype):
    """Flag on: a row's sum is the same alone and inside 2…257 rows, and is the rank-order sum. Flag off (gloo's
    ring, chunked by the call's size) some row's bits differ: the flag is what makes tp8 invariant."""
    assert pool.run(_reduce_job, layout("tp8"), dtype) == [([], True)] * 8


# ----------------------------------------------------------------------------------------------- engine

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"


def _arms_job(ctx, lay, runs, arms, cfg, path=ZOO / "target"):
    """The trained target in bf16, each arm (a SpecConfig and ``engine.static_steps``) on fresh engines over each run
    (a request list) with ``cfg``; rank 0 returns ``[[{rid: (tokens, reason)} per run] per arm]``."""

    from engine.engine import Engine
    from engine.worker.loop import make_runner, worker_loop
    from model.loader import load_model
    from parallelism.comm import build_groups
    from spec_decode.speculation import load_speculation

    if lay.world_size == 1 and ctx.rank != 0:
        return None
    groups = ctx.groups(lay) if lay.world_size > 1 else build_groups(lay)
    model = load_model(path, groups, torch.bfloat16)
    out = []
    for spec, static in arms:
        speculation, per_arm = load_speculation(spec, model), []
        arm_cfg = cfg.replace(static_steps=static)
        for requests in runs:
            if ctx.rank != 0:
                worker_loop(make_runner(model, arm_cfg, speculation))
                continue
            engine = Engine(model, arm_cfg, speculation=speculation)
            per_arm.append(run_requests(engine, requests))
            engine.shutdown()
        out.append(per_arm)
    return out if ctx.rank == 0 else None


def arms_and_runs(max_tokens: int, full: bool = True):
    """Plain, DFlash, DDTree 16 and 64 on static steps, then plain and (``full``) DDTree 16 on the dynamic path
    (graphs off); a batch of 8 (4 prompts greedy and the same 4 seeded at T=1, top-p), then (``full``) prompt 0
    greedy alone and seeded alone."""
    from bench.gpu.invariance import workload
    from spec_decode.config import SpecConfig

    drafter = str(ZOO / "drafter")
    ddtree = [SpecConfig("ddtree", budget=b, drafter_path=drafter) for b in (16, 64)]
    arms = [(SpecConfig(), "on"), (SpecConfig("dflash", drafter_path=drafter), "on"), (ddtree[0], "on"),
            (ddtree[1], "on"), (SpecConfig(), "off"), (ddtree[0], "off")][:6 if full else 5]
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:4]]
    runs = workload(prompts, max_tokens)
    return arms, runs if full else runs[:1]


def invariant_cfg(on: bool = True):
    from engine.config import EngineConfig

    return EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, block_size=16,
                           num_blocks=256, static_steps="on", batch_invariant=on)


@pytest.mark.engine
@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
@pytest.mark.parametrize(("preset", "max_tokens", "full"), [("single", 24, True), ("tp8", 10, False)])
def test_trained_pair_tokens_identical_in_bf16(pool, preset, max_tokens, full):
    """With the flag on, every arm gives every request plain (static) decoding's tokens at batch 8 (prefill chunked
    over mixed steps by the 128-token budget), and prompt 0 alone gets the tokens it got inside the batch (with the
    flag off this fails on this box: docs/batch_invariance.md has where, measured with scripts/bench_invariance.py)."""
    arms, runs = arms_and_runs(max_tokens, full)
    out = pool.run(_arms_job, layout(preset), runs, arms, invariant_cfg())[0]
    plain = out[0]
    for arm, per_arm in zip(arms, out, strict=True):
        for run, got in zip(plain, per_arm, strict=True):
            assert got == run, (arm[0].method, arm[0].budget, arm[1])
    batch = plain[0]
    assert all(len(toks) == max_tokens for toks, _ in batch.values())
    for run in plain[1:]:
        for rid, got in run.items():
            assert got == batch[rid], rid


@pytest.mark.engine
def test_gqa_model_tokens_identical_in_bf16(pool, tiny_ckpts, random_drafter):
    """The GQA path (tiny Qwen3-MoE, untrained drafter): plain, DDTree and graphs-off plain agree with the flag on."""
    from engine.params import SamplingParams
    from spec_decode.config import SpecConfig

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 3, 99, 150, 7, 64, 31], [2, 4, 6], [200, 1, 77, 90, 13]]
    runs = [[(str(i), p, params) for i, p in enumerate(prompts)], [("0", prompts[0], params)]]
    tree = SpecConfig("ddtree", budget=12, block_size=5, drafter_path=random_drafter, tree_temperature=0.5)
    arms = [(SpecConfig(), "on"), (tree, "on"), (SpecConfig(), "off")]
    plain, *others = pool.run(_arms_job, layout("single"), runs, arms, invariant_cfg(), tiny_ckpts["tiny_qwen3_moe"])[0]
    assert all(other == plain for other in others)
    assert plain[1]["0"] == plain[0]["0"]


@pytest.mark.engine
def test_int4_model_tokens_identical_in_bf16(pool, tmp_path, random_drafter):
    """A quantized checkpoint (tiny Kimi-K2.5 INT4, scripts/make_quant_checkpoints.py): with the flag on, DDTree
    (budget 16) gives plain decoding's greedy tokens (static steps) at batch 4, and prompt 0 alone its batch tokens."""
    from engine.params import SamplingParams
    from spec_decode.config import SpecConfig
    from tests.support.quant_ckpts import script

    path, _ = script().write_preset("kimi_k25_int4", tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 3, 99, 150, 7, 64, 31], [2, 4, 6], [200, 1, 77, 90, 13], [8, 8, 120]]
    runs = [[(str(i), p, params) for i, p in enumerate(prompts)], [("0", prompts[0], params)]]
    tree = SpecConfig("ddtree", budget=16, block_size=5, drafter_path=random_drafter, tree_temperature=0.5)
    plain, ddtree = pool.run(_arms_job, layout("single"), runs, [(SpecConfig(), "on"), (tree, "on")],
                             invariant_cfg(), str(path))[0]
    assert ddtree == plain and plain[1]["0"] == plain[0]["0"]
    assert all(len(tokens) == 12 for tokens, _ in plain[0].values())
