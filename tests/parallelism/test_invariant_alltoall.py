"""``dp8_ep8``'s all-to-all combine under ``engine.batch_invariant`` (:attr:`CommMode.ordered`): each (token,
choice) pair's expert output comes back unsummed and a token's pairs are added in top-k order, no ``index_add_``
(atomics on a GPU), so its MoE output is bit-identical whatever else shares the batch — on this rank and on the
others — and whichever rank holds its experts. On 8 forked gloo ranks, tiny widths; then the trained tiny_kimi pair
end to end under ``parallel=dp8_ep8``.

On this CPU ``index_add_`` happens to add in row order, which here is rank order too, so the flag-off combine gives
the same bits for one batch; what the CPU can check is the ordered path's arithmetic (the top-k-order sum, bit for
bit) and that it launches no ``index_add_``: the GPU-only failure mode (atomics in whatever order the threads land)."""

import pytest
import torch

from model import invariant
from parallelism.dispatch import make_dispatcher
from parallelism.layout import ExpertPlacement
from tests.e2e.test_batch_invariance import ZOO, _arms_job, arms_and_runs, invariant_cfg, probes, randn
from tests.support.layouts import layout

H, K, E = 24, 3, 16
TOKENS = 17


class IndexAddCalls:
    """Counts ``Tensor.index_add_`` calls while installed (``with``)."""

    def __init__(self):
        self.calls, self.original = 0, torch.Tensor.index_add_

    def __enter__(self):
        def counted(t, *args, **kwargs):
            self.calls += 1
            return self.original(t, *args, **kwargs)
        torch.Tensor.index_add_ = counted
        return self

    def __exit__(self, *exc):
        torch.Tensor.index_add_ = self.original


def _routed(rank: int, dtype: torch.dtype):
    """This rank's TOKENS tokens ``[T, H]``, top-K expert ids and weights, and its local experts' weights."""
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, K, generator=gen)
    local = E // 8
    return (randn(TOKENS, H, dtype=dtype, seed=100 + rank), ids, weights,
            randn(local, 2 * H, H, dtype=dtype, seed=200 + rank, scale=0.3),
            randn(local, H, H, dtype=dtype, seed=300 + rank, scale=0.3))


def _combine_job(ctx, lay, dtype):
    """Ordered mode: (1) dispatch → the invariant experts → combine, rows lo..hi of every rank at once: each probed
    token alone equals itself among 2, 9, 17 tokens; (2) with experts that scale each (row, choice) pair they hold by
    their rank's factor ``c[r]``, a token's output is ``((x c[h0] + x c[h1]) + x c[h2])`` over its choices in top-k
    order (``h_j`` the rank holding choice j's expert), bit for bit; (3) no ``index_add_`` launched, where flag off
    launches one per combine."""
    groups = ctx.groups(lay)
    disp = make_dispatcher(groups, ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement))
    x, ids, weights, wgu, wd = _routed(ctx.rank, dtype)
    factors = randn(8, dtype=dtype, seed=7)

    def moe(lo, hi, experts):
        inp, meta = disp.dispatch(x[lo:hi], ids[lo:hi], weights[lo:hi])
        return disp.combine(experts(inp), meta, None)

    def routed(inp):
        return invariant.moe_experts(inp, wgu, wd)

    def scaled(inp):  # flag on: each pair this rank holds, scaled (zeros elsewhere); off: the row, scaled
        if not inp.unsummed:
            return inp.hidden * factors[ctx.rank]
        return torch.where((inp.slots >= 0)[..., None], inp.hidden[:, None] * factors[ctx.rank], 0)

    groups.mode.ordered = True
    bad = []
    try:
        with IndexAddCalls() as ordered:
            for n in (2, 9, TOKENS):
                full = moe(0, n, routed)
                bad += [(n, r) for r in probes(n) if not torch.equal(moe(r, r + 1, routed)[0], full[r])]
            got = moe(0, TOKENS, scaled)
    finally:
        groups.mode.ordered = False
    holder = disp.holders[ids].int().argmax(dim=2)  # [T, K]: the rank holding choice j's expert
    want = x * factors[holder[:, 0], None]
    for j in range(1, K):
        want = want + x * factors[holder[:, j], None]
    with IndexAddCalls() as unordered:
        moe(0, TOKENS, scaled)
    return bad, torch.equal(got, want), ordered.calls, unordered.calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_alltoall_ordered_combine_rows(pool, dtype):
    results = pool.run(_combine_job, layout("dp8_ep8"), dtype)
    assert results == [([], True, 0, 1)] * 8


@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
def test_trained_pair_tokens_identical_under_dp8_ep8(pool):
    """With the flag on under ``parallel=dp8_ep8`` (attention DP, experts over an all-to-all): DDTree (budget 16,
    static steps) gives plain decoding's tokens for a batch of 8 (4 greedy + the same 4 seeded at T=1), and prompt 0
    gets the same tokens alone, greedy and seeded."""
    arms, runs = arms_and_runs(max_tokens=24)
    arms = [arms[0], arms[2]]  # plain and DDTree 16, static steps
    plain, tree = pool.run(_arms_job, layout("dp8_ep8"), runs, arms, invariant_cfg())[0]
    assert tree == plain
    for run in plain[1:]:
        for rid, got in run.items():
            assert got == plain[0][rid], rid
