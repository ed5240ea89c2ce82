"""What ``engine.batch_invariant`` buys and costs, side by side in one run (docs/batch_invariance.md): the trained
tiny_kimi pair in bf16 with static steps, single rank, greedy; for each method, a batch of ``--batch`` held-out
prompts decoded with the flag off and on, alternating ``--repeats`` times. Prints, per flag, which prompts' tokens
leave plain decoding's and the speed: output tokens per CPU second of the whole run (prefill included; one thread,
so a box shared with other jobs does not skew it as it skews wall-clock), best of the repeats, and the ratio on/off.

    python scripts/bench_invariance.py [--batch 8] [--new-tokens 64] [--repeats 2] [--budget-tokens 256]
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


def run(model, cfg: EngineConfig, spec: SpecConfig, prompts: list[list[int]], new_tokens: int):
    """One engine over ``prompts`` submitted together → (tokens per prompt, output tokens per CPU second)."""
    engine = Engine(model, cfg, speculation=load_speculation(spec, model))
    start = time.process_time()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_tokens
    cpu = time.process_time() - start
    return [tokens[str(i)] for i in range(len(prompts))], sum(map(len, tokens.values())) / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-tokens", type=int, default=256, help="engine.max_num_batched_tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:args.batch]]
    off = EngineConfig.flat(max_num_seqs=max(8, args.batch), max_num_batched_tokens=args.budget_tokens,
                          max_model_len=512, block_size=16, num_blocks=512, static_steps="on")
    cfgs = {"off": off, "on": off.replace(batch_invariant=True)}
    models = {flag: load_model(ZOO / "target", build_groups(Layout()), torch.bfloat16) for flag in cfgs}  # on: switched
    drafter = str(ZOO / "drafter")
    arms = {"none": SpecConfig(), "dflash": SpecConfig("dflash", drafter_path=drafter),
            "ddtree16": SpecConfig("ddtree", budget=16, drafter_path=drafter),
            "ddtree64": SpecConfig("ddtree", budget=64, drafter_path=drafter)}
    plain, speed = {}, {}
    for name, spec in arms.items():
        for _ in range(args.repeats):
            for flag, cfg in cfgs.items():
                tokens, tok_s = run(models[flag], cfg, spec, prompts, args.new_tokens)
                plain.setdefault((flag, "none"), tokens)
                speed[(flag, name)] = max(speed.get((flag, name), 0.0), tok_s)
                speed.setdefault(("tokens", flag, name), tokens)
    for name in arms:
        row = [f"{name:9s}"]
        for flag in cfgs:
            got, want = speed[("tokens", flag, name)], plain[(flag, "none")]
            row.append(f"{flag}: differs on {[i for i in range(len(want)) if got[i] != want[i]]} "
                       f"{speed[(flag, name)]:6.1f} tok/CPU-s")
        row.append(f"on/off {speed[('on', name)] / speed[('off', name)]:.2f}")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
