"""Speculative decoding benchmark on held-out prompts, measured side by side in one run:
τ (committed tokens per target forward, bonus included) and decode tokens/s for ``none``, ``dflash`` and
``ddtree`` at several budgets, single rank, greedy. Last, what bounds the wall-clock gain on this machine: the
time of one matmul over the target's LM-head weight at 1 row (a decode step) and at a verify step's row counts.

    python scripts/bench_spec.py [--target DIR] [--drafter DIR] [--prompts N] [--new-tokens N] [--threads N]
                                 [--budgets 4,8,...] [--block-sizes 16,9] [--tree-temperatures 1,0.33]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation

ZOO = Path(__file__).resolve().parent.parent / "model" / "zoo" / "tiny_kimi"


class Arm:
    """One method's engine; prompts run through every arm in turn (round robin), so a machine whose speed
    drifts during the run (this shared box does) slows every arm alike and the ratios stay side by side."""

    def __init__(self, model, spec: SpecConfig, new_tokens: int):
        cfg = EngineConfig.flat(max_num_seqs=1, max_num_batched_tokens=1024, max_model_len=1024, block_size=16,
                              num_blocks=512)
        self.spec, self.engine = spec, Engine(model, cfg, speculation=load_speculation(spec, model))
        self.params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        self.tokens: list[list[int]] = []

    def generate(self, prompt: list[int]) -> None:
        """Batch 1: one request at a time."""
        rid, out = str(len(self.tokens)), []
        self.engine.add_request(rid, prompt, self.params)
        while self.engine.has_work():
            for o in self.engine.step():
                out.extend(o.new_tokens)
        self.tokens.append(out)

    def row(self) -> dict:
        s, spec = self.engine.stats, self.spec
        tree = spec.method == "ddtree"
        return {"method": spec.method, "budget": spec.budget if tree else None,
                "tree_temperature": spec.tree_temperature if tree else None, "block_size": spec.block_size,
                "tau": s.acceptance_length if spec.enabled else 1.0, "decode_tok_s": s.decode_tokens / s.decode_s,
                "draft_ms_per_step": 1e3 * s.host_s["draft"] / s.steps,
                "verify_ms_per_step": 1e3 * s.host_s["target"] / s.steps, "tokens": self.tokens}


def matmul_cost(weight: torch.Tensor, row_counts: list[int], reps: int = 200) -> dict[int, float]:
    """Milliseconds of ``x [n, H] @ weight.T`` for n = 1 and each of ``row_counts`` (best of 3 timings)."""
    out = {}
    for n in [1, *row_counts]:
        x = torch.randn(n, weight.shape[1], dtype=weight.dtype)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(x, weight)
            best = min(best, (time.perf_counter() - t0) / reps)
        out[n] = 1e3 * best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(ZOO / "target"))
    ap.add_argument("--drafter", default=str(ZOO / "drafter"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="4,8,16,32,64,128,256")
    ap.add_argument("--block-sizes", default="16",
                    help="drafter blocks: dflash and ddtree rows for each (the checkpoint was trained at 16; a block "
                         "of budget + 1 drafts every depth a budget-B tree can reach)")
    ap.add_argument("--tree-temperatures", default="1,0.33",
                    help="ddtree rows for each: prefixes ranked by the drafter's logits / this (conf default 0.33)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the same for every method)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="target weights and activations (the drafter runs in float32)")
    ap.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc = json.loads((Path(args.target).parent / "eval_prompts.json").read_text())
    prompts = [p["ids"] for p in doc["prompts"]]
    prompts = prompts[: args.prompts]
    model = load_model(args.target, build_groups(Layout()), getattr(torch, args.dtype))
    blocks = [int(b) for b in args.block_sizes.split(",")]
    specs = [SpecConfig()] + [SpecConfig("dflash", block_size=blk, drafter_path=args.drafter) for blk in blocks]
    specs += [SpecConfig("ddtree", budget=int(b), block_size=blk, drafter_path=args.drafter, tree_temperature=float(t))
              for blk in blocks for t in args.tree_temperatures.split(",") for b in args.budgets.split(",")]
    arms = [Arm(model, s, args.new_tokens) for s in specs]
    for arm in arms:  # warm-up (allocator, drafter weights): one short prompt, not counted
        Arm(model, arm.spec, 8).generate(prompts[0])
    for p in prompts:
        for arm in arms:
            arm.generate(p)
    rows = [arm.row() for arm in arms]
    base, chain = rows[0], rows[1]
    print(f"{len(prompts)} held-out prompts, {args.new_tokens} greedy tokens each, batch 1, {args.threads} thread(s), "
          f"drafter blocks {args.block_sizes}\n")
    print("| method | block | budget | tree temp. | τ | τ / τ(dflash) | decode tok/s | × none | draft ms/step | "
          "verify ms/step | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        block = r["block_size"] if r["method"] != "none" else "-"
        print(f"| {r['method']} | {block} | {r['budget'] or '-'} | {r['tree_temperature'] or '-'} | {r['tau']:.2f} | "
              f"{r['tau'] / chain['tau']:.2f} | "
              f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / base['decode_tok_s']:.2f} | "
              f"{r['draft_ms_per_step']:.1f} | {r['verify_ms_per_step']:.1f} | {r['tokens'] == base['tokens']} |")
    rows_cost = matmul_cost(model.lm_head.weight, [1 + int(b) for b in args.budgets.split(",")[:3]])
    print("\nLM-head matmul (the same weight) by rows: " + ", ".join(
        f"{n} rows {ms:.3f} ms ({ms / rows_cost[1]:.1f}×)" for n, ms in rows_cost.items()))
    if args.output:
        Path(args.output).write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows],
                                                indent=1))


if __name__ == "__main__":
    main()
