"""Speculative decoding benchmark on held-out prompts, measured side by side in one run:
τ (committed tokens per target forward, bonus included) and decode tokens/s for ``none``, ``dflash`` and
``ddtree`` at several budgets, single rank, at each sampling setting (temperature:top_p; seeded per prompt, so every
arm of a setting must write the same tokens) and batch size, coupled drafting (``spec_decode.coupled``) against
uncoupled at T > 0, and (``--adaptive``) adaptive speculation (``spec_decode.adaptive``) against always
speculating. Last, what bounds the wall-clock gain on this machine: the time of one matmul over the target's
LM-head weight at 1 row (a decode step) and at a verify step's row counts.

    python scripts/bench_spec.py [--target DIR] [--drafter DIR] [--prompts N] [--new-tokens N] [--threads N]
                                 [--budgets 4,8,...] [--block-sizes 16,9] [--tree-temperatures 1,0.33]
                                 [--settings 0:1,0.6:0.95,1.0:0.95] [--batches 1,4] [--adaptive]
                                 [--output FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.step import StepKind
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation

ZOO = Path(__file__).resolve().parent.parent / "model" / "zoo" / "tiny_kimi"


class Arm:
    """One method's engine at one sampling setting and batch size; prompt groups run through every arm in turn
    (round robin), so a machine whose speed drifts during the run (this shared box does) slows every arm alike and
    the ratios stay side by side."""

    def __init__(self, model, spec: SpecConfig, new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 batch: int = 1):
        cfg = EngineConfig.flat(max_num_seqs=batch, max_num_batched_tokens=1024, max_model_len=1024, block_size=16,
                                num_blocks=512)
        self.spec, self.engine = spec, Engine(model, cfg, speculation=load_speculation(spec, model))
        self.temperature, self.top_p, self.batch, self.new_tokens = temperature, top_p, batch, new_tokens
        self.tokens: list[list[int]] = []

    def generate(self, prompts: list[list[int]], first: int) -> None:
        """One group of ``batch`` prompts at once, prompt ``first + i`` seeded ``1000 + first + i``."""
        rids = [str(first + i) for i in range(len(prompts))]
        out = {rid: [] for rid in rids}
        for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
            self.engine.add_request(rid, prompt, SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                                                seed=1000 + first + i, max_tokens=self.new_tokens,
                                                                ignore_eos=True))
        while self.engine.has_work():
            for o in self.engine.step():
                out[o.request_id].extend(o.new_tokens)
        self.tokens += [out[rid] for rid in rids]

    def row(self) -> dict:
        s, spec = self.engine.stats, self.spec
        tree = spec.method == "ddtree"
        return {"method": spec.method, "budget": spec.budget if tree else None,
                "tree_temperature": spec.tree_temperature if tree else None, "block_size": spec.block_size,
                "temperature": self.temperature, "top_p": self.top_p, "batch": self.batch,
                "coupled": spec.coupled if spec.enabled and self.temperature > 0 else None,
                "adaptive": spec.adaptive if spec.enabled else None,
                "verify_steps": s.step_kinds.get(StepKind.VERIFY, 0),
                "decode_steps": s.step_kinds.get(StepKind.DECODE, 0),
                "tau": s.acceptance_length if spec.enabled else 1.0, "decode_tok_s": s.decode_tokens / s.decode_s,
                "draft_ms_per_step": 1e3 * s.host_s["draft"] / s.steps,
                "verify_ms_per_step": 1e3 * s.host_s["target"] / s.steps, "tokens": self.tokens}


def parse_settings(text: str) -> list[tuple[float, float]]:
    """``"0:1,0.6:0.95"`` → ``[(0.0, 1.0), (0.6, 0.95)]`` (temperature:top_p pairs)."""
    return [(float(t), float(p)) for t, p in (pair.split(":") for pair in text.split(","))]


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
    ap.add_argument("--settings", default="0:1",
                    help="sampling settings as temperature:top_p pairs; at T > 0 each speculative arm runs coupled "
                         "and uncoupled (spec_decode.coupled)")
    ap.add_argument("--batches", default="1", help="batch sizes: prompts decoded together (engine.max_num_seqs)")
    ap.add_argument("--adaptive", action="store_true",
                    help="also run each (coupled) speculative arm with spec_decode.adaptive=true")
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
    specs = [SpecConfig("dflash", block_size=blk, drafter_path=args.drafter) for blk in blocks]
    specs += [SpecConfig("ddtree", budget=int(b), block_size=blk, drafter_path=args.drafter, tree_temperature=float(t))
              for blk in blocks for t in args.tree_temperatures.split(",") for b in args.budgets.split(",")]
    arms = []
    for temperature, top_p in parse_settings(args.settings):
        for batch in (int(b) for b in args.batches.split(",")):
            arms.append(Arm(model, SpecConfig(), args.new_tokens, temperature, top_p, batch))
            variants = [dict(coupled=True)] + ([dict(coupled=False)] if temperature > 0 else [])
            variants += [dict(coupled=True, adaptive=True)] if args.adaptive else []
            arms += [Arm(model, dataclasses.replace(s, **v), args.new_tokens, temperature, top_p, batch)
                     for v in variants for s in specs]
    for arm in arms:  # warm-up (allocator, drafter weights): one short group, not counted
        Arm(model, arm.spec, 8, arm.temperature, arm.top_p, arm.batch).generate(prompts[:arm.batch], 0)
    for first in range(0, len(prompts), max(a.batch for a in arms)):
        for arm in arms:  # a batch-1 arm takes the group's prompts one at a time, a batch-4 arm four at once
            for at in range(first, min(first + max(a.batch for a in arms), len(prompts)), arm.batch):
                arm.generate(prompts[at:at + arm.batch], at)
    rows = [arm.row() for arm in arms]
    print(f"{len(prompts)} held-out prompts, {args.new_tokens} seeded tokens each, {args.threads} thread(s), "
          f"drafter blocks {args.block_sizes}\n")
    print("| T | top_p | batch | method | block | budget | tree temp. | coupled | adaptive: verify / decode steps | "
          "τ | decode tok/s | × none | draft ms/step | verify ms/step | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for r in rows:
        if r["method"] == "none":
            base = r
        block = r["block_size"] if r["method"] != "none" else "-"
        r["x_none"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["lossless"] = r["tokens"] == base["tokens"]
        coupled = "-" if r["coupled"] is None else ("yes" if r["coupled"] else "no")
        adaptive = f"{r['verify_steps']} / {r['decode_steps']}" if r["adaptive"] else "-"
        print(f"| {r['temperature']:g} | {r['top_p']:g} | {r['batch']} | {r['method']} | {block} | "
              f"{r['budget'] or '-'} | {r['tree_temperature'] or '-'} | {coupled} | {adaptive} | {r['tau']:.2f} | "
              f"{r['decode_tok_s']:.1f} | {r['x_none']:.2f} | {r['draft_ms_per_step']:.1f} | "
              f"{r['verify_ms_per_step']:.1f} | {r['lossless']} |")
    rows_cost = matmul_cost(model.lm_head.weight, [1 + int(b) for b in args.budgets.split(",")[:3]])
    print("\nLM-head matmul (the same weight) by rows: " + ", ".join(
        f"{n} rows {ms:.3f} ms ({ms / rows_cost[1]:.1f}×)" for n, ms in rows_cost.items()))
    if args.output:
        root = ZOO.parent.parent.parent
        shown = {k: str(Path(v).relative_to(root)) if k in ("target", "drafter") and Path(v).is_relative_to(root)
                 else v for k, v in vars(args).items()}
        Path(args.output).write_text(json.dumps({"args": shown, "rows": [
            {k: v for k, v in r.items() if k != "tokens"} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
