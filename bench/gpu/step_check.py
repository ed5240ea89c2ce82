"""GPU check of whole speculative steps through the engine's :class:`engine.worker.runner.ModelRunner`.

Two runners share one random model (``bench.gpu.fixtures.check_setup``) and a random drafter
(``bench.gpu.fixtures.random_speculator``): one with static steps — draft graph → verify graph → the walk
and KV compaction on the device, with ``strict_sync`` on so that any host synchronisation between the draft
and the commit raises — and one dynamic. Both prefill the same prompts, then run the same tree-verify step;
the check reports whether they commit the same tokens, both step times and the graph coverage. A step is
idempotent on its inputs (the verify rewrites every tree slot before the walk reads it, the commit writes only
positions from ``start`` on), so the timing loop repeats one step.
"""

from __future__ import annotations

import time

import torch

from bench.gpu.fixtures import GPU_CHECK_CASES, check_setup, random_speculator
from bench.gpu.harness import check_rows, cuda_time_s
from engine.blocks import blocks_for
from engine.params import SamplingParams
from engine.step import GraphCoverage, SeqWork
from engine.worker.runner import ModelRunner
from model.transformer import CausalLM
from spec_decode.config import SpecConfig
from spec_decode.speculation import speculation_from

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def blocks_per_seq(budget: int, context: int, block_size: int = 16) -> int:
    """KV blocks a request of ``context`` tokens needs for one speculative step at ``budget``."""
    reserve = SpecConfig("ddtree", budget=budget, block_size=16, drafter_path="random").spec_reserve_slots
    return blocks_for(context + reserve, block_size)


def spec_runner(model: CausalLM, budget: int, batch: int, context: int, static: bool,
                block_size: int = 16) -> ModelRunner:
    """A runner with a random DDTree speculator (drafter block 16) and room for ``batch`` requests of
    ``context`` tokens plus one step; ``static``: static steps at batch size ``batch``."""
    cfg = SpecConfig("ddtree", budget=budget, block_size=16, drafter_path="random")
    return ModelRunner(model, batch * blocks_per_seq(budget, context, block_size), block_size,
                       speculation_from(cfg, lambda m, cache: random_speculator(m, cache, budget)),
                       static_batch_sizes=(batch,) if static else (), max_model_len=context)


def prefill(runner: ModelRunner, prompts: list[list[int]], per_seq: int) -> list[SeqWork]:
    """Prefills ``prompts`` (request b in blocks ``b*per_seq ..``) → each request's first speculative step."""
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(len(prompts))]
    prefill = [SeqWork(request_id=str(b), token_ids=p, start=0, block_table=tables[b], sample=True, params=GREEDY,
                       seed=b, num_generated=0, decode=False) for b, p in enumerate(prompts)]
    first = runner.finish(runner.launch(prefill)).results
    return [SeqWork(request_id=str(b), token_ids=first[str(b)].tokens, start=len(p), block_table=tables[b],
                    sample=True, params=GREEDY, seed=b, num_generated=1, decode=True, spec=True)
            for b, p in enumerate(prompts)]


def check_spec_step(model: CausalLM, budget: int, batch: int, context: int, gen: torch.Generator) -> dict:
    """One (budget, batch) row: the static and the dynamic runner on the same prompts — committed tokens
    (equal?), mean tokens per step, step times (ms, on CUDA) and the static runner's coverage."""
    prompts = [torch.randint(2, model.cfg.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    static, dynamic = (spec_runner(model, budget, batch, context, on) for on in (True, False))
    static.strict_sync = True
    per_seq = blocks_per_seq(budget, context)
    work = {name: prefill(r, prompts, per_seq) for name, r in (("static", static), ("dynamic", dynamic))}
    row = {"budget": budget, "batch": batch, "context": context}
    coverage = GraphCoverage()  # the static runner's steps, as each step's coverage records say

    def run_static():
        out = static.finish(static.launch(work["static"]))
        for kind, (replayed, why) in out.coverage.items():
            coverage.record(kind, replayed, why)
        return out

    try:
        got = run_static().results
    except RuntimeError as exc:  # strict_sync: a host synchronisation inside the device part
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    want = dynamic.finish(dynamic.launch(work["dynamic"])).results
    row["same_tokens"] = all(got[k].tokens == want[k].tokens for k in want)
    row["tokens_per_step"] = sum(len(r.tokens) for r in got.values()) / batch
    row["host_syncs_draft_to_commit"] = 0 if torch.cuda.is_available() else "not checked off CUDA"
    if torch.cuda.is_available():
        row["static_ms"] = 1e3 * cuda_time_s(run_static)
        row["dynamic_ms"] = 1e3 * cuda_time_s(lambda: dynamic.finish(dynamic.launch(work["dynamic"])))
        row["speedup"] = row["dynamic_ms"] / row["static_ms"]
    summary = coverage.summary()
    row["replays"] = {kind: f"{c['replays']}/{c['steps']}" for kind, c in summary.items()}
    row["eager_reason"] = "; ".join(sorted({c["eager_reason"] for c in summary.values() if c["eager_reason"]}))
    return row


def gpu_check(device: torch.device, budget_s: float) -> dict:
    """Whole speculative steps, static vs dynamic, on ``check_setup``'s random bf16 model (context 1024):
    batch 1 at budgets 8…256 and batch 8 at budget 16."""
    t0 = time.time()
    setup = check_setup(device)
    gen = torch.Generator().manual_seed(0)
    rows = check_rows(GPU_CHECK_CASES, lambda batch, budget: check_spec_step(setup.model, budget, batch,
                                                                             setup.context, gen),
                      budget_s - (time.time() - t0))
    return {"model": "random tiny_kimi architecture at hidden 1024 + a random 2-layer DFlash drafter, bf16 target; "
            "static: strict_sync on", "rows": rows}
