"""The engine's expert load (``engine.expert_load``): every token a step feeds is counted once per routing choice,
whatever the layout — under attention TP once per group (not once per rank), under attention DP summed over the
groups, a static step's padding rows never — and warm-up's traffic is not counted. Five prompts of different lengths
(an odd batch: static steps pad), 6 new tokens each, on the trained tiny_kimi target with static steps on, after
``Engine.warm_up``: each MoE layer's count is exactly ``(prompt tokens + 5 per request) x top_k``."""

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.snapshot import expert_load
from engine.worker.loop import make_runner, worker_loop
from model.loader import load_model
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
NEW_TOKENS = 6
pytestmark = pytest.mark.engine


def _load_job(ctx, preset, prompts):
    model = load_model(ZOO / "target", ctx.groups(layout(preset)), torch.bfloat16)
    cfg = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=16,
                            num_blocks=128, static_steps="on", expert_load=True)
    if ctx.rank != 0:
        worker_loop(make_runner(model, cfg))
        return None
    engine = Engine(model, cfg)
    engine.warm_up()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_work():
        engine.step()
    load = expert_load(engine)
    engine.shutdown()
    return load, model.cfg.moe.top_k, engine.stats.step_kinds


@pytest.mark.parametrize("preset", ["ep8", "dp8_ep8", "tp2xdp4_ep8"])
def test_every_fed_token_is_counted_once_per_choice(pool, preset):
    prompts = [p["ids"][:n] for p, n in zip(json.loads((ZOO / "eval_prompts.json").read_text())["prompts"],
                                            (30, 17, 41, 9, 25), strict=False)]
    load, top_k, kinds = pool.run(_load_job, preset, prompts)[0]
    fed = sum(map(len, prompts)) + len(prompts) * (NEW_TOKENS - 1)
    assert kinds.get("decode", 0) > 0  # static decode steps ran (their padding is what must not count)
    assert [sum(row) for row in load["tokens_per_expert"]] == [fed * top_k] * len(load["tokens_per_expert"])
    assert all(0 < b <= 1 for b in load["balancedness"]) and load["moe_ep"] == 8
    assert [round(sum(r)) for r in load["rank_tokens"]] == [fed * top_k] * len(load["rank_tokens"])
