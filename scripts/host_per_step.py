"""What rank 0's host does per engine step, and for how long (docs/gpu_path.md, "Host per step"):

    python scripts/host_per_step.py [--spec none|dflash|ddtree] [--overlap on|off] [--batch 8] [--tokens 64]

One rank, the committed tiny_kimi pair, static steps on, ``--batch`` greedy requests of ``--tokens`` tokens,
``--repeats`` engine lifetimes (the least time of each phase is kept: the box is shared). The phases are the step
records' (``engine/step_record.py``: ``schedule``, ``launch`` — of it the speculator's ``draft`` and the ``target``
step —, ``readback``, ``update``), per decode or verify step, read by subscribing to the engine; on CUDA also the
step's device span. Off CUDA the launch computes on the host; on CUDA it only queues kernels or replays graphs.
Finer splits are in a ``StartProfile`` trace (docs/metrics.md, "Profiling").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.engine import Engine
from engine.sampler import SamplingParams
from engine.scheduler import SchedulerConfig
from engine.step import StepKind
from engine.step_record import HOST_PHASES, LAUNCH_PARTS, StepRecord
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout

ZOO = Path(__file__).resolve().parent.parent / "model/zoo/tiny_kimi"
PHASES = (*HOST_PHASES[:2], *LAUNCH_PARTS, *HOST_PHASES[2:], "device")


class DecodePhases:
    """A step-record subscriber: ms per phase summed over decode and verify steps."""

    def __init__(self):
        self.ms, self.steps = dict.fromkeys(PHASES, 0.0), 0

    def observe(self, record: StepRecord) -> None:
        if record.kind not in (StepKind.DECODE, StepKind.VERIFY):
            return
        self.steps += 1
        for phase, ms in record.host_ms.items():
            self.ms[phase] += ms
        if record.device_ms is not None:
            self.ms["device"] += record.device_ms


def run_once(args, model, speculation) -> DecodePhases:
    cfg = SchedulerConfig(max_num_seqs=args.batch, max_model_len=256, num_blocks=256, static_steps="on",
                          overlap=args.overlap)
    engine = Engine(model, cfg, speculation=speculation)
    engine.warm_up()
    phases = DecodePhases()
    engine.subscribe(phases.observe)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [5 + i, 17, 3, 99, 150, 7, 64, 31], params)
    while engine.has_work():
        engine.step()
    engine.shutdown()
    return phases


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
        phases = run_once(args, model, speculation)
        for name, ms in phases.ms.items():
            best[name] = min(best.get(name, float("inf")), ms / max(phases.steps, 1))
    print(f"spec={args.spec} overlap={args.overlap} batch={args.batch}: ms per decode/verify step "
          f"(least of {args.repeats})")
    for name in PHASES:
        if name != "device" or model.device.type == "cuda":
            print(f"  {name:10s} {best[name]:8.3f}")


if __name__ == "__main__":
    main()
