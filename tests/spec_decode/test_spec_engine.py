"""Speculative decoding in the engine is lossless under single, tp8 and dp8_ep8: DFlash and DDTree give
plain decoding's tokens at T=0, and — thanks to the counter-based sampler — the same seeded tokens at T=1."""

import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.step import SeqWork
from engine.worker.loop import make_runner, worker_loop
from model.kernel_select import native_bf16_matmul
from model.loader import load_model
from parallelism.comm import build_groups
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation
from tests.engine.test_engine import run_requests
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

PROMPTS = [[5, 17, 3, 99, 150, 7, 64, 31], [2, 4, 6], [200, 1, 77, 90, 13]]
CFG = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=256)


def _job(ctx, lay, path, prompts, spec_list, params, cfg=CFG):
    """Runs ``prompts`` once per spec config on fresh engines; rank 0 returns (tokens, τ, blocks in use)."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(path, ctx.groups(lay) if lay.world_size > 1 else build_groups(lay))
    results = []
    for spec in spec_list:
        speculation = load_speculation(spec, model)
        if ctx.rank != 0:
            worker_loop(make_runner(model, cfg, speculation))
            continue
        engine = Engine(model, cfg, speculation=speculation)
        res = run_requests(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
        results.append((res, engine.stats.acceptance_length, engine.scheduler.blocks_in_use()))
        engine.shutdown()
    return results


def specs(drafter):
    """Plain, DFlash drafting through the target's fp32 LM head, DDTree drafting through a bf16 copy of it."""
    return [SpecConfig(), SpecConfig("dflash", block_size=5, drafter_path=drafter, draft_head_dtype="target"),
            SpecConfig("ddtree", budget=12, block_size=5, drafter_path=drafter, tree_temperature=0.5,
                       draft_head_dtype="bfloat16")]


@pytest.mark.parametrize("preset", ["single", "tp8", "dp8_ep8", "tp2xdp4_ep8"])
def test_greedy_speculation_equals_plain(pool, tiny_ckpts, random_drafter, preset):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (plain, _, b0), (chain, tau_chain, b1), (tree, tau_tree, b2) = pool.run(
        _job, layout(preset), tiny_ckpts["tiny_deepseek"], PROMPTS, specs(random_drafter), params)[0]
    assert chain == plain and tree == plain
    assert tau_chain >= 1.0 and tau_tree >= 1.0
    assert b0 == b1 == b2 == 0


def test_seeded_sampling_speculation_equals_plain(pool, tiny_ckpts, random_drafter):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    (plain, _, _), (chain, _, _), (tree, _, _) = pool.run(
        _job, layout("dp8_ep8"), tiny_ckpts["tiny_deepseek"], PROMPTS, specs(random_drafter), params)[0]
    assert chain == plain and tree == plain


def static_steps(records) -> list[dict]:
    """Per rank, from the step records' per-rank coverage records: the steps of each kind its target step ran
    statically (eager here: "no CUDA device"), after checking that every rank reported the same target record for
    every step — a graph replay on one rank never meets a dynamic step on another."""
    counts = [{} for _ in records[0].graphs]
    for rec in (r for r in records if r.kind is not None):
        assert all(g[rec.kind] == rec.graphs[0][rec.kind] for g in rec.graphs), (rec.step_id, rec.graphs)
        for tally, graphs in zip(counts, rec.graphs, strict=True):
            if graphs[rec.kind] == (False, "no CUDA device"):
                tally[rec.kind] = tally.get(rec.kind, 0) + 1
    return counts


def _static_job(ctx, lay, path, prompts, spec_list, params, cfg=CFG):
    """Like ``_job`` with static steps on and off. Rank 0 returns per spec ((tokens, coverage, blocks, τ) on,
    (…) off) and, per spec with static steps on, every rank's static step counts by kind (:func:`static_steps`)."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(path, ctx.groups(lay) if lay.world_size > 1 else build_groups(lay))
    results, per_rank_steps = [], []
    for spec in spec_list:
        pair = []
        speculation = load_speculation(spec, model)
        for on_off in (cfg.replace(static_steps="on"), cfg):
            if ctx.rank != 0:
                worker_loop(make_runner(model, on_off, speculation))
                continue
            engine, records = Engine(model, on_off, speculation=speculation), []
            engine.subscribe(records.append)
            res = run_requests(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
            pair.append((res, engine.stats.coverage.summary(), engine.scheduler.blocks_in_use(),
                         engine.stats.acceptance_length))
            engine.shutdown()
            if engine.runner.static is not None:
                per_rank_steps.append(static_steps(records))
        results.append(pair)
    return (results, per_rank_steps) if ctx.rank == 0 else None


@pytest.mark.parametrize(("preset", "model"), [("single", "tiny_deepseek"), ("single", "tiny_qwen3_moe"),
                                               ("tp8", "tiny_deepseek"), ("dp8_ep8", "tiny_deepseek"),
                                               ("tp2xdp4_ep8", "tiny_deepseek")])
def test_static_steps_give_the_dynamic_tokens(pool, tiny_ckpts, random_drafter, preset, model):
    """Decode and verify through the fixed-shape static steps (the CUDA-graph path, run eagerly here) give the
    dynamic forward's tokens for plain, DFlash and DDTree decoding, the drafts coming from the static draft
    step (paged drafter context, tree built on the device); coverage says why nothing replayed. Every
    rank runs the same static steps — under dp8_ep8 the five attention-DP ranks without a request too (they
    pad a whole batch), so a graph replay on one rank never meets a dynamic step on another."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out, per_rank_steps = pool.run(_static_job, layout(preset), tiny_ckpts[model], PROMPTS, specs(random_drafter),
                                   params)[0]
    rank0_steps = [per_spec[0] for per_spec in per_rank_steps]
    for ((static, coverage, blocks, _), (dynamic, *_)), kind in zip(out, ("decode", "verify", "verify"), strict=True):
        assert static == dynamic and blocks == 0
        assert coverage[kind]["steps"] > 0 and coverage[kind]["replays"] == 0
        assert coverage[kind]["eager_reason"] == "no CUDA device"
        if kind == "verify":  # every verify step drafted and committed statically (eager here)
            for part in ("draft", "commit"):
                assert coverage[part]["steps"] == coverage["verify"]["steps"], coverage
                assert coverage[part]["eager_reason"] == "no CUDA device"
    assert out[1][0][0] == out[0][0][0]  # and speculation stays lossless on the static path
    assert [s.get(k, 0) > 0 for s, k in zip(rank0_steps, ("decode", "verify", "verify"), strict=True)] == [True] * 3
    assert all(per_spec == [per_spec[0]] * layout(preset).world_size for per_spec in per_rank_steps)


ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
ZOO_CFG = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, block_size=16,
                          num_blocks=256)


@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
@pytest.mark.parametrize("preset", ["single", "tp8", "dp8_ep8"])
def test_trained_pair_is_lossless_on_held_out_code(pool, preset):
    """The trained drafter accepts several tokens per step, so the walk and the KV compaction of deep paths run."""
    doc = json.loads((ZOO / "eval_prompts.json").read_text())
    prompts = [p["ids"] for p in doc["prompts"][:2]]
    drafter = str(ZOO / "drafter")
    spec_list = [SpecConfig(), SpecConfig("dflash", drafter_path=drafter),
                 SpecConfig("ddtree", budget=32, drafter_path=drafter)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (plain, _, b0), (chain, tau_chain, b1), (tree, tau_tree, b2) = pool.run(
        _job, layout(preset), str(ZOO / "target"), prompts, spec_list, params, ZOO_CFG)[0]
    assert chain == plain and tree == plain
    assert tau_chain > 1.3 and tau_tree > 1.3, (tau_chain, tau_tree)
    assert b0 == b1 == b2 == 0


@pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained tiny_kimi pair is absent")
def test_static_steps_walk_the_trained_pairs_deep_paths_at_t1(pool):
    """Static steps with the trained drafter: trees verified where the static draft left them, then sampled,
    walked and compacted on the device — several tokens per step, seeded T=1 with top-p, min_tokens bans
    lifting mid-tree — give the dynamic path's tokens, which are plain decoding's."""
    doc = json.loads((ZOO / "eval_prompts.json").read_text())
    prompts = [p["ids"] for p in doc["prompts"][:2]]
    drafter = str(ZOO / "drafter")
    spec_list = [SpecConfig(), SpecConfig("dflash", block_size=9, drafter_path=drafter),
                 SpecConfig("ddtree", budget=16, block_size=9, drafter_path=drafter, tree_temperature=0.33)]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=20, min_tokens=10)
    out, _ = pool.run(_static_job, layout("single"), str(ZOO / "target"), prompts, spec_list, params, ZOO_CFG)[0]
    plain = out[0][1][0]
    for (static, coverage, blocks, tau), (dynamic, *_) in out[1:]:
        assert static == dynamic == plain and blocks == 0
        assert coverage["verify"]["steps"] > 0
        assert coverage["draft"]["steps"] == coverage["commit"]["steps"] == coverage["verify"]["steps"]
        assert tau > 1.2, tau  # multi-token paths: the compaction moves KV
    assert all(len(toks) >= 10 for toks, _ in plain.values())


def _speculator(tiny_ckpts, drafter_path, num_blocks=12):
    """A Speculator (DDTree, budget 10, block 5) over the tiny DeepSeek target with a paged cache of 4-token
    blocks, and a seeded generator for target features."""
    from engine.worker.kv_cache import KVSpec, PagedKVCache
    from spec_decode.decoder import SpeculativeDecoder
    from spec_decode.dflash import DFlashDrafter

    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    cache = PagedKVCache(KVSpec.for_model(model), num_blocks, 4)
    spec = SpeculativeDecoder(model, DFlashDrafter.load(drafter_path), SpecConfig("ddtree", budget=10, block_size=5,
                                                                         drafter_path=drafter_path), cache)
    return spec, torch.Generator().manual_seed(3)


def _work(rid: str, bonus: int, start: int, blocks: list[int]) -> SeqWork:
    return SeqWork(request_id=rid, token_ids=[bonus], start=start, block_table=blocks, sample=True,
                   params=SamplingParams(), seed=0, num_generated=1, decode=True, spec=True)


def _same_tree(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_batched_drafting_equals_one_request_at_a_time(tiny_ckpts, random_drafter):
    """One drafter forward over several requests (concatenated contexts, each block seeing its own) drafts the
    same trees as drafting each request alone."""

    spec, gen = _speculator(tiny_ckpts, random_drafter)
    work = []
    for i, n in enumerate((3, 9, 5)):
        w = _work(str(i), 7 + i, n, [3 * i, 3 * i + 1, 3 * i + 2])
        spec.add_context(w, torch.randn(n, len(spec.feature_layers) * spec.model.cfg.hidden_size, generator=gen), 0)
        work.append(w)
    head = spec.draft_head  # draft_head_dtype "auto" on an fp32 target: a bf16 copy iff this CPU has bf16 matmul
    assert (head.dtype if head is not None else None) == (torch.bfloat16 if native_bf16_matmul("cpu") else None)
    together = spec.draft(work)[0]
    for w in work:
        assert _same_tree(spec.draft([w])[0][w.request_id], together[w.request_id])


def test_drafter_context_follows_the_block_table(tiny_ckpts, random_drafter):
    """The drafter's context is paged like the target's KV: the same 9 features written in three chunks
    (prefill 5, decode 1, an accepted path of 3) into blocks [2, 0, 6] of an otherwise empty store, or into
    blocks [5, 1, 3] whose slots held another request's rows before (blocks reused after it ended) while a
    third request writes its own blocks between the chunks — the draft logits are bit-identical, so only the
    request's own slots are ever read. Writing all 9 at once gives the same logits up to rounding: a matmul's
    last bits may depend on its row count (CPU BLAS picks kernels by shape), so that one is a tolerance."""
    spec_a, gen = _speculator(tiny_ckpts, random_drafter)
    spec_b, _ = _speculator(tiny_ckpts, random_drafter)
    spec_once, _ = _speculator(tiny_ckpts, random_drafter)
    width = len(spec_a.feature_layers) * spec_a.model.cfg.hidden_size
    feats = torch.randn(9, width, generator=gen)
    alone = _work("a", 11, 9, [2, 0, 6])
    spec_once.add_context(alone, feats, 0)
    reused = _work("a", 11, 9, [5, 1, 3])
    spec_b.add_context(_work("old", 4, 12, [5, 1, 3]), torch.randn(12, width, generator=gen), 0)  # ended since
    for lo, hi in ((0, 5), (5, 6), (6, 9)):
        spec_a.add_context(alone, feats[lo:hi], lo)
        spec_b.add_context(reused, feats[lo:hi], lo)
        spec_b.add_context(_work("other", 9, 0, [7, 8, 9]), torch.randn(hi - lo, width, generator=gen), lo)
    logits = spec_a.draft_logits([alone])
    assert torch.equal(logits, spec_b.draft_logits([reused]))
    assert _same_tree(spec_a.draft([alone])[0]["a"], spec_b.draft([reused])[0]["a"])
    torch.testing.assert_close(spec_once.draft_logits([alone]), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_static_draft_equals_dynamic_propose(tiny_ckpts, random_drafter, method):
    """The fixed-shape draft step (block K/V stored at the block's own slots, attention through the paged
    tree-verify kernel with an all-ones block mask, the vectorised tree builder) drafts what the dynamic
    propose drafts: 3 requests padded to a batch of 4, contexts of different lengths in scattered blocks, drafted
    at T=1 (coupled: the static step's noise and filters on the device)."""
    from engine.sampling.logits_processors import SamplingState, TreeSampling
    from spec_decode.static_draft import StaticDraft

    spec, gen = _speculator(tiny_ckpts, random_drafter, num_blocks=16)
    if method == "dflash":
        spec.cfg = SpecConfig("dflash", block_size=5, drafter_path=random_drafter)
    work = []
    for i, (n, blocks) in enumerate(((3, [4, 9]), (9, [1, 12, 6, 0]), (6, [8, 3, 10]))):
        w = _work(str(i), 20 + i, n, blocks)
        spec.add_context(w, torch.randn(n, len(spec.feature_layers) * spec.model.cfg.hidden_size, generator=gen), 0)
        work.append(w)
    state = SamplingState(spec.model.cfg.vocab_size, (), spec.cache.device)
    work = state.bind(work)
    want_logits, want = spec.draft_logits(work), spec.draft(work, TreeSampling(state))[0]
    draft = StaticDraft(spec, batch=4, max_blocks=4, scratch_blocks=(15, 14))
    draft.load(work)
    logits, tokens, parents, depth, valid, _ = draft.run()
    torch.testing.assert_close(logits[:3], want_logits, atol=1e-5, rtol=1e-5)
    for j, w in enumerate(work):
        tree = want[w.request_id]
        assert torch.equal(tokens[j], tree.tokens) and torch.equal(parents[j], tree.parents)
        assert torch.equal(depth[j], tree.depth) and torch.equal(valid[j], tree.valid)


def test_accept_commits_the_walked_path_and_moves_its_kv(tiny_ckpts, random_drafter):
    """``SpeculativeDecoder.accept`` on a padded batch of two trees: request a accepts the drafts down to a depth-3
    node and takes a bonus, request b accepts none. Committed tokens and their log-probs, the target KV of
    positions start..start+k (moved from the accepted nodes' slots, every other slot untouched — the padding
    row's scratch slots too) and the drafter context rows written there are each checked against their
    definition."""
    from spec_decode.tree import DraftTree, build_tree_host

    spec, gen = _speculator(tiny_ckpts, random_drafter, num_blocks=16)
    n, vocab = spec.cfg.tree_size, spec.model.cfg.vocab_size
    for stores in spec.cache.layers:
        for store in stores:
            store.copy_(torch.randn(store.shape, generator=gen))
    before = [tuple(s.clone() for s in stores) for stores in spec.cache.layers]
    lp2 = SamplingParams(temperature=0.0, logprobs=2)
    work = [SeqWork(request_id="a", token_ids=[7], start=5, block_table=[0, 1, 2, 3, 4], sample=True, params=lp2,
                    seed=0, num_generated=3, decode=True, spec=True),
            SeqWork(request_id="b", token_ids=[9], start=2, block_table=[6, 7, 8, 9], sample=True,
                    params=SamplingParams(temperature=0.0), seed=0, num_generated=1, decode=True, spec=True)]
    trees = [build_tree_host((torch.randn(spec.cfg.draft_rows, vocab, generator=gen) * 4).log_softmax(-1), root, 10)
             for root in (7, 9, 0)]  # the third: a padding row
    a = trees[0]
    deep = int((a.depth == 3).nonzero()[0])
    path_a = [i for i in range(n) if bool(a.ancestors[deep, i])]  # root → deep, in depth order
    logits = torch.randn(3 * n, vocab, generator=gen) * 0.1
    for parent, child in zip(path_a, path_a[1:], strict=False):
        logits[parent, int(a.tokens[child])] = 10.0
    children_of = {int(t) for t, p in zip(a.tokens.tolist(), a.parents.tolist(), strict=True) if p == deep}
    bonus_a = next(t for t in range(vocab) if t not in children_of)
    logits[deep, bonus_a] = 10.0
    b = trees[1]
    bonus_b = next(t for t in range(vocab) if t not in set(b.tokens[b.parents == 0].tolist()))
    logits[n, bonus_b] = 10.0
    feats = torch.randn(3 * n, len(spec.feature_layers) * spec.model.cfg.hidden_size, generator=gen)
    slots = torch.stack([spec.cache.slot_tensor(w.block_table, w.start, w.start + n) for w in work]
                        + [torch.arange(40, 40 + n)])  # padding: blocks 10..12
    start = torch.tensor([5, 2, 0])
    res = spec.accept(work, DraftTree.stack(trees), logits, feats, slots, start)

    assert res[0].tokens == [int(a.tokens[i]) for i in path_a[1:]] + [bonus_a] and res[1].tokens == [bonus_b]
    raw = logits.log_softmax(-1)
    assert res[0].logprobs == pytest.approx([float(raw[i, t]) for i, t in zip(path_a, res[0].tokens, strict=True)])
    assert [t for t, _ in res[0].top[-1]] == raw[deep].topk(2).indices.tolist() and res[1].top == [[]]
    moved = {int(slots[0, d]): int(slots[0, i]) for d, i in enumerate(path_a)}
    moved[int(slots[1, 0])] = int(slots[1, 0])
    for stores, old in zip(spec.cache.layers, before, strict=True):
        for store, was in zip(stores, old, strict=True):
            want = was.clone()
            for dst, src in moved.items():
                want[dst] = was[src]
            assert torch.equal(store, want)
    rows = torch.tensor(path_a)
    dst = slots[0, :len(path_a)]
    for layer, (k, v) in enumerate(spec.drafter.context_kv(feats[rows], torch.arange(5, 5 + len(path_a)))):
        torch.testing.assert_close(spec.context.layers[layer][0][dst], k)
        torch.testing.assert_close(spec.context.layers[layer][1][dst], v)


def test_static_commit_equals_the_eager_commit_outside_the_scratch_blocks(tiny_ckpts, random_drafter):
    """The fixed-shape commit over a padded batch (``spec_decode.static_commit``: what a graph captures) leaves
    the target KV and the drafter context as the eager commit of the real rows does, everywhere but the
    scratch blocks the padding row lives in, and finds the same paths; its capture state touches only them."""
    from spec_decode.static_commit import CommitGraphs
    from spec_decode.tree import DraftTree, build_tree_host

    specs_, gens = zip(*(_speculator(tiny_ckpts, random_drafter, num_blocks=16) for _ in range(2)), strict=True)
    eager, static = specs_
    gen = gens[0]
    n, vocab = eager.cfg.tree_size, eager.model.cfg.vocab_size
    width = len(eager.feature_layers) * eager.model.cfg.hidden_size
    for a, b in zip(eager.cache.layers + eager.context.layers, static.cache.layers + static.context.layers,
                    strict=True):
        for x, y in zip(a, b, strict=True):
            x.copy_(torch.randn(x.shape, generator=gen))
            y.copy_(x)
    tables, starts = [[0, 1, 2, 3, 4], [6, 7, 8, 9]], [5, 2]
    trees = [build_tree_host((torch.randn(eager.cfg.draft_rows, vocab, generator=gen) * 4).log_softmax(-1), r, 10)
             for r in (7, 9, 0)]
    tree = DraftTree.stack(trees)
    picks = torch.zeros(3, n, dtype=torch.int64).scatter(1, tree.parents.clamp(min=0), tree.tokens)  # a child's
    feats = torch.randn(3 * n, width, generator=gen)
    scratch = (13, 14, 15)
    slots = torch.stack([eager.cache.slot_tensor(t, s, s + n) for t, s in zip(tables, starts, strict=True)]
                        + [eager.cache.slot_tensor(list(scratch), 0, n)])
    start = torch.tensor(starts + [0])
    graphs = CommitGraphs(static, scratch)
    assert graphs.prepare(3, n) == "no CUDA device"
    graphs.commit(3, n).load_padding()  # the state a capture runs on
    graphs.commit(3, n).run()
    want_path, want_count = eager.commit_paths(tree.head(2), picks[:2],
                                               feats[:2 * n], slots[:2], start[:2])
    path, count = graphs.run(tree, picks[:2], feats, slots, start)
    assert torch.equal(path[:2], want_path) and torch.equal(count[:2], want_count) and int(want_count.max()) > 1
    outside = torch.ones(eager.cache.num_blocks * eager.cache.kv_block_size, dtype=torch.bool)
    outside[eager.cache.slot_tensor(list(scratch), 0, 3 * eager.cache.kv_block_size)] = False
    for a, b in zip(eager.cache.layers + eager.context.layers, static.cache.layers + static.context.layers,
                    strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x[outside], y[outside], rtol=1e-6, atol=1e-6)
    assert graphs.status((3, n)) == (False, "no CUDA device")  # the commit's coverage record


def _faked_capture_job(ctx, lay, path, prompts, spec, params, fail_rank=-1):
    """Static steps with capture faked (``tests/support/fake_capture.py``: every key captured, replays re-run eagerly
    into the captured outputs), then without static steps. Rank 0 returns ((tokens, coverage) static,
    (tokens, coverage) dynamic); with ``fail_rank`` every rank returns its GraphCaptureError message."""
    import engine.worker.capture as cg
    from model.kernel_select import reference_kernels
    from tests.support.fake_capture import faked_capture

    model = load_model(path, ctx.groups(lay))
    model.use_kernels(dataclasses.replace(reference_kernels(), graph_safe=True))  # as the Triton set is
    out, speculation = [], load_speculation(spec, model)
    with faked_capture(fail=ctx.rank == fail_rank):
        for cfg in (CFG.replace(static_steps="on"), CFG):
            try:
                if ctx.rank != 0:
                    worker_loop(make_runner(model, cfg, speculation))
                    continue
                engine = Engine(model, cfg, speculation=speculation)
                res = run_requests(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
                out.append(({k: v for k, (v, _) in res.items()}, engine.stats.coverage.summary()))
                engine.shutdown()
            except cg.GraphCaptureError as exc:
                return str(exc)
    return out if ctx.rank == 0 else None


MIXED_GRAPH_SAFE = ("tp2xdp4_ep8", "dispatcher=allgather")  # alltoall waits on the host: never captured


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_replayed_static_steps_under_mixed_attention_give_the_dynamic_tokens(pool, tiny_ckpts, random_drafter,
                                                                             method):
    """Every decode, draft, verify and commit step "replays" (capture faked: the replay re-runs the step into
    the captured outputs), on all 8 ranks of TP2 × DP4 attention with one idle group, and the tokens are the
    dynamic path's: every rank captured the same keys in the same order, or the capture agreement would hang."""
    spec = specs(random_drafter)[2 if method == "ddtree" else 1]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (static, coverage), (dynamic, _) = pool.run(_faked_capture_job, layout(*MIXED_GRAPH_SAFE),
                                                tiny_ckpts["tiny_deepseek"], PROMPTS, spec, params)[0]
    assert static == dynamic
    for kind in ("verify", "draft", "commit"):
        assert coverage[kind]["steps"] > 0 and coverage[kind]["replays"] == coverage[kind]["steps"], coverage


def test_a_capture_that_fails_on_one_rank_stops_every_rank(pool, tiny_ckpts, random_drafter):
    """Rank 5's first capture (the draft graph) fails: all eight ranks raise at the same agreement, naming rank 5
    and the fallback, instead of rank 5 running eagerly while the others replay."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    messages = pool.run(_faked_capture_job, layout(*MIXED_GRAPH_SAFE), tiny_ckpts["tiny_deepseek"], PROMPTS,
                        specs(random_drafter)[2], params, 5)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CUDA-graph capture of DraftGraphs[1] failed on rank 5: RuntimeError: CUDA error")
    assert messages[0].endswith("engine.static_steps=off runs every step eagerly")


def test_a_drafter_made_for_another_target_is_refused_naming_the_path(tiny_ckpts, random_drafter):
    """``model.path=DIR`` alone keeps the model group's drafter; one that does not fit says so up front."""
    from model.config import load_config
    from spec_decode.decoder import check_drafter_fits
    from spec_decode.dflash import DFlashDrafter

    target, drafter = load_config(tiny_ckpts["tiny_deepseek"]), DFlashDrafter.load(random_drafter).c
    check_drafter_fits(drafter, target, random_drafter)  # the pair the tests use fits
    cases = [(dict(hidden_size=32), "has hidden_size 32, the target 64"),
             (dict(target_layer_ids=(0, 7)), "reads target layers [0, 7], the target has 3"),
             (dict(num_target_layers=61), "was made for a 61-layer target, this one has 3"),
             (dict(mask_token_id=10_000), "mask_token_id 10000, outside the target's vocab")]
    for change, words in cases:
        with pytest.raises(ValueError) as err:
            check_drafter_fits(dataclasses.replace(drafter, **change), target, "/zoo/other")
        message = str(err.value)
        assert message.startswith("spec_decode.drafter_path=/zoo/other ") and words in message, message
        assert "set spec_decode.drafter_path=DIR" in message


def test_a_sharded_drafter_loads_like_one_file(random_drafter, tmp_path):
    """A drafter split over two shards with ``model.safetensors.index.json`` (as larger releases ship) loads the
    same weights; a tensor missing from the shards is named."""
    from safetensors.torch import load_file, save_file

    from spec_decode.dflash import DFlashDrafter

    tensors = load_file(f"{random_drafter}/model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, tmp_path / file)
    index = {"weight_map": {k: f for f, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(open(f"{random_drafter}/config.json").read())
    one, two = DFlashDrafter.load(random_drafter), DFlashDrafter.load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(one.parameters(), two.parameters(), strict=True))
    dropped = names[1]
    save_file({k: tensors[k] for k in names[1::2] if k != dropped}, tmp_path / "model-00002-of-00002.safetensors")
    del index["weight_map"][dropped]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"drafter tensor '{dropped}' missing from {tmp_path}"):
        DFlashDrafter.load(tmp_path)
