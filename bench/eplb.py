"""Expert placement against held-out traffic: record the expert load of one set of prompts, place the experts on it
(:func:`parallelism.eplb.rebalance`), and measure the balancedness the placement gives on *other* prompts — what a
placement computed from a past window is worth on the traffic that follows it (``scripts/bench_eplb.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.snapshot import expert_load
from engine.worker.loop import make_runner, worker_loop
from model.expert_load import record_load
from model.loader import load_model
from model.moe import MoE
from parallelism.comm import build_groups
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


def serving_rank(rank: int, layout, engine_keys: dict, prompts: list[list[int]], max_tokens: int, out: str) -> None:
    """One rank of a serving run (``parallelism.launch``): the tiny_kimi target in bf16 under ``layout`` with
    ``engine_keys`` (``EngineConfig.flat``), every prompt submitted at once, greedy; rank 0 writes ``out``: the
    tokens, every step's wall seconds and whether a layer moved before it, the expert load at the end."""
    torch.set_num_threads(1)
    model = load_model(Path(__file__).resolve().parent.parent / "model/zoo/tiny_kimi/target", build_groups(layout),
                       torch.bfloat16)
    cfg = EngineConfig.flat(**engine_keys)
    if rank != 0:
        worker_loop(make_runner(model, cfg))
        return
    engine = Engine(model, cfg)
    engine.warm_up()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = []
    while engine.has_work():
        moved = engine.balancer.stats.layers_moved if engine.balancer else 0
        for o in engine.step():
            tokens[o.request_id] += o.new_tokens
        r = engine.last_record
        steps.append({"kind": str(r.kind), "wall_s": r.wall_s,
                      "moved": (engine.balancer.stats.layers_moved if engine.balancer else 0) - moved})
    load = expert_load(engine)
    engine.shutdown()
    Path(out).write_text(json.dumps({"tokens": [tokens[str(i)] for i in range(len(prompts))], "steps": steps,
                                     "expert_load": load}))


def step_percentiles(steps: list[dict], kind: str = "decode") -> dict:
    """p50 / p99 / max wall milliseconds of the ``kind`` steps, over all of them and over those a move preceded."""
    def pct(xs: list[float]) -> dict:
        if not xs:
            return {"steps": 0}
        t = torch.tensor(xs) * 1e3
        return {"steps": len(xs), "p50_ms": t.quantile(0.5).item(), "p99_ms": t.quantile(0.99).item(),
                "max_ms": t.max().item()}
    mine = [s for s in steps if s["kind"].endswith(kind)]
    return {"all": pct([s["wall_s"] for s in mine]), "with_a_move": pct([s["wall_s"] for s in mine if s["moved"]])}


def projections(static: float, balanced: float, batches: dict[str, tuple[int, ...]], context: int = 4096) -> list:
    """The cost model's decode tokens/s for Kimi K2.x (INT4 experts) at two balancedness values (mean ÷ max tokens
    per EP rank; :func:`bench.cost.formulas.project`), per box, layout and batch: a projection, not a measurement."""
    from bench.cost.formulas import project
    from bench.cost.hardware import HARDWARE
    from bench.cost.shapes import KIMI_K2_INT4

    rows = []
    for box in ("h200", "rtx_pro_6000"):
        for layout, sizes in batches.items():
            for batch in sizes:
                a, b = (project(layout, HARDWARE[box], KIMI_K2_INT4, batch, context, balancedness=x)
                        for x in (static, balanced))
                rows.append({"hardware": box, "layout": layout, "batch": batch, "tok_s_static": a.tok_s,
                             "tok_s_balanced": b.tok_s, "ratio": b.tok_s / a.tok_s, "bound_static": a.bound,
                             "compute_ms_static": a.compute_s * 1e3, "memory_ms": a.memory_s * 1e3})
    return rows
