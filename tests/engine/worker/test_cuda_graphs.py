"""Static steps (what a CUDA graph replays) on CPU: a padded static decode / tree-verify step over the paged
kernels (torch references here) gives the dynamic forward's logits, reuses its buffers across steps, and its
padding touches only the scratch blocks. Capture itself needs CUDA: off it the runner says so and runs eager."""

import dataclasses

import pytest
import torch

from bench.gpu.fixtures import random_model, random_tree
from engine.worker.cuda_graphs import GraphRunner, StaticSeq, StaticStep, StepShape
from engine.worker.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
from model.batch import ForwardBatch
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout

BLOCK, SCRATCH = 4, (0, 1)  # scratch blocks hold a padding tree of up to 8 nodes


@pytest.fixture(scope="module", params=["tiny_deepseek", "tiny_qwen3_moe"])
def setup(request, tiny_ckpts):
    """A model, a cache, and three prefilled sequences (lengths 5, 9, 6) on blocks after the scratch ones."""
    model = load_model(tiny_ckpts[request.param], build_groups(Layout()))
    cache = PagedKVCache(KVSpec.for_model(model), 32, BLOCK)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    next_block = len(SCRATCH)
    for length in (5, 9, 6):
        table = list(range(next_block, next_block + 5))  # room for the prompt + a tree of 8
        next_block += 5
        ids = torch.randint(3, model.cfg.vocab_size, (length,), generator=gen)
        model(ForwardBatch(ids, torch.arange(length), [length], PagedKV(cache, [SeqSlots(table, 0, length)])))
        seqs.append((table, length))
    return model, cache, seqs


def dynamic_logits(model, cache, work) -> torch.Tensor:
    """``work``: (table, start, tokens, positions, mask) per sequence → logits of every fed token (PagedKV)."""
    ids = torch.tensor([t for w in work for t in w[2]])
    pos = torch.tensor([p for w in work for p in w[3]])
    slots = [SeqSlots(w[0], w[1], len(w[2]), w[4]) for w in work]
    return model.logits_everywhere(model(ForwardBatch(ids, pos, [len(w[2]) for w in work], PagedKV(cache, slots))))


def static_seq(cache, table, start, tokens, positions, tree_mask=None) -> StaticSeq:
    slots = cache.slots(table, start, start + len(tokens))
    return StaticSeq(slots, table, start + len(tokens), tokens, positions, tree_mask)


def test_static_decode_matches_dynamic_with_padding_and_buffer_reuse(setup):
    model, cache, seqs = setup
    step = StaticStep(model, cache, StepShape(4, 1), max_blocks=5, scratch_blocks=SCRATCH)  # 3 real + 1 padding
    for token_base in (7, 11):  # the second step reuses the buffers with new inputs
        work = [(t, n, [token_base + i], [n], None) for i, (t, n) in enumerate(seqs)]
        want = dynamic_logits(model, cache, work)
        step.load([static_seq(cache, t, n, tok, pos) for t, n, tok, pos, _ in work])
        logits, _ = step.run()
        torch.testing.assert_close(logits[:3], want, rtol=1e-5, atol=1e-5)


def test_static_tree_verify_matches_dynamic_masked_forward(setup):
    model, cache, seqs = setup
    gen = torch.Generator().manual_seed(1)
    n = 6
    step = StaticStep(model, cache, StepShape(3, n), max_blocks=5, scratch_blocks=SCRATCH)
    work, static = [], []
    for table, length in seqs[:2]:  # 2 real trees + 1 padding tree
        anc, depth = random_tree(n, gen)
        tokens = torch.randint(3, model.cfg.vocab_size, (n,), generator=gen).tolist()
        positions = (length + depth).tolist()
        mask = torch.ones(n, length + n, dtype=torch.bool)
        mask[:, length:] = anc
        work.append((table, length, tokens, positions, mask))
        static.append(static_seq(cache, table, length, tokens, positions, anc))
    want = dynamic_logits(model, cache, work)
    step.load(static)
    logits, _ = step.run()
    torch.testing.assert_close(logits[:2 * n], want, rtol=1e-5, atol=1e-5)


def test_padding_writes_only_scratch_blocks(setup):
    model, cache, seqs = setup
    table, length = seqs[0]
    step = StaticStep(model, cache, StepShape(4, 1), max_blocks=5, scratch_blocks=SCRATCH)
    bs = cache.kv_block_size
    own = set(cache.slots(table, length, length + 1)) | {b * bs + i for b in SCRATCH for i in range(bs)}
    before = [tuple(t.clone() for t in layer) for layer in cache.layers]
    step.load([static_seq(cache, table, length, [9], [length])])
    step.run()
    changed = set()
    for old, new in zip(before, cache.layers, strict=True):
        for a, b in zip(old, new, strict=True):
            changed |= set((a != b).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten().tolist())
    assert changed and changed <= own


def test_load_rejects_shapes_that_do_not_fit(setup):
    model, cache, seqs = setup
    step = StaticStep(model, cache, StepShape(2, 1), max_blocks=5, scratch_blocks=SCRATCH)
    table, length = seqs[0]
    one = static_seq(cache, table, length, [9], [length])
    with pytest.raises(ValueError, match="2-sequence static step got 3"):
        step.load([one] * 3)
    with pytest.raises(ValueError, match="nodes"):
        step.load([static_seq(cache, table, length, [9, 9], [length, length + 1])])
    tree = StaticStep(model, cache, StepShape(1, 9), max_blocks=5, scratch_blocks=SCRATCH)
    with pytest.raises(ValueError, match="need 3 scratch blocks"):
        tree.padding_seq()


def test_runner_off_cuda_runs_eager_and_says_why(setup):
    model, cache, seqs = setup
    runner = GraphRunner(model, cache, max_blocks=5, scratch_blocks=SCRATCH, batch_sizes=(1, 4))
    assert runner.shape_for(3, 1) == StepShape(4, 1)
    assert runner.capture(StepShape(4, 1)) == "no CUDA device"
    table, length = seqs[1]
    logits, _ = runner.run([static_seq(cache, table, length, [5], [length])], 1)
    want = dynamic_logits(model, cache, [(table, length, [5], [length], None)])
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert runner.status(StepShape(4, 1)) == (False, "no CUDA device")  # the step's coverage record
    with pytest.raises(ValueError, match="exceeds the largest static batch size 4"):
        runner.shape_for(5, 1)


def test_random_model_for_the_gpu_check_builds_and_runs_on_cpu():
    model = random_model(torch.device("cpu"), torch.float32, hidden_size=64, moe_intermediate_size=32,
                         intermediate_size=64, vocab_size=300)
    cache = PagedKVCache(KVSpec.for_model(model), 8, BLOCK)
    ids = torch.tensor([5, 6, 7])
    hidden = model(ForwardBatch(ids, torch.arange(3), [3], PagedKV(cache, [SeqSlots([2, 3], 0, 3)])))
    assert hidden.shape == (3, 64) and torch.isfinite(hidden).all()


def test_gpu_check_shapes_run_on_cpu_at_every_budget():
    """The GPU check's own inputs (random trees up to budget 256 + scratch padding) on a small CPU model: every
    shape runs its static step, reports 'no CUDA device' instead of capturing, and gives finite logits."""
    from bench.gpu.fixtures import random_seqs
    from bench.gpu.graph_check import _check_shape

    model = random_model(torch.device("cpu"), torch.float32, hidden_size=32, moe_intermediate_size=16,
                         intermediate_size=32, vocab_size=64, num_hidden_layers=2)
    ctx, scratch = 20, tuple(range(17))
    per_seq = -(-(ctx + 257) // 16)
    cache = PagedKVCache(KVSpec.for_model(model), len(scratch) + 2 * per_seq, 16)
    runner = GraphRunner(model, cache, max_blocks=per_seq, scratch_blocks=scratch, batch_sizes=(1, 2))
    gen = torch.Generator().manual_seed(0)
    for shape in [StepShape(2, 1)] + [StepShape(1, b + 1) for b in (8, 64, 256)]:
        seqs = random_seqs(shape, ctx, cache, gen, 64, len(scratch))
        row = _check_shape(runner, shape, seqs)
        assert row == {"kind": shape.kind, "batch": shape.batch, "tree_size": shape.tree_size, "captured": False,
                       "eager_reason": "no CUDA device"}
        logits, _ = runner.run(seqs, shape.tree_size)
        assert logits.shape == (shape.batch * shape.tree_size, 64) and torch.isfinite(logits).all()


def test_draft_gpu_check_runs_on_cpu():
    """The draft-graph check's own setup (random drafter, disjoint contexts, scratch padding) at budgets up to
    256 on a small CPU model: the static draft runs, reports 'no CUDA device' instead of capturing, and its
    logits are finite."""
    from bench.gpu.draft_check import check_draft
    from bench.gpu.fixtures import random_speculator

    model = random_model(torch.device("cpu"), torch.float32, hidden_size=32, moe_intermediate_size=16,
                         intermediate_size=32, vocab_size=64, num_hidden_layers=2)
    ctx, scratch = 20, tuple(range(17))
    per_seq = -(-(ctx + 257) // 16)
    cache = PagedKVCache(KVSpec.for_model(model), len(scratch) + 2 * per_seq, 16)
    gen = torch.Generator().manual_seed(0)
    for batch, budget in ((1, 8), (2, 16), (1, 256)):
        row = check_draft(random_speculator(model, cache, budget), batch, ctx, scratch, len(scratch), gen)
        assert row == {"batch": batch, "budget": budget, "block": 16, "context": ctx, "captured": False,
                       "eager_reason": "no CUDA device", "finite": True}


def test_spec_step_gpu_check_runs_on_cpu():
    """The whole-step check (static runner vs dynamic runner on the same prefilled prompts) on a small CPU
    model: the static step (eager here) commits the dynamic step's tokens, and says why nothing replayed."""
    from bench.gpu.step_check import check_spec_step

    model = random_model(torch.device("cpu"), torch.float32, hidden_size=32, moe_intermediate_size=16,
                         intermediate_size=32, vocab_size=64, num_hidden_layers=2)
    gen = torch.Generator().manual_seed(0)
    for batch, budget in ((1, 8), (2, 16)):
        row = check_spec_step(model, budget, batch, 20, gen)
        assert row["same_tokens"] and row["tokens_per_step"] >= 1, row
        assert row["replays"] == {"verify": "0/1", "draft": "0/1", "commit": "0/1"}, row
        assert row["eager_reason"] == "no CUDA device"


def test_a_dispatcher_that_waits_on_the_host_blocks_capture(tiny_ckpts):
    """The all-to-all reads its row counts on the host, and so do the torch reference kernels, so no forward
    through either is captured: the runner gets the reason up front and never tries (a failed capture half-way
    through NCCL collectives is no fallback)."""
    from engine.worker.capture import CapturedGraphs, capture_blocker, eager_reason
    from model.kernel_select import reference_kernels

    alltoall = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout(dispatcher="alltoall")))
    plain = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout()))
    reason = capture_blocker(alltoall)
    assert reason == "dispatcher 'alltoall' is not CUDA-graph safe (it waits on the host)"
    assert capture_blocker(plain) == ("torch reference: default (no kernel set chosen): the torch references wait "
                                      "on the host, capture needs the Triton kernels")
    plain.use_kernels(dataclasses.replace(reference_kernels(), graph_safe=True))  # as the Triton set is
    assert capture_blocker(plain) == "" and eager_reason(plain, "off") == "no CUDA device"
    graphs = CapturedGraphs(reason)
    calls = []
    assert graphs._capture("k", torch.device("cuda"), lambda: calls.append("prepare"), lambda: calls.append("run")) \
        == reason
    assert calls == [] and graphs.reasons == {"k": reason}
    assert CapturedGraphs()._capture("k", torch.device("cpu"), calls.append, calls.append) == "no CUDA device"


def test_steps_over_the_dispatchers_graph_token_bound_are_not_tried(tiny_ckpts):
    """DeepEP's low-latency path (the graph-safe one) holds at most ``deepep_max_decode_tokens`` tokens per rank:
    a decode shape within it is tried, a verify shape over it gets the reason up front, on every rank alike."""
    from engine.worker.capture import CapturedGraphs, token_limit_blocker

    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout()))
    assert token_limit_blocker(model, 10_000) == ""  # the allreduce dispatcher has no bound
    for layer in model.model.layers:
        if hasattr(layer.mlp, "dispatcher"):
            layer.mlp.dispatcher.graph_token_limit = 128  # what DeepEPDispatcher(max_decode_tokens=128) sets
    assert token_limit_blocker(model, 128) == ""
    reason = token_limit_blocker(model, 4 * 33)
    assert reason == ("132 tokens per rank exceed dispatcher 'allreduce''s graph-safe bound of 128 (from "
                      "parallel.deepep_max_decode_tokens, times attn_tp when attention TP ranks split their tokens)")
    graphs, calls = CapturedGraphs(), []
    assert graphs._capture("verify", torch.device("cuda"), lambda: calls.append("prepare"),
                           lambda: calls.append("run"), lambda: reason) == reason
    assert calls == [] and graphs.reasons == {"verify": reason}


def test_one_rank_runs_a_key_whose_capture_failed_eagerly_and_replays_the_others():
    """Alone, a rank may fall back: the failed key runs eagerly with the reason, a captured key replays into its
    static outputs (several ranks stop instead: ``test_a_capture_that_fails_on_one_rank_stops_every_rank``)."""
    from engine.worker.capture import CapturedGraphs
    from tests.support.fake_capture import faked_capture

    graphs, box = CapturedGraphs(), {"value": 1.0}
    run = lambda: (torch.tensor([box["value"]]), None)  # noqa: E731 - a step whose inputs live in ``box``
    with faked_capture(fail=True):
        assert graphs._capture("verify", torch.device("cuda"), lambda: None, run) == (
            "capture failed: RuntimeError: CUDA error: out of memory (in the graph pool)")
    with faked_capture():
        assert graphs._capture("decode", torch.device("cuda"), lambda: None, run) == ""
    box["value"] = 2.0
    replayed, (out, _) = graphs._replay_or_run("decode", run)
    assert replayed and float(out) == 2.0 and graphs.captured["decode"][1][0] is out  # the captured buffer
    assert graphs._replay_or_run("verify", run)[0] is False
    assert sorted(graphs.captured) == ["decode"] and list(graphs.reasons) == ["verify"]


def test_a_warm_up_that_raises_is_an_error_not_an_eager_fallback(monkeypatch):
    """The warm-up runs are eager steps: one that raises would fail as an eager step too, so it propagates
    (``capture_graph`` wraps only the capture itself in GraphCaptureError; it needs CUDA, so it is stood in
    for here by one whose warm-up raises)."""
    import engine.worker.capture as cg

    def broken(run, pool):
        raise ValueError("Triton: out of shared memory")

    monkeypatch.setattr(cg, "capture_graph", broken)
    graphs = cg.CapturedGraphs()
    with pytest.raises(ValueError, match="out of shared memory"):
        graphs._capture("verify", torch.device("cuda"), lambda: None, lambda: None)
    assert graphs.reasons == {} and graphs.captured == {}


def test_check_rows_keeps_the_rows_after_a_failing_case_and_stops_at_the_budget():
    from bench.gpu.harness import check_rows

    def check(budget: int) -> dict:
        if budget == 256:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"budget": budget, "captured": True}

    cases = [{"budget": b} for b in (8, 256, 16)]
    assert check_rows(cases, check, budget_s=60) == [
        {"budget": 8, "captured": True},
        {"budget": 256, "error": "RuntimeError: CUDA error: an illegal memory access was encountered"},
        {"budget": 16, "captured": True}]
    assert check_rows(cases, check, budget_s=-1) == [{**c, "skipped": "time budget"} for c in cases]
