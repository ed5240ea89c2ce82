"""Expert placement against held-out traffic: record the expert load of one set of prompts, place the experts on it
(:func:`parallelism.eplb.rebalance`), and measure the balancedness the placement gives on *other* prompts — what a
placement computed from a past window is worth on the traffic that follows it (``scripts/bench_eplb.py``)."""

from __future__ import annotations

import torch
from torch import nn

from model.expert_load import record_load
from model.moe import MoE
from parallelism.eplb import balancedness, rebalance
from parallelism.layout import ExpertPlacement


def skew_router(model: nn.Module, exponent: float, scale: float, seed: int = 0) -> None:
    """A synthetic skew (labelled as such wherever it is reported): adds a Zipf-shaped bias ``scale * (1 + rank)^-
    exponent`` over a seeded random order of the experts to each MoE layer's choice bias (DeepSeek-style routers'
    ``e_score_correction_bias``: it moves which experts are chosen, not their weights)."""
    gen = torch.Generator().manual_seed(seed)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        bias = moe.gate.e_score_correction_bias
        if bias is None:
            raise ValueError("skew_router needs a DeepSeek-style router (e_score_correction_bias)")
        order = torch.randperm(bias.numel(), generator=gen)
        bias.data[order] += scale * (1.0 + torch.arange(bias.numel(), dtype=bias.dtype)) ** -exponent


def heldout_rows(model: nn.Module, fit: list[list[int]], heldout: list[list[int]], moe_ep: int,
                 redundant: tuple[int, ...]) -> dict:
    """Per-layer balancedness on ``heldout``'s load at EP ``moe_ep``: the ``linear`` placement, and per count of
    redundant slots the placement rebalanced on ``fit``'s load (and its balancedness on ``fit`` itself)."""
    fit_load, test_load = record_load(model, fit).double(), record_load(model, heldout).double()
    layers, experts = test_load.shape
    linear = torch.tensor(ExpertPlacement(experts, moe_ep, 1).phy2log).repeat(layers, 1)
    rows = [{"placement": "linear", "redundant": 0, "heldout": balancedness(test_load, linear, moe_ep).tolist(),
             "in_sample": balancedness(fit_load, linear, moe_ep).tolist()}]
    for r in redundant:
        slots = rebalance(fit_load, experts + r, moe_ep)
        rows.append({"placement": "rebalanced on fit", "redundant": r,
                     "heldout": balancedness(test_load, slots, moe_ep).tolist(),
                     "in_sample": balancedness(fit_load, slots, moe_ep).tolist()})
    hot = (test_load.max(dim=1).values / test_load.mean(dim=1)).tolist()
    return {"moe_ep": moe_ep, "fit_tokens": sum(map(len, fit)), "heldout_tokens": sum(map(len, heldout)),
            "busiest_expert_over_mean": hot, "rows": rows}
