"""Expert load recording (``model/expert_load.py``) and the held-out placement bench built on it (``bench/eplb.py``)."""

import pytest
import torch

from bench.eplb import heldout_rows, skew_router
from model.batch import ForwardBatch
from model.expert_load import ExpertLoad, record_load
from model.loader import load_model
from model.moe import MoE
from parallelism.comm import build_groups
from parallelism.layout import Layout

SEQS = [[5, 17, 3, 99, 150, 7], [2, 4, 8, 16], [200, 1, 77]]


def _model(path):
    return load_model(path, build_groups(Layout()))


def test_the_load_is_every_routing_choice_counted_per_layer(tiny_ckpts):
    model = _model(tiny_ckpts["tiny_deepseek"])
    routed = []
    hooks = [m.gate.register_forward_hook(lambda mod, a, out: routed.append(out[0].reshape(-1)))
             for m in model.modules() if isinstance(m, MoE)]
    load = record_load(model, SEQS)
    for h in hooks:
        h.remove()
    layers = len(hooks)
    top_k = model.cfg.moe.top_k
    assert load.shape == (layers, model.cfg.moe.num_experts)
    assert load.sum(dim=1).tolist() == [sum(map(len, SEQS)) * top_k] * layers
    want = torch.stack([torch.bincount(torch.cat(routed[i::layers]), minlength=load.shape[1]) for i in range(layers)])
    assert torch.equal(load, want)


def test_a_disarmed_counter_counts_nothing(tiny_ckpts):
    model = _model(tiny_ckpts["tiny_qwen3_moe"])
    load = ExpertLoad(model)
    load.armed = False
    with torch.no_grad():
        model(ForwardBatch.from_sequences(SEQS[:1]))
    assert load.counts.sum() == 0
    load.remove()


def test_the_heldout_bench_rows_and_the_synthetic_skew(tiny_ckpts):
    model = _model(tiny_ckpts["tiny_deepseek"])
    before = record_load(model, SEQS).double()
    skew_router(model, exponent=1.2, scale=5.0)  # a bias far above the sigmoid scores: the same top-k for every row
    after = record_load(model, SEQS).double()
    assert (after.max(dim=1).values / after.mean(dim=1) > before.max(dim=1).values / before.mean(dim=1)).all()
    result = heldout_rows(model, SEQS[:2], SEQS[2:], moe_ep=4, redundant=(0, 4))
    assert [(r["placement"], r["redundant"]) for r in result["rows"]] == [
        ("linear", 0), ("rebalanced on fit", 0), ("rebalanced on fit", 4)]
    assert all(0 < b <= 1 for r in result["rows"] for b in r["heldout"] + r["in_sample"])
    with pytest.raises(ValueError, match="DeepSeek-style router"):
        skew_router(_model(tiny_ckpts["tiny_qwen3_moe"]), exponent=1.2, scale=0.3)
