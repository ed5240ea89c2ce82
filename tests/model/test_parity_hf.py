"""Every layout computes HF transformers' logits on the same tiny checkpoint (fp32, rel. error <= 1e-5).

Comparisons are close, not bit-exact: sharded GEMMs and all-reduces sum in a different order.
"""

import pytest
import torch

from model.forward import full_logits
from model.loader import load_model
from model.tiny import load_hf
from tests.support.layouts import PRESETS, layout

SEQS = [[5, 17, 3, 99, 150, 7, 64, 31, 8, 202, 11], [2, 4, 6], [200, 1, 77, 90, 13, 45, 46], [9]]
LAYOUTS = [layout(p) for p in PRESETS] + [
    layout("dp8_ep8", "dispatcher=allgather"),
    layout("ep8", "placement=round_robin"),
    layout("dp8_ep8", "placement=round_robin"),
    layout("tp2xdp4_ep8", "attn_tp=4", "attn_dp=2", "dispatcher=allgather", "moe_tp=2", "moe_ep=4"),
    layout("ep8", "dispatcher=alltoall"),
]


@pytest.fixture(scope="module")
def hf_logits(tiny_ckpts):
    out = {}
    for name, path in tiny_ckpts.items():
        hf = load_hf(path)
        with torch.no_grad():
            out[name] = [hf(torch.tensor([s])).logits[0] for s in SEQS]
    return out


def _run(ctx, lay, path, seqs):
    if ctx.rank >= lay.world_size:
        return None
    model = load_model(path, ctx.groups(lay))
    return full_logits(model, seqs)


def _run_all(ctx, lay, path, seqs):
    return _run(ctx, lay, path, seqs) if lay.world_size == ctx.world_size else (
        _run_single(lay, path, seqs) if ctx.rank == 0 else None)


def _run_single(lay, path, seqs):
    from parallelism.comm import build_groups

    return full_logits(load_model(path, build_groups(lay)), seqs)


@pytest.mark.parametrize("ckpt", ["tiny_deepseek", "tiny_qwen3_moe"])
@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.describe())
def test_layout_matches_hf(pool, tiny_ckpts, hf_logits, ckpt, lay):
    ours = pool.run(_run_all, lay, tiny_ckpts[ckpt], SEQS)[0]
    for got, ref in zip(ours, hf_logits[ckpt], strict=True):
        assert got.shape == ref.shape
        rel = (got - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-5, f"{lay.describe()}: relative logit error {rel:.2e}"


def test_fewer_sequences_than_dp_ranks(pool, tiny_ckpts, hf_logits):
    ours = pool.run(_run_all, layout("dp8_ep8"), tiny_ckpts["tiny_deepseek"], SEQS[:3])[0]
    assert len(ours) == 3
    for got, ref in zip(ours, hf_logits["tiny_deepseek"][:3], strict=True):
        assert (got - ref).abs().max() / ref.abs().max() <= 1e-5
