"""The placement-invariant MoE combine (``engine.batch_invariant`` with ``moe_ep`` > 1): which rank holds an expert
changes no bit of a layer's output. On 8 forked gloo ranks, tiny widths, every dispatcher that runs here — allreduce
(``ep8``; ``tp2_ep4`` with each expert split over two ranks), alltoall (``dp8_ep8``; ``tp2xdp4_ep8`` under the
attention-TP split) and allgather — computes one MoE layer (routed + shared partials) under the ``linear`` and the
``round_robin`` placement and an EPLB placement (one redundant slot per EP rank: the loaded experts replicated, a
token's choices spread over the replicas): the same experts, different ranks. With the ordered mode on the outputs are
equal bit for bit; with it off (each rank sums its own experts first, the ranks' partial sums are added) some token
differs, which is what the pairwise combine removes — and the EPLB placement's output stays within rounding of the
linear one (every replica holds its expert's weights and is routed to)."""

import pytest
import torch

from model import invariant
from parallelism.dispatch import make_dispatcher
from parallelism.eplb import rebalance
from parallelism.layout import ExpertPlacement
from tests.support.layouts import layout

H, INTER, K, E = 32, 16, 4, 16
TOKENS = 13
LAYOUTS = [("ep8",), ("tp2_ep4",), ("dp8_ep8",), ("dp8_ep8", "dispatcher=allgather"), ("tp2xdp4_ep8",)]


def _randn(*shape, seed: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _expert_shards(placement: ExpertPlacement, ep_rank: int, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local experts in its placement's slot order, each its ``moe_tp`` shard of one fixed expert per
    global id: ``w_gate_up [E_local, 2*I_shard, H]``, ``w_down [E_local, H, I_shard]``."""
    i = INTER // placement.moe_tp
    gate_up, down = [], []
    for e in placement.local_experts(ep_rank):
        full_gu, full_d = _randn(2 * INTER, H, seed=1000 + e, scale=0.3), _randn(H, INTER, seed=2000 + e, scale=0.3)
        gate, up = full_gu[:INTER], full_gu[INTER:]
        gate_up.append(torch.cat([gate[tp_rank * i:(tp_rank + 1) * i], up[tp_rank * i:(tp_rank + 1) * i]]))
        down.append(full_d[:, tp_rank * i:(tp_rank + 1) * i])
    return torch.stack(gate_up), torch.stack(down)


KINDS = ("linear", "round_robin", "eplb")


def _placement(kind: str, moe_ep: int, moe_tp: int) -> ExpertPlacement:
    if kind != "eplb":
        return ExpertPlacement(E, moe_ep, moe_tp, kind)
    load = torch.tensor([[1.0 / (1 + e) for e in range(E)]])  # expert 0 the busiest: it gets replicas
    slots = rebalance(load, E + moe_ep, moe_ep)[0]
    assert slots.tolist().count(0) > 1
    return ExpertPlacement(E, moe_ep, moe_tp, slots=tuple(slots.tolist()))


def _moe_layer_job(ctx, presets):
    """Per layout: one MoE layer's output under each placement, with the ordered mode on and off. The tokens are the
    attention-DP group's (replicated over attention TP); the shared-expert partial is this rank's own."""
    out = {}
    for preset in presets:
        for kind in KINDS:
            lay = layout(*preset)
            groups = ctx.groups(lay)
            c = groups.coords
            placement = _placement(kind, lay.moe_ep, lay.moe_tp)
            disp = make_dispatcher(groups, placement)
            gen = torch.Generator().manual_seed(10 + c.attn_dp_rank)
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(TOKENS)])
            weights = torch.rand(TOKENS, K, generator=gen)
            x = _randn(TOKENS, H, seed=100 + c.attn_dp_rank)
            shared = _randn(TOKENS, H, seed=300 + ctx.rank, scale=0.1)
            wgu, wd = _expert_shards(placement, c.moe_ep_rank, c.moe_tp_rank)
            for ordered in (True, False):
                groups.mode.ordered = ordered
                try:
                    inp, meta = disp.dispatch(x, ids, weights)
                    assert inp.unsummed == ordered  # moe_ep > 1 in every layout here
                    out[(preset, kind, ordered)] = disp.combine(invariant.moe_experts(inp, wgu, wd), meta, shared)
                finally:
                    groups.mode.ordered = False
    return {(preset, ordered, kind): (torch.equal(out[(preset, "linear", ordered)], out[(preset, kind, ordered)]),
                                      tuple(out[(preset, kind, ordered)].shape),
                                      _relative_gap(out[(preset, "linear", ordered)], out[(preset, kind, ordered)]))
            for preset in presets for ordered in (True, False) for kind in KINDS[1:]}


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def test_moe_layer_output_does_not_depend_on_the_placement(pool):
    results = pool.run(_moe_layer_job, LAYOUTS)
    for preset in LAYOUTS:
        for kind in KINDS[1:]:
            assert all(r[(preset, True, kind)][:2] == (True, (TOKENS, H)) for r in results), (preset, kind)
            assert all(r[(preset, False, kind)][2] < 2**-5 for r in results), (preset, kind)  # bf16 rounding only
    # flag off the grouping of the additions follows the placement: some layout's output moves with it
    assert any(not r[(preset, False, kind)][0] for r in results for preset in LAYOUTS for kind in KINDS[1:])


def test_unsummed_outputs_are_refused_by_a_kernel_set_that_is_not_batch_invariant():
    from model.kernel_select import check_unsummed, reference_kernels
    from parallelism.dispatch_base import ExpertInput

    inp = ExpertInput(torch.zeros(2, H), torch.zeros(2, K, dtype=torch.long), torch.ones(2, K), unsummed=True)
    with pytest.raises(ValueError, match="not batch-invariant"):
        check_unsummed(inp, reference_kernels())
