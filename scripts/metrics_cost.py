"""What the Prometheus exporter costs per engine step (docs/metrics.md, "Cost"):

    python scripts/metrics_cost.py [--batch 8] [--tokens 64] [--spec none|ddtree]

One rank, the committed tiny_kimi pair, ``--batch`` greedy requests of ``--tokens`` tokens. The exporter
(``rpc.metrics.MetricsExporter``) subscribes to the engine as the server's does; its ``observe`` runs on the engine's
thread after every step, so its time is added to the step; so is building the record (``StepRecorder.step``, timed
here through a wrapper). Printed: microseconds per record of both (mean and p99; the exporter also on the same records
replayed back to back, caches warm), one scrape of the page (``text()``, on the metrics thread), the decode steps'
wall time with the ratios, and the pickled size of a rank's report (coverage + a CPU telemetry sample).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch
from tiny_kimi import decode_batch, load_pair

from engine.config import EngineConfig
from engine.core.step_record import StepRecord
from engine.engine import Engine
from engine.step import RankReport, StepKind
from engine.worker.telemetry import CpuBackend, TelemetrySampler
from rpc.metrics import exporter_for


class TimedRecorder:
    """The engine's ``StepRecorder`` with its ``step`` timed (microseconds per call in ``us``)."""

    def __init__(self, recorder):
        self.recorder, self.us = recorder, []

    def __getattr__(self, name):
        return getattr(self.recorder, name)

    def step(self, *args):
        t0 = time.perf_counter()
        record = self.recorder.step(*args)
        self.us.append(1e6 * (time.perf_counter() - t0))
        return record


def mean_p99(us: list[float]) -> str:
    return f"{statistics.fmean(us):.1f} us mean, {sorted(us)[int(0.99 * (len(us) - 1))]:.1f} us p99"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="none", choices=["none", "ddtree"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, speculation = load_pair(args.spec)
    engine = Engine(model, EngineConfig.flat(max_num_seqs=args.batch, max_model_len=256, num_blocks=256),
                    speculation=speculation)
    exporter = exporter_for(engine, "tiny_kimi")
    observe_us, decode_ms, records = [], [], []

    def timed(record: StepRecord) -> None:
        records.append(record)
        t0 = time.perf_counter()
        exporter.observe(record)
        observe_us.append(1e6 * (time.perf_counter() - t0))
        if record.kind in (StepKind.DECODE, StepKind.VERIFY):
            decode_ms.append(1e3 * record.wall_s)

    engine.subscribe(timed)
    engine.recorder = recorder = TimedRecorder(engine.recorder)
    decode_batch(engine, args.batch, args.tokens)
    engine.shutdown()
    t0 = time.perf_counter()
    page = exporter.text()
    scrape_ms = 1e3 * (time.perf_counter() - t0)
    fresh = exporter_for(engine, "tiny_kimi")  # the same records again, back to back: warm caches
    t0 = time.perf_counter()
    for _ in range(20):
        for record in records:
            fresh.observe(record)
    warm_us = 1e6 * (time.perf_counter() - t0) / (20 * len(records))
    sample = TelemetrySampler(1.0, CpuBackend()).sample_now()
    report = len(pickle.dumps(RankReport(None, dict(records[-1].graphs[0]), sample)))
    step_ms = statistics.median(decode_ms)
    print(f"spec={args.spec} batch={args.batch}: {len(observe_us)} records, decode step {step_ms:.2f} ms median "
          f"(wall, this CPU); exporter.observe {mean_p99(observe_us)} "
          f"({100 * statistics.fmean(observe_us) / 1e3 / step_ms:.3f} % of a step), {warm_us:.1f} us replayed warm; "
          f"building the record {mean_p99(recorder.us)} ({100 * statistics.fmean(recorder.us) / 1e3 / step_ms:.3f} "
          f"%); one scrape {scrape_ms:.2f} ms for {len(page)} bytes; a rank's report with a CPU sample {report} "
          "bytes pickled")

if __name__ == "__main__":
    main()
