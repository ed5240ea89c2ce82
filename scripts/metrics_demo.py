"""The dashboard's panels from a real Prometheus, as a PNG (docs/metrics.md, README "Metrics"):

    python scripts/metrics_demo.py [--out docs/metrics_dashboard.png] [--phase-s 40]

Starts ``scripts/serve.py`` (the committed tiny_kimi pair, two CPU ranks, DDTree 16, a KV pool of 80 blocks of 16
tokens and 8 running slots) with ``/metrics`` on a free loopback port, and Prometheus (Debian's ``prometheus``) on
127.0.0.1 with a temporary config and storage, scraping it every second. Load, in phases of ``--phase-s`` seconds,
prompts made of the pair's held-out Python snippets: idle; 2 clients re-sending a shared 400-token prefix
(prefix-cache hits); 8 clients with 300-token prompts and 64 output tokens (more KV than the pool holds: requests wait
for blocks and get preempted); idle. Then it asks
Prometheus' ``/api/v1/query_range`` for the queries of panels of ``docs/grafana_dashboard.json`` and draws them with
matplotlib.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import Server  # noqa: E402 - after the path insert
from parallelism.launch import free_port  # noqa: E402

PANELS = ("Tokens per second", "Time to first token", "Requests", "KV-cache usage", "Prefix-cache hit rate",
          "Acceptance length τ", "Why the GPUs were not busier (share of wall time)", "CPU use per rank (no GPU)")
SERVER = ["model=tiny_kimi", "spec_decode=ddtree", "spec_decode.budget=16", "spec_decode.tree_temperature=0.33",
          "parallel.world_size=2", "parallel.attn_tp=2", "parallel.moe_ep=2", "engine.num_blocks=80",
          "engine.gpu_memory_utilization=null", "server.max_num_seqs=8", "server.heartbeat_s=1",
          "server.telemetry_interval_s=1"]


def prometheus(metrics_port: int, workdir: Path) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus not installed: apt-get install -y prometheus")
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: switchyard\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    return proc, port


def code_prompts() -> list[list[int]]:
    """The held-out Python snippets the tiny_kimi pair was evaluated on (token ids): the drafter knows code."""
    return [p["ids"] for p in json.loads((ROOT / "model/zoo/tiny_kimi/eval_prompts.json").read_text())["prompts"]]


def clients(server: Server, n: int, prompt_len: int, output_len: int, seconds: float, shared: int, seed: int) -> int:
    """``n`` closed-loop clients for ``seconds``, each prompt ``prompt_len`` tokens of concatenated code snippets of
    which the first ``shared`` are the same for every request. Returns the requests done."""
    done, stop, snippets = [0], time.monotonic() + seconds, code_prompts()

    def code(rng: random.Random, length: int) -> list[int]:
        ids = []
        while len(ids) < length:
            ids += rng.choice(snippets)
        return ids[:length]

    prefix = code(random.Random(seed), shared)

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop:
            prompt = prefix + code(rng, prompt_len - shared)
            list(server.client.stream(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True))
            done[0] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0]


def query_range(port: int, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
    args = urllib.parse.urlencode({"query": expr.replace("$__rate_interval", "10s").replace("$model_name", ".*"),
                                   "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query_range?{args}", timeout=30) as resp:
        return json.load(resp)["data"]["result"]


def draw(port: int, start: float, end: float, phases: list[tuple[str, float, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dash = json.loads((ROOT / "docs" / "grafana_dashboard.json").read_text())
    panels = {p["title"]: p for p in dash["panels"] if p["type"] != "row"}
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    for i, (ax, title) in enumerate(zip(axes.flat, PANELS, strict=True)):
        panel, stacked = panels[title], panels[title]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"]
        series = []
        for target in panel["targets"]:
            for s in query_range(port, target["expr"], start, end):
                label = target["legendFormat"]
                for k, v in s["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                ts = [float(t) - start for t, _ in s["values"]]
                series.append((label, ts, [float(v) for _, v in s["values"]]))
        if stacked == "normal":
            series = [s for s in series if max(s[2], default=0) > 0]
            if series:
                ax.stackplot(series[0][1], *[s[2] for s in series], labels=[s[0] for s in series], alpha=0.8)
        else:
            for label, ts, values in series:
                ax.plot(ts, values, label=label)
        for j, (name, a, b) in enumerate(phases):
            ax.axvspan(a - start, b - start, alpha=0.08 * (j % 2), color="grey")
            if i < 4:
                ax.text((a + b) / 2 - start, 1.0, name, transform=ax.get_xaxis_transform(), ha="center",
                        va="bottom", fontsize=7)
        ax.set_title(title, fontsize=10, pad=14)
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("docs/grafana_dashboard.json's queries on a real Prometheus scraping switchyard's /metrics "
                 "(tiny_kimi + DDTree 16, 2 CPU ranks: no GPU, so CPU use stands in for power)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "metrics_dashboard.png"))
    ap.add_argument("--phase-s", type=float, default=40.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = Server(SERVER, work / "server.log", timeout_s=300)
        prom, port = prometheus(server.metrics_port, work)
        try:
            phases, start = [], time.time()
            time.sleep(args.phase_s / 2)
            phases.append(("idle", start, time.time()))
            t = time.time()
            n = clients(server, 2, 440, 32, args.phase_s, shared=400, seed=1)
            phases.append(("2 clients, shared prefix", t, time.time()))
            print(f"2 clients, shared prefix: {n} requests")
            t = time.time()
            n = clients(server, 8, 300, 64, args.phase_s, shared=0, seed=2)
            phases.append(("8 clients, KV short", t, time.time()))
            print(f"8 clients, KV short: {n} requests")
            t = time.time()
            time.sleep(args.phase_s / 2)
            phases.append(("idle", t, time.time()))
            end = time.time()
            time.sleep(3)  # the last scrapes
            draw(port, start, end, phases, Path(args.out))
            totals = query_range(port, "sum by (reason) (switchyard:idle_seconds_total)", end, end)
            print("idle seconds by reason over the run:",
                  {s["metric"]["reason"]: round(float(s["values"][-1][1]), 1) for s in totals})
            for expr in ("vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"):
                print(expr, query_range(port, expr, end, end)[0]["values"][-1][1])
            print(f"wrote {args.out} ({end - start:.0f} s of load)")
        finally:
            prom.terminate()
            prom.wait(timeout=30)
            server.stop()


if __name__ == "__main__":
    main()
