"""Where the experts sit changes no token: with ``engine.batch_invariant=true`` the trained tiny_kimi pair gives the
same tokens and log-probs under the ``linear`` and the ``round_robin`` expert placement (most experts on another rank)
and under an EPLB placement (per layer its own map, one redundant slot per rank: replicas of the loaded experts, a
token's choices spread over them) for a batch of 4 prompts greedy and the same 4 seeded at T=1, plain decoding and
DDTree, under ``ep8`` (allreduce), ``dp8_ep8`` (all-to-all) and ``tp2_ep4`` (each expert split over two ranks). This
is the property an expert load balancer needs to move experts while serving without changing a bit (the pairwise
combine: ``parallelism/dispatch_base.py``). The INT4 and FP8 tiny checkpoints the same under ``ep8``, plain
decoding. One rank-pool job per case."""

import dataclasses
import json

import pytest
import torch

from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.loop import make_runner, worker_loop
from model.config import load_config
from model.loader import load_model
from parallelism.eplb import rebalance
from parallelism.layout import Layout
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation
from tests.e2e.test_batch_invariance import invariant_cfg
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
NEW_TOKENS = 12
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(),
                                 reason="the trained tiny_kimi pair is absent")]


def _requests(prompts: list[list[int]]) -> list[tuple[str, list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [(f"{name}{i}", p, params) for name, params in (("g", greedy), ("s", seeded)) for i, p in enumerate(prompts)]


def eplb_layout(base: Layout, path) -> Layout:
    """``base`` with a per-layer EPLB placement for the checkpoint at ``path``: a skewed load (expert e of layer l
    weighted ``1 / (1 + (e + 5 l) mod E)``), rebalanced over ``E + moe_ep`` slots (one redundant slot per rank)."""
    cfg = load_config(path)
    e, layers = cfg.moe.num_experts, sum(cfg.moe_layers)
    load = torch.tensor([[1.0 / (1 + (x + 5 * layer) % e) for x in range(e)] for layer in range(layers)])
    slots = rebalance(load, e + base.moe_ep, base.moe_ep)
    return dataclasses.replace(base, expert_slots=tuple(tuple(row) for row in slots.tolist()))


PLACEMENTS = ("linear", "round_robin", "eplb", "rebalanced")
# the balancer on, reading a window and rebalancing every 3 steps (coupled DDTree takes the 12 tokens in few steps),
# every layer that changes moved (one per step);
# with engine.overlap on (plain decoding overlaps; DDTree steps drain): the engine makes the boundaries moves need;
# the EP ranks taken as two nodes: each of tiny_kimi's 4 expert groups keeps its replicas on one node
REBALANCING = dict(eplb_enabled=True, eplb_window_steps=3, eplb_interval_steps=3, eplb_min_gain=0.0, overlap="on",
                   eplb_num_nodes=2)


def _placements_job(ctx, preset, path, dtype, methods, prompts):
    """Per placement and method: every request's (tokens, log-probs), the batch submitted together (rank 0)."""
    out = {}
    requests = _requests(prompts)
    for kind in PLACEMENTS:
        moved = kind in ("eplb", "rebalanced")
        lay = eplb_layout(layout(preset), path) if moved else layout(preset, f"placement={kind}")
        model = load_model(path, ctx.groups(lay), dtype)
        cfg = invariant_cfg().replace(**REBALANCING) if kind == "rebalanced" else invariant_cfg()
        for method in methods:
            drafter = str(ZOO / "drafter")
            spec = SpecConfig() if method == "none" else SpecConfig("ddtree", budget=16, drafter_path=drafter)
            speculation = load_speculation(spec, model)
            if ctx.rank != 0:
                worker_loop(make_runner(model, cfg, speculation))
                continue
            engine = Engine(model, cfg, speculation=speculation)
            got = {rid: ([], []) for rid, _, _ in requests}
            for rid, prompt, params in requests:
                engine.add_request(rid, prompt, params)
            while engine.has_work():
                for o in engine.step():
                    got[o.request_id][0].extend(o.new_tokens)
                    got[o.request_id][1].extend(o.new_logprobs)
            engine.shutdown()
            out[(kind, method)] = got
            if engine.balancer is not None:
                out[("moves", method)] = engine.balancer.stats
                out[("figures", method)] = engine.last_record.eplb  # what /metrics shows
    return out if ctx.rank == 0 else None


def _assert_same(out: dict, methods: tuple[str, ...]) -> None:
    for method in methods:
        linear = out[("linear", method)]
        assert all(len(tokens) == NEW_TOKENS == len(lps) for tokens, lps in linear.values())
        for kind in PLACEMENTS[1:]:
            assert out[(kind, method)] == linear, (kind, method)
        moves = out[("moves", method)]
        assert moves.rebalances >= 2 and moves.layers_moved >= 2 and moves.moved_bytes > 0, moves
        figures = out[("figures", method)]
        assert (figures["rebalances"], figures["moved_bytes"]) == (moves.rebalances, moves.moved_bytes)
        assert len(figures["balancedness"]) == len(moves.windows[-1]["at_start_placement"])


@pytest.mark.parametrize("preset", ["ep8", "dp8_ep8", "tp2_ep4"])
def test_tokens_and_logprobs_do_not_depend_on_where_the_experts_sit(pool, preset):
    prompts = [p["ids"][:40] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:4]]
    methods = ("none", "ddtree")
    _assert_same(pool.run(_placements_job, preset, ZOO / "target", torch.bfloat16, methods, prompts)[0], methods)


@pytest.mark.parametrize("ckpt", ["kimi_k25_int4", "deepseek_fp8"])
def test_quantized_experts_do_not_depend_on_where_they_sit(pool, quant_ckpts, ckpt):
    """The quantized MoE kernels return unsummed pairs too (their scales travel with their experts' slots)."""
    from tests.engine.test_engine import PROMPTS

    out = pool.run(_placements_job, "ep8", quant_ckpts[ckpt][0], torch.float32, ("none",), PROMPTS[:4])[0]
    _assert_same(out, ("none",))
