"""Soak the gRPC server: many streaming requests, some cancelled mid-stream; nothing may be lost.

    python scripts/soak.py                                   # starts its own server (scripts/serve.py, loopback)
    python scripts/soak.py parallel=tp8 parallel.world_size=2 parallel.attn_tp=2 parallel.moe_tp=1 parallel.moe_ep=2
    python scripts/soak.py --target 127.0.0.1:50051          # an already running server

Each request streams a random prompt (1-24 ids) with a random max_tokens and greedy or seeded sampling;
``--cancel-frac`` of them are cancelled after 1-3 chunks. Every request must end as *completed* (a Complete whose
finish_reason is stop/length and whose completion_tokens equals the streamed tokens) or *cancelled* (CANCELLED
after our cancel); anything else is *lost*. At the end KV usage must be back to zero and health SERVING. Prints one
JSON summary; exits 1 if anything was lost, KV leaked or health is not SERVING.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from parallelism.launch import free_port
from rpc.client import Client

ROOT = Path(__file__).resolve().parent.parent


def one_request(client: Client, i: int, seed: int, cancel: bool, vocab: int) -> dict:
    rng = random.Random(seed * 100_003 + i)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
    max_tokens = rng.randint(48, 96) if cancel else rng.randint(4, 32)
    sampling = dict(temperature=0.0) if rng.random() < 0.5 else dict(temperature=0.8, top_p=0.9, seed=i)
    cancel_after = rng.randint(1, 3)
    t0 = time.perf_counter()
    s = client.stream(prompt, max_tokens=max_tokens, ignore_eos=cancel, timeout=300, **sampling)
    chunks = 0
    try:
        for _ in s:
            chunks += 1
            if cancel and chunks == cancel_after:
                s.cancel()
    except grpc.RpcError as err:
        if cancel and err.code() == grpc.StatusCode.CANCELLED:
            return {"outcome": "cancelled", "s": time.perf_counter() - t0}
        return {"outcome": "lost", "why": f"{err.code().name}: {err.details()}"}
    r = s.result
    ok = (r.finish_reason in ("stop", "length") and r.completion_tokens == len(r.token_ids) > 0
          and (r.finish_reason != "length" or len(r.token_ids) == max_tokens))
    if not ok:
        return {"outcome": "lost", "why": f"bad end: {r.finish_reason} {r.completion_tokens} vs {len(r.token_ids)}"}
    return {"outcome": "completed", "s": time.perf_counter() - t0, "tokens": len(r.token_ids)}


def settle(client: Client, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = client.loads()
        if (load["num_running_reqs"] == load["num_waiting_reqs"] == 0 and load["kv_usage"] == 0) or \
                time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def soak(client: Client, n: int, concurrency: int, cancel_frac: float, seed: int) -> dict:
    vocab = int(client.model_info()["vocab_size"])
    cancel = set(random.Random(seed).sample(range(n), round(n * cancel_frac)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one_request(client, i, seed, i in cancel, vocab), range(n)))
    wall = time.perf_counter() - t0
    load = settle(client)
    done = [r for r in results if r["outcome"] == "completed"]
    lat = sorted(r["s"] for r in done)
    healthy, message = client.health_check()
    return {
        "requests": n, "concurrency": concurrency, "cancel_planned": len(cancel),
        "completed": len(done), "cancelled": sum(r["outcome"] == "cancelled" for r in results),
        "lost": sum(r["outcome"] == "lost" for r in results),
        "lost_reasons": sorted({r["why"] for r in results if r["outcome"] == "lost"})[:10],
        "wall_s": round(wall, 2), "output_tokens": sum(r["tokens"] for r in done),
        "output_tokens_per_s": round(sum(r["tokens"] for r in done) / wall, 1),
        "e2e_s": {"median": round(statistics.median(lat), 3), "p99": round(lat[int(0.99 * (len(lat) - 1))], 3)}
        if lat else {},
        "end": {"kv_usage": load["kv_usage"], "running": load["num_running_reqs"], "waiting": load["num_waiting_reqs"],
                "health": client.health(), "vllm_health_check": {"healthy": healthy, "message": message},
                "active_requests": int(client.server_info()["engine"]["server"]["active_streams"])},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HOST:PORT of a running server (default: start one on loopback)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--cancel-frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_overrides", nargs="*", help="hydra overrides for scripts/serve.py")
    args = ap.parse_args()
    server = None
    target = args.target
    if target is None:
        port = free_port()
        target = f"127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile("w", prefix="soak-server-", suffix=".log", delete=False)
        server = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve.py"), "server.host=127.0.0.1",
                                   f"server.port={port}", *args.serve_overrides], stdout=log, stderr=subprocess.STDOUT)
        print(f"server log: {log.name}", file=sys.stderr)
    client = Client(target)
    try:
        client.wait_ready(timeout=180)
        summary = soak(client, args.requests, args.concurrency, args.cancel_frac, args.seed)
        summary["layout"] = client.engine_info()["layout"]
    finally:
        client.close()
        if server is not None:
            server.terminate()
            print(f"server exit code after SIGTERM: {server.wait(timeout=60)}", file=sys.stderr)
    print(json.dumps(summary, indent=1))
    end = summary["end"]
    sys.exit(0 if summary["lost"] == 0 and end["kv_usage"] == 0 and end["health"] == "SERVING" else 1)


if __name__ == "__main__":
    main()
