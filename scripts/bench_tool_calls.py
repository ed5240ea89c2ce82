"""Tool calls through smg on the bundled agent model (``bench/tool_calls.py``), one run::

    python scripts/bench_tool_calls.py --out docs/tool_calls/bench.json

Two single-rank workers on ``model=tiny_kimi_agent`` with ``server.reasoning_parser=kimi`` (plain decoding and
DDTree), each behind two smg 1.13 gateways with ``--tool-call-parser kimik2``: one without a reasoning parser for
thinking off (``chat_template_kwargs: {"thinking": false}``), one with ``--reasoning-parser kimi_thinking`` for thinking
on. Cells: ``tool_choice`` required / named / auto × ``parallel_tool_calls`` on / off × concurrency 1 and 16 ×
thinking on / off × DDTree on / off; every request sent once without streaming and once streaming (``--requests``
per cell, held-out tools, the same requests in every cell of a ``tool_choice``). Per cell: the share of responses with
valid ``tool_calls`` (a response cut at ``max_tokens`` fails), streamed = non-streamed calls, finish reasons, tokens
per call, and with DDTree the tokens committed per speculative step (the worker's own count over the cell). Writes
the JSON and a plot beside it (``.png``).

At the settings users run (``--temperatures 0,0.6,1``: ``top_p`` 0.95 above 0, a seed per request), with the
``json_schema`` arm (``--arms``: ``response_format`` with the wanted tool's schema) and the worker of another checkout
(``--worker-repo``: the code before a change, the same model and gateway)::

    python scripts/bench_tool_calls.py --out /tmp/t.json --temperatures 0.7,1 --arms required,named,json_schema \
        --ddtree off --parallel on --concurrency 4 --requests 20 --thinking off
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import Gateway, Server  # noqa: E402
from bench.tool_calls import ARMS, CHOICES, requests, run_cell, summarize  # noqa: E402

log = logging.getLogger("bench_tool_calls")
TARGET = ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
WORKER = ["parallel=single", "model=tiny_kimi_agent", "server.served_model_name=kimi", "engine.max_model_len=4096",
          "server.reasoning_parser=kimi"]
GATEWAYS = {False: ("--tool-call-parser", "kimik2"),
            True: ("--tool-call-parser", "kimik2", "--reasoning-parser", "kimi_thinking")}


def spec_counts(server: Server) -> tuple[int, int]:
    """(speculative request steps, tokens they committed) so far on ``server``."""
    s = server.client.engine_info()["spec_decode"]
    return s["request_steps"], s["committed_tokens"]


def worker_empty_turns(server: Server) -> float | None:
    """``switchyard:empty_turns_total`` on ``server``'s /metrics now (None: a worker without it)."""
    import re
    import urllib.request

    page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(r"^switchyard:empty_turns_total\{[^}]*\} (\S+)$", page, re.M)
    return float(found.group(1)) if found else None


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(cells) + 1.5))
    labels = [c["cell"] for c in cells]
    ax.barh(range(len(cells)), [100 * c["valid_tool_calls"] for c in cells], color=[
        {"required": "tab:blue", "named": "tab:green", "auto": "tab:orange", "json_schema": "tab:gray",
         "followup": "tab:purple"}[
            c["tool_choice"]] for c in cells])
    ax.set_yticks(range(len(cells)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("responses with valid tool_calls (%)")
    ax.set_xlim(0, 100)
    ax.set_title("tiny_kimi_agent through smg kimik2: held-out tools (blue required, green named, orange auto)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=16, help="requests per cell (each sent twice: plain, streamed)")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperatures", default="0", help="comma list; top_p 0.95 above 0")
    ap.add_argument("--arms", default=",".join(CHOICES), help=f"comma list of {ARMS}")
    ap.add_argument("--ddtree", default="off,on")
    ap.add_argument("--thinking", default="off,on")
    ap.add_argument("--parallel", default="on,off", help="parallel_tool_calls values")
    ap.add_argument("--worker-repo", default=str(ROOT), help="the checkout whose worker runs")
    args = ap.parse_args()
    onoff = lambda text: [v == "on" for v in text.split(",")]  # noqa: E731
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the OpenAI SDK's line per request
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_tool_calls_"))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    arms = args.arms.split(",")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    reqs = {c: requests(args.requests, c, args.seed + ARMS.index(c)) for c in arms}
    cells, started = [], time.time()
    for ddtree in onoff(args.ddtree):
        server = Server([*WORKER, f"model.path={TARGET}", *(["spec_decode=ddtree"] if ddtree else [])],
                        tmp / f"worker_ddtree_{ddtree}.log", timeout_s=300, repo=Path(args.worker_repo).resolve())
        try:
            for thinking in onoff(args.thinking):
                gw = Gateway(tmp, f"smg_{ddtree}_{thinking}", [server], "round_robin", TARGET,
                             options=GATEWAYS[thinking])
                oa = OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0, timeout=600)
                try:
                    for temp, choice, parallel, conc in itertools.product(temperatures, arms, onoff(args.parallel),
                                                                          concurrencies):
                        before = spec_counts(server) if ddtree else None
                        empties, t0 = worker_empty_turns(server), time.time()
                        answers = run_cell(oa, reqs[choice], thinking, parallel, args.max_tokens, conc, temp)
                        cell = {"cell": f"{choice} T={temp:g} parallel={'on' if parallel else 'off'} c={conc} "
                                        f"thinking={'on' if thinking else 'off'} ddtree={'on' if ddtree else 'off'}",
                                "tool_choice": choice, "temperature": temp, "top_p": 0.95 if temp > 0 else 1.0,
                                "parallel_tool_calls": parallel, "concurrency": conc,
                                "thinking": thinking, "ddtree": ddtree, "seconds": round(time.time() - t0, 2),
                                **summarize(reqs[choice], answers),
                                "worker_empty_turns": None if empties is None else worker_empty_turns(server) - empties}
                        if ddtree:
                            steps, committed = (a - b for a, b in zip(spec_counts(server), before, strict=True))
                            cell["committed_per_spec_step"] = round(committed / steps, 3) if steps else None
                        cells.append(cell)
                        log.info("%s: %.0f%% valid, stream equal %.0f%%, %s", cell["cell"],
                                 100 * cell["valid_tool_calls"], 100 * cell["stream_equal"], cell["finish_reasons"])
                finally:
                    gw.stop()
        finally:
            server.stop()
    forced = [c for c in cells if c["tool_choice"] in ("required", "named")]
    by_temperature = {f"{t:g}": {arm: {
        "responses": sum(c["responses"] for c in cells if c["temperature"] == t and c["tool_choice"] == arm),
        "valid": sum(round(c["valid_tool_calls"] * c["responses"]) for c in cells
                     if c["temperature"] == t and c["tool_choice"] == arm),
        "truncated": sum(c["truncated"] for c in cells if c["temperature"] == t and c["tool_choice"] == arm)}
        for arm in arms} for t in temperatures}
    doc = {"command": "python scripts/bench_tool_calls.py " + " ".join(sys.argv[1:]),
           "worker_repo": str(Path(args.worker_repo).resolve()), "temperatures": temperatures,
           "by_temperature": by_temperature,
           "machine": platform.processor() or platform.machine(), "seconds": round(time.time() - started, 1),
           "setup": "tiny_kimi_agent, one rank per worker (plain / DDTree), server.reasoning_parser=kimi; smg 1.13 "
                    "kimik2 (thinking off) and kimik2 + kimi_thinking (thinking on); held-out tools, 2-8 per request",
           "requests_per_cell": args.requests, "max_tokens": args.max_tokens,
           "forced_valid_min": min((c["valid_tool_calls"] for c in forced), default=None),
           "forced_truncated": sum(c["truncated"] for c in forced),
           "stream_equal_min": min(c["stream_equal"] for c in cells),
           "auto_valid_mean": round(sum(c["valid_tool_calls"] for c in cells if c["tool_choice"] == "auto")
                                    / max(1, sum(c["tool_choice"] == "auto" for c in cells)), 4),
           "cells": cells}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    log.info("by temperature: %s (%s)", json.dumps(by_temperature), out)


if __name__ == "__main__":
    main()
