"""Dispatchers on 8 forked gloo ranks: round trips, skewed routing, empty ranks, comm-call formulas."""

import pytest
import torch

from model.batch import ForwardBatch
from model.loader import load_model
from parallelism.dispatch import expected_forward_calls, make_dispatcher
from parallelism.layout import ExpertPlacement, Layout
from tests.support.layouts import layout

H, K, E = 6, 3, 16


def identity_experts(inp, moe_tp):
    """Each valid slot returns its weighted input; expert-TP shards each return 1/moe_tp of it."""
    w = torch.where(inp.slots >= 0, inp.weights, 0.0).sum(dim=1, keepdim=True)
    return inp.hidden * w / moe_tp


def _round_trip(ctx, lay, tokens_per_group, route):
    """One dispatch → identity experts → combine with a shared-expert partial of ``x / attn_tp`` on every rank
    (summed over the attention-TP group it is ``x``): (max |out − 2x|, row count kept, rows received). Ranks of
    one attention-DP group hold the same ``tokens_per_group[dp_rank]`` tokens."""
    g = ctx.groups(lay)
    placement = ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement)
    disp = make_dispatcher(g, placement)
    dp = lay.coords(ctx.rank).attn_dp_rank
    gen = torch.Generator().manual_seed(1000 + dp)
    t = tokens_per_group[dp]
    x = torch.randn(t, H, generator=gen)
    if route == "random":
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
    else:  # every choice of every token → expert 3
        ids = torch.full((t, K), 3, dtype=torch.int64)
    weights = torch.full((t, K), 1.0 / K)
    inp, meta = disp.dispatch(x, ids, weights)
    out = disp.combine(identity_experts(inp, lay.moe_tp), meta, x / lay.attn_tp)
    return float((out - 2 * x).abs().max()) if t else 0.0, out.shape[0] == t, inp.hidden.shape[0]


ROUND_TRIP_LAYOUTS = [
    layout("dp8_ep8"),
    layout("dp8_ep8", "dispatcher=allgather"),
    layout("dp8_ep8", "moe_tp=2", "moe_ep=4"),
    layout("dp8_ep8", "placement=round_robin"),
    layout("ep8"),
    layout("tp2_ep4"),
    layout("tp8"),
    layout("tp2xdp4_ep8"),
    layout("tp2xdp4_ep8", "dispatcher=allgather", "moe_tp=2", "moe_ep=4"),
    layout("tp2xdp4_ep8", "attn_tp=4", "attn_dp=2", "placement=round_robin"),
    layout("ep8", "dispatcher=alltoall"),
]


@pytest.mark.parametrize("lay", ROUND_TRIP_LAYOUTS, ids=lambda lay: lay.describe())
@pytest.mark.parametrize("route", ["random", "one_expert"])
def test_round_trip_identity_experts(pool, lay, route):
    tokens = [5, 0, 3, 1, 0, 7, 2, 4]  # per attention-DP group: uneven, two groups with no tokens at all
    results = pool.run(_round_trip, lay, tokens, route)
    for rank, (err, shape_ok, _) in enumerate(results):
        assert shape_ok, f"rank {rank}: combine returned the wrong number of rows"
        assert err < 1e-6, f"rank {rank}: round trip error {err}"


def test_alltoall_ranks_receiving_nothing(pool):
    """All tokens route to expert 3 (EP rank 1 under linear placement): only rank 1 receives rows,
    each token once although all k of its choices live there."""
    tokens = [5, 0, 3, 1, 0, 7, 2, 4]
    results = pool.run(_round_trip, layout("dp8_ep8"), tokens, "one_expert")
    received = [r[2] for r in results]
    assert received == [0, sum(tokens), 0, 0, 0, 0, 0, 0]


def test_attention_tp_ranks_each_send_their_share(pool):
    """Under TP2 × DP4 attention each TP rank of a group sends ceil(T/2) rows (its half, padded to one shape):
    groups of 5, 0, 3, 1 tokens send 3+3, 0, 2+2, 1+1 rows, all to rank 1 (expert 3's) — 9 tokens, 3 padding."""
    results = pool.run(_round_trip, layout("tp2xdp4_ep8"), [5, 0, 3, 1], "one_expert")
    assert [r[2] for r in results] == [0, 12, 0, 0, 0, 0, 0, 0]



def _allgather_captured_vs_eager(ctx, lay):
    """The allgather round trip on equal token counts, eager and as inside a capture (``capturing`` patched):
    (max |captured − eager|, all_gather calls eager, all_gather calls captured)."""
    import parallelism.dispatch as dispatch

    g = ctx.groups(lay)
    disp = make_dispatcher(g, ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement))
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(4, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(4)])
    weights = torch.rand(4, K, generator=gen)
    outs, calls = [], []
    for captured in (False, True):
        dispatch.capturing, real = (lambda on=captured: on), dispatch.capturing
        try:
            g.counter.reset()
            inp, meta = disp.dispatch(x, ids, weights)
            outs.append(disp.combine(identity_experts(inp, lay.moe_tp), meta, None))
            calls.append(g.counter.calls[("world", "all_gather")])
        finally:
            dispatch.capturing = real
    return float((outs[0] - outs[1]).abs().max()), *calls


def test_allgather_skips_the_count_exchange_inside_a_capture(pool):
    """A captured step has one shape on every rank, so the allgather dispatcher pads to its own count instead
    of all-gathering the counts and reading them on the host (which a capture refuses); same output."""
    for diff, eager, captured in pool.run(_allgather_captured_vs_eager, layout("dp8_ep8", "dispatcher=allgather")):
        assert diff == 0.0 and (eager, captured) == (3, 2)


def _calls(ctx, lay, path, seqs):
    model = load_model(path, ctx.groups(lay))
    dp = lay.coords(ctx.rank).attn_dp_rank
    mine = [s for i, s in enumerate(seqs) if i % lay.attn_dp == dp]
    model.groups.counter.reset()
    model.logits(model(ForwardBatch.from_sequences(mine)))
    return {f"{g}/{op}": n for (g, op), n in model.groups.counter.calls.items()}


@pytest.mark.parametrize("preset", ["tp8", "ep8", "dp8_ep8", "tp2_ep4", "tp4_ep2", "tp2xdp4_ep8",
                                    "tp2xdp4_ep8 dispatcher=allgather"])
def test_comm_calls_follow_the_formula(pool, tiny_ckpts, preset):
    lay = layout(*preset.split())
    seqs = [[1, 2, 3], [4, 5], [6]]  # fewer sequences than DP ranks: idle ranks still enter every collective
    counts = pool.run(_calls, lay, tiny_ckpts["tiny_deepseek"], seqs)
    expected = expected_forward_calls(lay, num_layers=3, num_moe_layers=2)
    for rank, got in enumerate(counts):
        assert got == expected, f"rank {rank}: {got} != {expected}"


def _split_bytes(ctx, lay, path, seqs):
    """Bytes this rank's attention-TP split moved in one forward, per op, and its group's token count."""
    model = load_model(path, ctx.groups(lay))
    c = lay.coords(ctx.rank)
    mine = [s for i, s in enumerate(seqs) if i % lay.attn_dp == c.attn_dp_rank]
    model.groups.counter.reset()
    model(ForwardBatch.from_sequences(mine))
    got = {op: n for (g, op), n in model.groups.counter.bytes.items() if g == "attn_tp_split"}
    return got, sum(len(s) for s in mine)


def test_attention_tp_split_moves_one_share_per_rank(pool, tiny_ckpts):
    """Per MoE layer a TP rank all-gathers its share of ceil(T/2) rows and reduce-scatters the shared experts'
    2·ceil(T/2) rows (fp32, hidden 64): what the cost model charges (``bench.cost.formulas``)."""
    lay = layout("tp2xdp4_ep8")
    for got, tokens in pool.run(_split_bytes, lay, tiny_ckpts["tiny_deepseek"], [[1, 2, 3], [4, 5], [6]]):
        share = -(-tokens // 2) * 64 * 4
        assert got == ({"all_gather": 2 * share, "reduce_scatter": 2 * 2 * share} if tokens else {
            "all_gather": 0, "reduce_scatter": 0}), (got, tokens)


def test_formula_single_rank_is_empty():
    assert expected_forward_calls(Layout(), 3, 2) == {}
