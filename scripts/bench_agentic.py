"""Agent sessions at cache speed, one run (``bench/agentic.py``): the built-in ``tiny_agent`` model (random weights,
8192-token context) served by ``scripts/serve.py`` on loopback, with

1. S sessions × T turns through gRPC, the prefix cache on and then off: per-turn TTFT p50/p99, prompt tokens
   computed, hit rate against the block-aligned ideal, output tokens/s, preemptions;
2. ``engine.kv_allocation`` on_demand vs reserve on one pool: the most requests running at once when ``max_tokens``
   is unset and outputs are short;
3. retention: agent turns that wait on a tool while other traffic churns the pool, with ``retain_kv`` and without;
4. two workers behind ``smg --policy cache_aware``: which worker each session's turns land on, and where the sessions
   of a worker go after its ``FlushCache``;
5. KV tiers: many sessions taking turns in rounds on a device pool capped under 20 % of their context — no tier, a
   host tier (``engine.host_kv_cache_gb``), and an unlimited pool (the ideal): token-weighted hit rate, prompt tokens
   computed, TTFT of the turns served from host against the same turns cold, bytes and seconds moved;
6. the shared store: two workers behind ``smg --policy round_robin`` (so turns move) with one Mooncake store, against
   the same two without it, then with the store's master killed after turn 2: the hit rate of the turns that changed
   worker, TTFT of store hits against the same turns cold, failed requests.

    python scripts/bench_agentic.py --out outputs/agentic [--sessions 4 --turns 6 ...] [--skip smg,retention]
    python scripts/bench_agentic.py --out outputs/agentic_tiers --skip sessions,allocation,retention,smg,store
    python scripts/bench_agentic.py --out outputs/agentic_store --skip sessions,allocation,retention,smg,tiers

Writes ``agentic.json`` and ``agentic.png`` (``agentic_tiers.png`` with the tiers, ``agentic_store.png`` with the
store) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agentic import (  # noqa: E402
    Workload,
    compare,
    peak_running,
    retention_probe,
    run_rounds,
    run_sessions,
    smg_rounds,
    smg_sessions,
    store_comparison,
    summarize,
    tier_comparison,
)
from bench.mooncake import MooncakeMaster, installed_master  # noqa: E402
from bench.run import Gateway, Server  # noqa: E402
from model.tiny import preset_dir  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

log = logging.getLogger("bench_agentic")
BASE = ["model=tiny_agent", "parallel=single", "engine.block_size=16", "engine.max_num_batched_tokens=2048",
        "engine.warm_up=false"]


def serve(out: Path, name: str, *overrides: str) -> Server:
    return Server([*BASE, *overrides], out / f"{name}.log", timeout_s=300)


def cache_on_off(out: Path, w: Workload) -> dict:
    runs = {}
    for caching in ("true", "false"):
        srv = serve(out, f"sessions_cache_{caching}", f"engine.prefix_caching={caching}", "engine.num_blocks=4096",
                    f"engine.max_num_seqs={max(w.concurrency, 4)}")
        try:
            with tqdm(total=w.sessions * w.turns, desc=f"sessions, prefix cache {caching}") as bar:
                t0 = time.perf_counter()
                records = run_sessions(srv.client, w, bar=bar)
                summary = summarize(records, time.perf_counter() - t0)
            kv = srv.client.engine_info()["kv"]
            summary.update(preemptions=kv["preemptions"], evictions=kv["evictions"], engine_hit_rate=kv["hit_rate"],
                           records=[asdict(r) for r in records])
            runs["on" if caching == "true" else "off"] = summary
        finally:
            srv.stop()
    return {**runs, "on_vs_off": compare(runs["on"], runs["off"])}


def allocation(out: Path, requests: int) -> dict:
    res = {}
    for alloc in ("on_demand", "reserve"):
        srv = serve(out, f"alloc_{alloc}", f"engine.kv_allocation={alloc}", "engine.num_blocks=1100",
                    "engine.max_num_seqs=64", "engine.max_num_batched_tokens=4096")
        try:
            res[alloc] = peak_running(srv.client, requests, prompt_tokens=400, min_tokens=60)
        finally:
            srv.stop()
    res["ratio"] = res["on_demand"]["peak_running"] / max(res["reserve"]["peak_running"], 1)
    res["pool"] = "1100 blocks of 16 tokens; max_model_len 8192 (reserve takes 512 blocks per request)"
    return res


def retention(out: Path, w: Workload) -> dict:
    res = {}
    probe = replace(w, sessions=4, turns=2, system_tokens=200, first_user_tokens=600)  # ~55 blocks a session
    for retain in (True, False):
        srv = serve(out, f"retention_{retain}", "engine.num_blocks=320", "engine.max_model_len=4096",
                    "engine.kv_retention_s=120")
        try:
            res["retain" if retain else "plain_lru"] = retention_probe(srv.client, probe, noise_requests=16,
                                                                      noise_tokens=700, retain=retain)
        finally:
            srv.stop()
    res["pool"] = ("320 blocks of 16 tokens (max_model_len 4096); 4 sessions' first turns (~55 blocks each), "
                   "then 16 unrelated 700-token prompts")
    return res


# the tiers experiment: 12 sessions of ~1.7K tokens (~20K live) on a 240-block pool (3840 tokens: 19 %)
TIER_WORKLOAD = Workload(sessions=12, turns=4, system_tokens=200, tenants=12, first_user_tokens=1200,
                         new_tokens_per_turn=64, output_tokens=16, think_s=0.0, concurrency=2)
TIER_ARMS = {"no_tier": ["engine.num_blocks=240"],
             "host": ["engine.num_blocks=240", "engine.host_kv_cache_gb=1", "engine.host_kv_write=evict"],
             "host_through": ["engine.num_blocks=240", "engine.host_kv_cache_gb=1", "engine.host_kv_write=through"],
             "unlimited": ["engine.num_blocks=4096"]}


def tiers(out: Path, w: Workload = TIER_WORKLOAD) -> dict:
    records, engines = {}, {}
    for arm, overrides in TIER_ARMS.items():
        srv = serve(out, f"tiers_{arm}", "engine.max_model_len=3072", f"engine.max_num_seqs={w.concurrency}",
                    *overrides)
        try:
            t0 = time.perf_counter()
            records[arm] = run_rounds(srv.client, w)
            kv = srv.client.engine_info()["kv"]
            engines[arm] = {"seconds": time.perf_counter() - t0, "preemptions": kv["preemptions"],
                            "evictions": kv["evictions"], "tiers": kv["tiers"]}
            log.info("tiers %s: %.1f s, %s", arm, engines[arm]["seconds"], kv["tiers"])
        finally:
            srv.stop()
    doc = tier_comparison(records)
    for arm, engine in engines.items():
        doc[arm].update(engine)
    doc["host_vs_unlimited_hit_rate"] = doc["host"]["hit_rate"] / doc["unlimited"]["hit_rate"]
    doc["workload"] = asdict(w)
    doc["pool"] = "240 blocks of 16 tokens (max_model_len 3072); unlimited: 4096 blocks; host tier 1 GiB"
    doc["records"] = {arm: [asdict(r) for r in rs] for arm, rs in records.items()}
    return doc


def plot_tiers(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(TIER_ARMS)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(arms, [doc[arm]["hit_rate"] for arm in arms], color=["#999", "#4a7", "#7b5", "#47a"])
    a.set(ylabel="cached / prompt tokens", title="token-weighted hit rate")
    for arm, style in zip(arms, ("--s", "-o", "-^", ":d"), strict=True):
        turns = sorted({r["turn"] for r in doc["records"][arm]})
        ttft = [sorted(r["ttft_s"] for r in doc["records"][arm] if r["turn"] == t) for t in turns]
        b.plot([t + 1 for t in turns], [1e3 * v[len(v) // 2] for v in ttft], style, label=arm)
    b.set(xlabel="turn", ylabel="TTFT p50 (ms)", yscale="log", title="time to first token per turn")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# the store experiment: 7 sessions (odd, so round-robin moves every session's next turn to the other worker)
STORE_WORKLOAD = Workload(sessions=7, turns=4, system_tokens=200, tenants=7, first_user_tokens=1200,
                          new_tokens_per_turn=64, output_tokens=16, think_s=0.0, concurrency=1)


def shared_store(out: Path, w: Workload = STORE_WORKLOAD) -> dict:
    tok = load_tokenizer(preset_dir("tiny_agent"))
    binary = installed_master()
    if binary is None:
        raise RuntimeError("mooncake_master is not installed: pip install -e '.[test]' (make test does)")
    records, tiers = {}, {}
    for arm in ("no_store", "store", "store_master_killed"):
        master = MooncakeMaster(binary, out / f"master_{arm}.log") if arm != "no_store" else None
        store = ([f"engine.{k}={v}" for k, v in master.overrides(gb=0.5).items()] if master else [])
        workers = [serve(out, f"store_{arm}_worker{i}", "engine.num_blocks=4096", "engine.max_model_len=3072",
                         *store) for i in range(2)]
        gateway = Gateway(out, f"smg_{arm}", workers, "round_robin", preset_dir("tiny_agent"))
        kill = (lambda t, m=master: m.kill() if t == 1 else None) if arm == "store_master_killed" else None
        try:
            t0 = time.perf_counter()
            records[arm] = smg_rounds(gateway.url, [s.client for s in workers], w, tok.decode, between_rounds=kill)
            tiers[arm] = {"seconds": time.perf_counter() - t0,
                          "tiers": [s.client.engine_info()["kv"]["tiers"] for s in workers]}
            log.info("store %s: %.1f s", arm, tiers[arm]["seconds"])
        finally:
            gateway.stop()
            for s in workers:
                s.stop()
            if master is not None:
                master.kill()
    doc = store_comparison(records)
    for arm, extra in tiers.items():
        doc[arm].update(extra)
    doc["workload"] = asdict(w)
    doc["setup"] = ("two workers (tiny_agent, one rank each, 4096 blocks) behind smg --policy round_robin; the store "
                    "arms share one mooncake_master (0.5 GiB per worker); store_master_killed: killed after turn 2")
    doc["records"] = records
    return doc


def plot_store(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = ("no_store", "store", "store_master_killed")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(arms, [doc[arm]["moved_hit_rate"] for arm in arms], color=["#999", "#4a7", "#c84"])
    a.set(ylabel="cached / prompt tokens", title="turns that changed worker: hit rate")
    for arm, style in zip(arms, ("--s", "-o", ":^"), strict=True):
        rs = doc["records"][arm]
        turns = sorted({r["turn"] for r in rs})
        ttft = [sorted(r["ttft_s"] for r in rs if r["turn"] == t and r["ttft_s"] is not None) for t in turns]
        b.plot([t + 1 for t in turns], [1e3 * v[len(v) // 2] for v in ttft], style, label=arm)
    b.set(xlabel="turn", ylabel="TTFT p50 (ms)", yscale="log", title="time to first token per turn (through smg)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def two_workers(out: Path, w: Workload) -> dict:
    ckpt = preset_dir("tiny_agent")
    tok = load_tokenizer(ckpt)
    workers = [serve(out, f"worker{i}", "engine.num_blocks=4096") for i in range(2)]
    gateway = None
    try:
        gateway = Gateway(out, "smg", workers, "cache_aware", preset_dir("tiny_agent"))
        time.sleep(2.0)  # the KV event subscriptions open
        return smg_sessions(gateway.url, gateway.metrics_url, [s.client for s in workers],
                            replace(w, tenants=max(w.tenants, 2)), flush_after_turn=w.turns // 2, decode=tok.decode)
    finally:
        if gateway is not None:
            gateway.stop()
        for s in workers:
            s.stop()


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, style in (("on", "-o"), ("off", "--s")):
        turns = doc["sessions"][mode]["per_turn"]
        x = [t["turn"] for t in turns]
        a.plot(x, [1e3 * t["ttft_p50_s"] for t in turns], style, label=f"cache {mode} p50")
        a.plot(x, [1e3 * t["ttft_p99_s"] for t in turns], style, alpha=0.4, label=f"cache {mode} p99")
        b.plot(x, [t["computed_tokens"] for t in turns], style, label=f"cache {mode}")
    a.set(xlabel="turn", ylabel="TTFT (ms)", title="time to first token per turn")
    b.set(xlabel="turn", ylabel="prompt tokens computed", title="prefill work per turn")
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/agentic")
    for f in ("sessions", "turns", "system_tokens", "first_user_tokens", "new_tokens_per_turn", "output_tokens",
              "concurrency", "tenants"):
        parser.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(Workload(), f))
    parser.add_argument("--think-s", type=float, default=Workload().think_s)
    parser.add_argument("--alloc-requests", type=int, default=32)
    parser.add_argument("--skip", default="",
                        help="comma list of: sessions, allocation, retention, smg, tiers, store")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = Workload(**{f: getattr(args, f) for f in ("sessions", "turns", "system_tokens", "first_user_tokens",
                                                  "new_tokens_per_turn", "output_tokens", "concurrency", "think_s",
                                                  "tenants")})
    skip = set(filter(None, args.skip.split(",")))
    doc = {"workload": asdict(w), "command": " ".join(sys.argv)}
    if "sessions" not in skip:
        doc["sessions"] = cache_on_off(out, w)
    if "allocation" not in skip:
        doc["allocation"] = allocation(out, args.alloc_requests)
    if "retention" not in skip:
        doc["retention"] = retention(out, w)
    if "smg" not in skip:
        doc["two_workers_smg"] = two_workers(out, w)
    if "tiers" not in skip:
        doc["tiers"] = tiers(out)
    if "store" not in skip:
        doc["store"] = shared_store(out)
    (out / "agentic.json").write_text(json.dumps(doc, indent=1))
    if "sessions" in doc:
        plot(doc, out / "agentic.png")
    if "tiers" in doc:
        plot_tiers(doc["tiers"], out / "agentic_tiers.png")
    if "store" in doc:
        plot_store(doc["store"], out / "agentic_store.png")
    slim = {k: ({kk: vv for kk, vv in v.items() if kk != "records"} if isinstance(v, dict) else v)
            for k, v in doc.items()}
    print(json.dumps({k: v for k, v in slim.items() if k != "sessions"}, indent=1))
    if "sessions" in doc:
        print(json.dumps({m: {k: v for k, v in doc["sessions"][m].items() if k != "records"}
                          for m in ("on", "off", "on_vs_off")}, indent=1))


if __name__ == "__main__":
    main()
