"""What rank 0's host does per engine step, and for how long (docs/gpu_path.md, "Host per step"):

    python scripts/host_per_step.py [--spec none|dflash|ddtree] [--overlap on|off] [--batch 8] [--tokens 64]

One rank, the committed tiny_kimi pair, static steps on, ``--batch`` greedy requests of ``--tokens`` tokens,
``--repeats`` engine lifetimes (the least time of each phase is kept: the box is shared). Each phase is the
wall time inside the named functions, per decode/verify step. Off CUDA the "device" phases (forward, sampling,
drafting, commit) compute on the host; on CUDA they only queue kernels or replay graphs.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.engine import Engine
from engine.sampler import SamplingParams
from engine.scheduler import SchedulerConfig
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout

ZOO = Path(__file__).resolve().parent.parent / "model/zoo/tiny_kimi"


def phases(spec: str) -> dict[str, tuple[object, str]]:
    """Phase name → (owner, attribute) of the function whose calls it times."""
    import engine.runner as runner_module
    from engine.cuda_graphs import GraphRunner, StaticStep
    from engine.runner import ModelRunner
    from engine.sampler import SamplingBatch
    from engine.scheduler import Scheduler
    from engine.staging import Readback
    from model.transformer import CausalLM

    out = {"schedule": (Scheduler, "schedule"), "stage inputs": (StaticStep, "load"),
           "stage sampling rows": (SamplingBatch, "build"), "previous tokens by row": (ModelRunner, "_take_previous"),
           "target forward": (CausalLM, "forward"), "LM head": (CausalLM, "logits_everywhere"),
           "sample": (runner_module, "sample"), "start readback": (Readback, "__init__"),
           "wait + read back": (ModelRunner, "finish"), "update": (Scheduler, "update"),
           "launch (all)": (ModelRunner, "launch")}
    if spec != "none":
        from spec_decode.speculation import DFlashSpeculator
        from spec_decode.speculator import Committed
        from spec_decode.static_commit import CommitGraphs
        from spec_decode.static_draft import StaticDraft

        out.update({"stage draft inputs": (StaticDraft, "load"), "stage verify layout": (GraphRunner,
                                                                                          "load_tree_layout"),
                    "draft": (StaticDraft, "run"), "walk + commit": (DFlashSpeculator, "commit_static"),
                    "commit graph prepare": (CommitGraphs, "prepare"), "verify readback": (Committed, "results")})
    return out


def timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.perf_counter() - t0
    return wrapper


def run_once(args, model, speculation) -> tuple[dict, int]:
    table = defaultdict(float)
    patched = [(owner, attr, getattr(owner, attr)) for owner, attr in phases(args.spec).values()]
    for name, (owner, attr) in phases(args.spec).items():
        setattr(owner, attr, timed(table, name, getattr(owner, attr)))
    try:
        cfg = SchedulerConfig(max_num_seqs=args.batch, max_model_len=256, num_blocks=256, static_steps="on",
                              overlap=args.overlap)
        engine = Engine(model, cfg, speculation=speculation)
        engine.warm_up()
        table.clear()
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(str(i), [5 + i, 17, 3, 99, 150, 7, 64, 31], params)
        engine.step()  # the prefill (and, with overlap, the first decode's launch)
        table.clear()
        steps0 = engine.stats.steps
        while engine.has_work():
            engine.step()
        engine.shutdown()
        return dict(table), engine.stats.steps - steps0
    finally:
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="none", choices=["none", "dflash", "ddtree"])
    ap.add_argument("--overlap", default="off", choices=["on", "off"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(str(ZOO / "target"), build_groups(Layout()))
    speculation = None
    if args.spec != "none":
        from spec_decode.config import SpecConfig
        from spec_decode.speculation import load_speculation

        speculation = load_speculation(SpecConfig(args.spec, budget=16, block_size=9, drafter_path=str(ZOO / "drafter"),
                                                  tree_temperature=0.33), model)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        table, steps = run_once(args, model, speculation)
        for name, seconds in table.items():
            best[name] = min(best.get(name, float("inf")), seconds / steps)
    print(f"spec={args.spec} overlap={args.overlap} batch={args.batch}: ms per step (least of {args.repeats})")
    for name in phases(args.spec):
        if name in best:
            print(f"  {name:24s} {best[name] * 1e3:8.3f}")


if __name__ == "__main__":
    main()
