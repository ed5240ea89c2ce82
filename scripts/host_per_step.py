"""What rank 0's host does per engine step, and for how long (docs/gpu_path.md, "Host per step"):

    python scripts/host_per_step.py [--spec none|dflash|ddtree] [--overlap on|off] [--batch 8] [--tokens 64]

One rank, the committed tiny_kimi pair, static steps on, ``--batch`` greedy requests of ``--tokens`` tokens,
``--repeats`` engine lifetimes (the least time of each phase is kept: the box is shared). The phases are the step
records' (``engine/core/step_record.py``: ``schedule``, ``launch`` — of it the speculator's ``draft`` and the ``target``
step —, ``readback``, ``update``), per decode or verify step, read by subscribing to the engine; on CUDA also the
step's device span. Off CUDA the launch computes on the host; on CUDA it only queues kernels or replays graphs.
Finer splits are in a ``StartProfile`` trace (docs/metrics.md, "Profiling").
"""

from __future__ import annotations

import argparse

import torch
from tiny_kimi import decode_batch, load_pair

from engine.config import EngineConfig
from engine.core.step_record import HOST_PHASES, LAUNCH_PARTS, StepRecord
from engine.engine import Engine
from engine.step import StepKind

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
    cfg = EngineConfig.flat(max_num_seqs=args.batch, max_model_len=256, num_blocks=256, static_steps="on",
                          overlap=args.overlap)
    engine = Engine(model, cfg, speculation=speculation)
    engine.warm_up()
    phases = DecodePhases()
    engine.subscribe(phases.observe)
    decode_batch(engine, args.batch, args.tokens)
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
    model, speculation = load_pair(args.spec)
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
