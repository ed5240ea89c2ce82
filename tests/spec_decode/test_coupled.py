"""Coupled drafting (``spec_decode.coupled``): a sampled request's drafts are ranked by the sampler's own scores at
the output index each depth proposes, so where the target's logits are the drafter's every draft is the sampler's
draw — and an index off by one in either direction loses that. The verifier is unchanged: speculation at T > 0
gives plain decoding's tokens and log-probs, in mixed greedy / sampled batches, static steps on, batch-invariant,
under single, tp8 and dp8_ep8. On the trained tiny_kimi pair coupling raises τ at T = 1 (docs/sampling.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.sampling import logits_processors
from engine.sampling.logits_processors import Rows, SamplingState, TreeSampling
from engine.step import SeqWork
from spec_decode import static_draft
from spec_decode.config import SpecConfig
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"

# sampled rows with every filter, a logit bias and min_tokens (path-independent processors: exact on a drafter row),
# and a greedy row, which coupling leaves alone
PARAMS = [SamplingParams(temperature=1.0, top_p=0.95, seed=7),
          SamplingParams(temperature=0.6, top_k=40, min_p=0.02, seed=8, min_tokens=30, max_tokens=64,
                         logit_bias=((3, 2.5),)),
          SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.0, top_p=0.9, top_k=100, seed=2**63 + 5)]


def _speculator(tiny_ckpts, drafter_path, method: str):
    """A DFlash chain or a DDTree (budget 12 over 4 depths, so sharp — both tree temperatures 0.2 — that its best
    path comes whole before any branch) over the tiny DeepSeek target, a paged cache of 24 4-token blocks."""
    from engine.worker.kv_cache import KVSpec, PagedKVCache
    from model.loader import load_model
    from parallelism.comm import build_groups
    from spec_decode.decoder import SpeculativeDecoder
    from spec_decode.dflash import DFlashDrafter

    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    cache = PagedKVCache(KVSpec.for_model(model), 24, 4)
    cfg = SpecConfig(method, budget=12, block_size=5, drafter_path=drafter_path, tree_temperature=0.2,
                     coupled_tree_temperature=0.2)
    return SpeculativeDecoder(model, DFlashDrafter.load(drafter_path), cfg, cache)


def _requests(spec) -> tuple[list[SeqWork], SamplingState]:
    """Four requests with drafter context of different lengths, bound to a sampling state of their own."""
    gen, width = torch.Generator().manual_seed(5), len(spec.feature_layers) * spec.model.cfg.hidden_size
    work = []
    for i, (n, blocks) in enumerate(((3, [4, 9]), (9, [1, 12, 6, 0]), (6, [8, 3, 10]), (7, [2, 5, 11]))):
        w = SeqWork(request_id=str(i), token_ids=[20 + i], start=n, block_table=blocks, sample=True, params=PARAMS[i],
                    seed=PARAMS[i].seed or 0, num_generated=3 + 5 * i, decode=True, spec=True)
        spec.add_context(w, torch.randn(n, width, generator=gen), 0)
        work.append(w)
    state = SamplingState(spec.model.cfg.vocab_size, (1,), spec.cache.device)
    return state.bind(work), state


def _draws(state: SamplingState, work: list[SeqWork], logits: torch.Tensor) -> torch.Tensor:
    """``[J, D']``: the sampler's pick (processors, filters, noise) at output index ``num_generated + r`` — plain
    decoding's draw there — over the drafter's own logits ``[J, D', V]`` of row r, as if they were the target's."""
    j, d, vocab = logits.shape
    slots = [w.slot for w in work for _ in range(d)]
    index = torch.tensor([w.num_generated + r for w in work for r in range(d)])
    return state.sample(logits.reshape(j * d, vocab), Rows(slots, torch.tensor(slots), index)).tokens.view(j, d)


def _shift(monkeypatch, offset: int) -> None:
    """Shifts the output index every drafter row is coupled to by ``offset`` (dynamic and static drafting)."""
    real = logits_processors.draft_output_index

    def shifted(num_generated, rows):
        return real(num_generated, rows) + offset
    monkeypatch.setattr(logits_processors, "draft_output_index", shifted)
    monkeypatch.setattr(static_draft, "draft_output_index", shifted)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_drafts_are_the_samplers_draws_where_the_target_is_the_drafter(tiny_ckpts, random_drafter, method,
                                                                       monkeypatch):
    """With the drafter's logits as the target's, the coupled chain (DFlash; DDTree's best path) is the sampler's
    draw at every depth of every sampled row: the walk under the sampler's picks accepts every depth. The static
    draft step (noise and filters on the device) drafts the same trees. Shifting the coupled index by one either
    way loses it: the walk then accepts fewer than half the depths (which pins the index convention). Greedy rows
    draft their argmax chain either way."""
    from spec_decode.static_draft import StaticDraft
    from spec_decode.tree import DraftTree, tree_paths, walk

    spec = _speculator(tiny_ckpts, random_drafter, method)
    work, state = _requests(spec)
    logits = spec.draft_logits(work)  # [J, D', V]
    draws = _draws(state, work, logits)
    depth, sampled = logits.shape[1], [w.params.temperature > 0 for w in work]
    for offset in (0, 1, -1):
        with monkeypatch.context() as m:
            _shift(m, offset)
            trees = spec.draft(work, TreeSampling(state))[0]
            static = StaticDraft(spec, batch=5, max_blocks=4, scratch_blocks=(23, 22))
            # the static step has no logits processors (docs/sampling.md): compared on the rows without any
            plain = [w for w in work if not w.params.logit_bias and not w.params.min_tokens]
            static.load(plain)
            _, tokens, parents, depths, valid, _ = static.run()
        for j, w in enumerate(plain):  # the same prefixes but at a near-tie on the budget's edge: the two builders
            # sum log-probs in other orders (seen under the baseline CPU code path: one prefix swapped for another)
            static_tree = DraftTree(tokens[j], parents[j], depths[j], valid[j])
            swapped = tree_paths(static_tree) ^ tree_paths(trees[w.request_id])
            assert len(swapped) <= 2, (offset, w.request_id, swapped)
        accepted = []
        for j, w in enumerate(work):
            tree = trees[w.request_id]
            # the pick at a node of depth d draws index num_generated + d: row d's draw (the deepest: unused)
            picks = torch.cat([draws[j], draws[j, -1:]])[tree.depth]
            accepted.append(int(walk(tree, picks).sum()) - 1)
        assert [a for a, s in zip(accepted, sampled, strict=True) if not s] == [depth], (offset, accepted)
        coupled = [a for a, s in zip(accepted, sampled, strict=True) if s]
        if offset == 0:
            assert coupled == [depth] * len(coupled), accepted
        else:
            assert sum(coupled) < 0.5 * depth * len(coupled), (offset, accepted)


def test_greedy_rows_and_coupled_off_draft_as_before(tiny_ckpts, random_drafter):
    """A greedy request drafts the same tree in a batch with sampled ones as alone, coupled or not; with
    ``coupled=False`` a sampled request drafts the drafter's most probable tokens (the tree without a sampler)."""
    for method in ("dflash", "ddtree"):
        spec = _speculator(tiny_ckpts, random_drafter, method)
        work, state = _requests(spec)
        coupled = spec.draft(work, TreeSampling(state))[0]
        bare = spec.draft(work)[0]
        spec.cfg = dataclasses.replace(spec.cfg, coupled=False)
        off = spec.draft(work, TreeSampling(state))[0]
        for w in work:
            same = torch.equal(coupled[w.request_id].tokens, bare[w.request_id].tokens)
            assert same == (w.params.temperature == 0) or w.params.temperature > 0 and not same
            assert torch.equal(off[w.request_id].tokens, bare[w.request_id].tokens)


# ----------------------------------------------------------------------------------------------- end to end

CFG = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=256,
                        batch_invariant=True)


def _mixed_requests(prompts: list[list[int]], max_tokens: int) -> list:
    """A greedy row, seeded T=1 / top-p 0.95, T=0.6 with top-k and min-p, T=1 with a repetition penalty, an unseeded
    T=1 row (seeded by the engine), and n=2 at T=0.6 / top-p 0.95 (each sample its own seed)."""
    kw = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    params = [SamplingParams(temperature=0.0, **kw), SamplingParams(temperature=1.0, top_p=0.95, seed=3, **kw),
              SamplingParams(temperature=0.6, top_k=20, min_p=0.05, seed=4, **kw),
              SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.3, seed=5, **kw),
              SamplingParams(temperature=1.0, top_p=0.95, **kw),
              SamplingParams(temperature=0.6, top_p=0.95, seed=6, n=2, **kw)]
    return [(str(i), prompts[i % len(prompts)], p) for i, p in enumerate(params)]


def _engine_job(ctx, lay, path, requests, arms, cfg):
    """Each arm (SpecConfig, static steps) on a fresh engine over ``requests``; rank 0 returns per arm ``{(id,
    index): (tokens, log-probs, top log-probs)}`` and τ."""
    from engine.engine import Engine
    from engine.worker.loop import make_runner, worker_loop
    from model.loader import load_model
    from parallelism.comm import build_groups
    from spec_decode.speculation import load_speculation

    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(path, ctx.groups(lay) if lay.world_size > 1 else build_groups(lay))
    out = []
    for spec, static in arms:
        speculation, arm_cfg = load_speculation(spec, model), cfg.replace(static_steps=static)
        if ctx.rank != 0:
            worker_loop(make_runner(model, arm_cfg, speculation))
            continue
        engine, got = Engine(model, arm_cfg, speculation=speculation), {}
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        while engine.has_work():
            for o in engine.step():
                toks, lps, tops = got.setdefault((o.request_id, o.index), ([], [], []))
                toks += o.new_tokens
                lps += o.new_logprobs
                tops += o.new_top_logprobs
        out.append((got, engine.stats.acceptance_length if spec.enabled else 1.0, engine.scheduler.blocks_in_use()))
        engine.shutdown()
    return out if ctx.rank == 0 else None


def _arms(drafter: str, block: int, budget: int, static: str = "on") -> list:
    return [(SpecConfig(), static), (SpecConfig("dflash", block_size=block, drafter_path=drafter), static),
            (SpecConfig("ddtree", budget=budget, block_size=block, drafter_path=drafter, tree_temperature=0.5), static)]


@pytest.mark.parametrize("preset", ["single", "tp8", "dp8_ep8"])
def test_coupled_speculation_gives_plain_tokens_and_logprobs(pool, tiny_ckpts, random_drafter, preset):
    """DFlash and DDTree, coupled, static steps on, batch-invariant: every row of a mixed greedy / sampled batch
    (filters, a repetition penalty, an engine-seeded row, n=2) gets plain decoding's tokens and log-probs, bit for
    bit; single rank also with static steps off (the dynamic draft path)."""
    prompts = [[5, 17, 3, 99, 150, 7, 64, 31], [2, 4, 6], [200, 1, 77, 90, 13]]
    arms = _arms(random_drafter, 5, 12)
    if preset == "single":
        arms += _arms(random_drafter, 5, 12, "off")[1:]
    out = pool.run(_engine_job, layout(preset), tiny_ckpts["tiny_deepseek"], _mixed_requests(prompts, 12), arms,
                   CFG)[0]
    plain = out[0][0]
    assert len(plain) == 7
    for (got, tau, blocks), (spec, static) in zip(out, arms, strict=True):
        assert got == plain, (spec.method, static, [k for k in got if got[k] != plain[k]])
        assert blocks == 0 and tau >= 1.0


@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
def test_coupling_raises_acceptance_on_the_trained_pair(pool):
    """On held-out code at T=1 / top-p 0.95 (static steps on), coupled DFlash and DDTree accept more per step than
    uncoupled ones, and all four give plain decoding's tokens and log-probs."""
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:2]]
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=32, ignore_eos=True, logprobs=1)
    requests = [(str(i), p, SamplingParams(seed=40 + i, **kw)) for i, p in enumerate(prompts)]
    drafter = str(ZOO / "drafter")
    arms = _arms(drafter, 9, 16)
    arms += [(dataclasses.replace(spec, coupled=False), static) for spec, static in arms[1:]]
    cfg = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, block_size=16,
                            num_blocks=256, batch_invariant=True)
    out = pool.run(_engine_job, layout("single"), str(ZOO / "target"), requests, arms, cfg)[0]
    plain = out[0][0]
    assert all(got == plain for got, _, _ in out)
    (_, chain, _), (_, tree, _), (_, chain_off, _), (_, tree_off, _) = out[1:]
    assert chain > 1.2 * chain_off and tree > 1.2 * tree_off, (chain, chain_off, tree, tree_off)
