"""Dispatchers on 8 forked gloo ranks: round trips, skewed routing, empty ranks, comm-call formulas."""

import pytest
import torch
from layouts import layout

from model.batch import ForwardBatch
from model.loader import load_model
from parallelism.dispatch import expected_forward_calls, make_dispatcher
from parallelism.layout import ExpertPlacement, Layout

H, K, E = 6, 3, 16


def identity_experts(inp, moe_tp):
    """Each valid slot returns its weighted input; expert-TP shards each return 1/moe_tp of it."""
    w = torch.where(inp.slots >= 0, inp.weights, 0.0).sum(dim=1, keepdim=True)
    return inp.hidden * w / moe_tp


def _round_trip(ctx, lay, tokens_per_rank, route):
    g = ctx.groups(lay)
    placement = ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement)
    disp = make_dispatcher(g, placement)
    partitioned = disp.needs_partitioned_tokens
    gen = torch.Generator().manual_seed(1000 + (ctx.rank if partitioned else 0))
    t = tokens_per_rank[ctx.rank] if partitioned else tokens_per_rank[0]
    x = torch.randn(t, H, generator=gen)
    if route == "random":
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
    else:  # every choice of every token → expert 3
        ids = torch.full((t, K), 3, dtype=torch.int64)
    weights = torch.full((t, K), 1.0 / K)
    inp, meta = disp.dispatch(x, ids, weights)
    out = disp.combine(identity_experts(inp, lay.moe_tp), meta, None)
    return float((out - x).abs().max()) if t else 0.0, out.shape[0] == t, inp.hidden.shape[0]


ROUND_TRIP_LAYOUTS = [
    layout("dp8_ep8"),
    layout("dp8_ep8", "dispatcher=allgather"),
    layout("dp8_ep8", "moe_tp=2", "moe_ep=4"),
    layout("dp8_ep8", "placement=round_robin"),
    layout("ep8"),
    layout("tp2_ep4"),
    layout("tp8"),
]


@pytest.mark.parametrize("lay", ROUND_TRIP_LAYOUTS, ids=lambda lay: lay.describe())
@pytest.mark.parametrize("route", ["random", "one_expert"])
def test_round_trip_identity_experts(pool, lay, route):
    tokens = [5, 0, 3, 1, 0, 7, 2, 4]  # uneven, two ranks with no tokens at all
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


@pytest.mark.parametrize("preset", ["tp8", "ep8", "dp8_ep8", "tp2_ep4", "tp4_ep2"])
def test_comm_calls_follow_the_formula(pool, tiny_ckpts, preset):
    lay = layout(preset)
    seqs = [[1, 2, 3], [4, 5], [6]]  # fewer sequences than DP ranks: idle ranks still enter every collective
    counts = pool.run(_calls, lay, tiny_ckpts["tiny_deepseek"], seqs)
    expected = expected_forward_calls(lay, num_layers=3, num_moe_layers=2)
    for rank, got in enumerate(counts):
        assert got == expected, f"rank {rank}: {got} != {expected}"


def test_formula_single_rank_is_empty():
    assert expected_forward_calls(Layout(), 3, 2) == {}
