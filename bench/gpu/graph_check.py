"""GPU check of the target's CUDA graphs: decode and tree-verify steps captured, replayed against the eager
static step on the same inputs, and timed."""

from __future__ import annotations

import time

import torch

from bench.gpu.fixtures import check_setup, random_seqs
from bench.gpu.harness import check_rows, cuda_time_s
from engine.worker.cuda_graphs import GraphRunner, StaticSeq, StepShape


def gpu_check(device: torch.device, budget_s: float) -> dict:
    """Captures and replays decode (batch 1, 8) and tree verify (batch 1, budgets 8…256) graphs on
    :func:`check_setup`; per shape: capture result, max |replay − eager| logits, eager and replay step times
    (ms). Stops starting shapes after ``budget_s``."""
    t0 = time.time()
    setup = check_setup(device)
    model, cache, scratch = setup.model, setup.cache, setup.scratch
    runner = GraphRunner(model, cache, max_blocks=setup.blocks_per_seq, scratch_blocks=scratch, batch_sizes=(1, 8))
    shapes = [StepShape(1, 1), StepShape(8, 1)] + [StepShape(1, b + 1) for b in (8, 16, 32, 64, 128, 256)]
    gen = torch.Generator().manual_seed(0)

    def check(batch: int, tree_size: int) -> dict:
        shape = StepShape(batch, tree_size)
        return _check_shape(runner, shape, random_seqs(shape, setup.context, cache, gen, model.cfg.vocab_size,
                                                       len(scratch)))

    rows = check_rows([{"batch": s.batch, "tree_size": s.tree_size} for s in shapes], check,
                      budget_s - (time.time() - t0))
    return {"kernels": model.kernels.reasons, "model": "random tiny_kimi architecture at hidden 1024, 32 experts, "
            "bf16", "context": setup.context, "shapes": rows}


def _check_shape(runner: GraphRunner, shape: StepShape, seqs: list[StaticSeq]) -> dict:
    """Eager static step, capture, replay on the same inputs: agreement and both step times."""
    step = runner.step(shape)
    step.load(seqs)
    eager = step.run()[0].float().clone()
    reason = runner.capture(shape)
    row = {"kind": shape.kind, "batch": shape.batch, "tree_size": shape.tree_size, "captured": not reason,
           "eager_reason": reason}
    if not reason:
        replay = runner.run(seqs, shape.tree_size)[0].float()
        row["max_abs_diff_vs_eager"] = float((replay - eager).abs().max())
        row["eager_ms"] = 1e3 * cuda_time_s(lambda: (step.load(seqs), step.run()))
        row["replay_ms"] = 1e3 * cuda_time_s(lambda: runner.run(seqs, shape.tree_size))
        row["speedup"] = row["eager_ms"] / row["replay_ms"]
    return row
