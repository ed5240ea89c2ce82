"""Prefill and decode on two workers against one aggregated worker, one run (``bench/pd.py``): the built-in
``tiny_agent`` model (random weights, 8192-token context, one character one token) behind smg, fed the same mix —
decode streams running all the time, then the same streams while long prompts (4096 tokens, one output token) arrive
on a schedule. The aggregated worker and the decode worker run pinned to core 0 (``taskset -c 0``), the prefill
worker to core 1, so what differs is interference inside a worker, not two processes fighting for one core; smg and
the client run unpinned. Every worker runs the same engine settings, a prefill's chunk capped at 256 tokens of a
512-token step (``engine.long_prefill_token_threshold``): without the cap a prefill worker busy for seconds on one
prompt answers no other leg, and smg 1.13 gives up on its legs (504, "PD prefill leg produced nothing within its
silence bound"). Reports the decode streams' inter-token latency p50/p99 per deployment and phase, the
long prompts' latency, and the hand-off's blocks, bytes, seconds and recomputed tokens.

    python scripts/bench_pd.py --out outputs/pd [--phase-s 30 --streams 3 --long-every 3]

Writes ``pd.json`` and ``pd.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pd import Mix, pd_samples, run_phase, summarize  # noqa: E402
from bench.run import Gateway, Server  # noqa: E402
from model.tiny import preset_dir  # noqa: E402

log = logging.getLogger("bench_pd")
MODEL = "tiny_agent"
WORKER = ["model=tiny_agent", "parallel=single", "engine.block_size=16", "engine.max_num_batched_tokens=512",
          "engine.long_prefill_token_threshold=256",
          "engine.num_blocks=1536", "engine.warm_up=false", f"server.served_model_name={MODEL}"]


def deployment(out: Path, name: str, mix: Mix, pd: bool) -> dict:
    """One deployment through its gateway: the streams alone, then with the long prompts arriving."""
    if pd:
        workers = [Server([*WORKER, "server.kv_role=prefill"], out / f"{name}_prefill.log", 300, cpus="1"),
                   Server([*WORKER, "server.kv_role=decode"], out / f"{name}_decode.log", 300, cpus="0")]
    else:
        workers = [Server(WORKER, out / f"{name}_worker.log", 300, cpus="0")]
    gateway = None
    try:
        gateway = Gateway(out, f"{name}_smg", workers, "passthrough", preset_dir(MODEL), pd=pd)
        decode_metrics = f"http://127.0.0.1:{workers[-1].metrics_port}/metrics"
        warm = summarize(run_phase(gateway.url, MODEL, Mix(**{**asdict(mix), "phase_s": 10.0}), with_long=True,
                                   seed=99))
        doc = {"warm_up_errors": warm["errors"]}  # the first long prompt on fresh workers
        for phase, with_long in (("streams_only", False), ("with_long_prompts", True)):
            before = pd_samples(decode_metrics)
            result = summarize(run_phase(gateway.url, MODEL, mix, with_long, seed=len(doc)))
            after = pd_samples(decode_metrics)
            result["hand_off"] = {k: after[k] - before.get(k, 0.0) for k in after
                                  if "leased_blocks" not in k} if pd else None
            doc[phase] = result
            log.info("%s %s: %s", name, phase, json.dumps(result))
        return doc
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, width = ["p50", "p99"], 0.2
    bars = [(f"{dep}, {phase.replace('_', ' ')}", doc[dep][phase]["itl_s"])
            for dep in ("aggregated", "disaggregated") for phase in ("streams_only", "with_long_prompts")]
    for i, (name, itl) in enumerate(bars):
        ax.bar([x + (i - 1.5) * width for x in range(2)], [1e3 * itl["median"], 1e3 * itl["p99"]], width, label=name)
    ax.set_xticks(range(2), labels)
    ax.set_ylabel("decode inter-token latency (ms, log)")
    ax.set_yscale("log")
    ax.set_title("decode streams with and without long prompts arriving (tiny_agent, CPU)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/pd"))
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--long-every", type=float, default=3.0)
    parser.add_argument("--long-chars", type=int, default=4096)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    mix = Mix(streams=args.streams, long_every_s=args.long_every, long_prompt_chars=args.long_chars,
              phase_s=args.phase_s)
    doc = {"mix": asdict(mix), "pinning": "aggregated and decode worker: core 0; prefill worker: core 1; smg and the "
                                          "client unpinned (2-core box)",
           "aggregated": deployment(args.out, "aggregated", mix, pd=False),
           "disaggregated": deployment(args.out, "disaggregated", mix, pd=True)}
    for dep in ("aggregated", "disaggregated"):
        alone, busy = doc[dep]["streams_only"]["itl_s"], doc[dep]["with_long_prompts"]["itl_s"]
        doc[dep]["p99_inflation"] = busy["p99"] / alone["p99"]
        doc[dep]["p50_inflation"] = busy["median"] / alone["median"]
    hand = doc["disaggregated"]["with_long_prompts"]["hand_off"]
    seconds = hand.get("switchyard:pd_transfer_seconds_total", 0.0)
    hand["bandwidth_MBps"] = hand.get('switchyard:pd_kv_bytes_total{direction="received"}', 0.0) / seconds / 1e6 \
        if seconds else None
    (args.out / "pd.json").write_text(json.dumps(doc, indent=1))
    plot(doc, args.out / "pd.png")
    log.info("p99 ITL inflation with long prompts: aggregated %.2fx, disaggregated %.2fx",
             doc["aggregated"]["p99_inflation"], doc["disaggregated"]["p99_inflation"])


if __name__ == "__main__":
    main()
