"""GPU check of the drafter's CUDA graphs: the static draft step (paged context, device tree builder) captured
per batch size, replayed against the eager static draft on the same inputs, and timed."""

from __future__ import annotations

import time

import torch

from bench.gpu.fixtures import GPU_CHECK_CASES, check_setup, random_speculator
from bench.gpu.harness import check_rows, cuda_time_s
from engine.blocks import blocks_for
from engine.step import SeqWork
from spec_decode.decoder import SpeculativeDecoder
from spec_decode.static_draft import DraftGraphs


def check_draft(spec: SpeculativeDecoder, batch: int, ctx: int, scratch: tuple[int, ...], first_block: int,
                gen: torch.Generator) -> dict:
    """One static draft size on ``batch`` requests with ``ctx`` context rows each (disjoint blocks from
    ``first_block``): eager run, capture, replay on the same inputs — tree agreement, max |Δ logits|, eager and
    replay times (ms). Off CUDA: the eager run and the reason nothing was captured."""
    per_seq = blocks_for(ctx + spec.cfg.spec_reserve_slots, spec.cache.kv_block_size)
    width = len(spec.feature_layers) * spec.model.cfg.hidden_size
    work = []
    for b in range(batch):
        token = int(torch.randint(2, spec.model.cfg.vocab_size, (1,), generator=gen))
        w = SeqWork(request_id=str(b), token_ids=[token], start=ctx,
                    block_table=list(range(first_block + b * per_seq, first_block + (b + 1) * per_seq)),
                    sample=True, params=None, seed=0, num_generated=1, decode=True, spec=True)
        spec.add_context(w, torch.randn(ctx, width, generator=gen).to(spec.context.device), 0)
        work.append(w)
    graphs = DraftGraphs(spec, per_seq, scratch, (batch,))
    draft = graphs.draft(batch)
    draft.load(work)
    eager = [t.clone() for t in draft.run()]
    reason = graphs.capture(batch)
    row = {"batch": batch, "budget": spec.cfg.budget, "block": spec.cfg.block_size, "context": ctx,
           "captured": not reason, "eager_reason": reason, "finite": bool(torch.isfinite(eager[0]).all())}
    if not reason:
        graphs.run(work)
        replay = graphs.captured[batch][1]
        row["same_trees"] = all(torch.equal(a, b) for a, b in zip(eager[1:], replay[1:], strict=True))
        row["max_abs_diff_vs_eager"] = float((replay[0] - eager[0]).abs().max())
        row["eager_ms"] = 1e3 * cuda_time_s(lambda: (draft.load(work), draft.run()))
        row["replay_ms"] = 1e3 * cuda_time_s(lambda: graphs.run(work))
        row["speedup"] = row["eager_ms"] / row["replay_ms"]
    return row


def gpu_check(device: torch.device, budget_s: float) -> dict:
    """Draft graphs on ``bench.gpu.fixtures.check_setup`` (random bf16 target, context 1024) with a random
    drafter: batch 1 at budgets 8…256 and batch 8 at budget 16, the selected kernels."""
    t0 = time.time()
    setup = check_setup(device)
    gen = torch.Generator().manual_seed(0)

    def check(batch: int, budget: int) -> dict:
        spec = random_speculator(setup.model, setup.cache, budget)
        return check_draft(spec, batch, setup.context, setup.scratch, len(setup.scratch), gen)

    rows = check_rows(GPU_CHECK_CASES, check, budget_s - (time.time() - t0))
    return {"model": "random tiny_kimi architecture at hidden 1024 + a random 2-layer DFlash drafter, bf16 target",
            "rows": rows}
