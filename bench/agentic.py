"""Agent sessions at cache speed (``scripts/bench_agentic.py``): a synthetic generator with the shape of published
coding-agent traffic — S sessions × T turns, each turn re-sending its whole history plus a new tool result or user
message, one system prompt shared by every session, short outputs, think time between turns — replayed through
gRPC at a concurrency, with the prefix cache on and off in one run; plus three side experiments: on-demand vs
reserved KV on one pool, retention under memory pressure, and two workers behind smg's cache-aware router.

Published ratios the defaults follow (the traces themselves cannot be downloaded here): vLLM's Codex / SWE-bench-Pro
traces are 94.2 % cacheable at 131 input tokens per output token; "AgentX" traffic > 96 % prefix hits
(``docs/kv_cache.md``). Token ids are drawn from the character tokenizer's printable range, so a prompt is also text
(the smg mode sends text).
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from bench.metrics import percentile
from rpc.client import Client

PRINTABLE = (7, 103)  # ids of printable characters in model.tiny's character tokenizer


@dataclass(frozen=True, kw_only=True)
class Workload:
    sessions: int = 4
    turns: int = 6
    system_tokens: int = 3000  # shared by the sessions of a tenant
    tenants: int = 1  # distinct system prompts, sessions assigned in turn
    first_user_tokens: int = 800  # the task: files, the issue
    new_tokens_per_turn: int = 64  # a tool result or user message
    output_tokens: int = 64
    think_s: float = 0.2
    concurrency: int = 4
    block_size: int = 16
    seed: int = 0


@dataclass(frozen=True)
class TurnRecord:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached: int  # block-aligned: what an earlier request of this run had computed, the last prompt block out
    ttft_s: float
    e2e_s: float
    output_tokens: int


def segments(w: Workload) -> list[list[list[int]]]:
    """Per session, per turn, the new tokens it sends (turn 0: the shared system prompt + its first message)."""
    rng = random.Random(w.seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(*PRINTABLE) for _ in range(n)]
    systems = [text(w.system_tokens) for _ in range(w.tenants)]
    return [[systems[s % w.tenants] + text(w.first_user_tokens)] + [text(w.new_tokens_per_turn)
                                                                    for _ in range(w.turns - 1)]
            for s in range(w.sessions)]


def ideal_cached(prompt_len: int, seen: int, block_size: int) -> int:
    """Tokens a perfect block cache serves: the ``seen`` ones an earlier request computed, in whole blocks, never the
    block holding the last prompt token."""
    return min(seen, prompt_len - 1) // block_size * block_size


def run_sessions(client: Client, w: Workload, retain: bool = False, bar=None) -> list[TurnRecord]:
    """Every session's turns, ``w.concurrency`` sessions at a time; greedy outputs of ``w.output_tokens``."""
    plan, records, lock = segments(w), [], threading.Lock()
    pending = list(range(w.sessions))
    system_seen = [False] * w.tenants

    def session(s: int) -> None:
        history: list[int] = []
        seen = 0  # tokens of history an earlier request computed (the previous output's last token never was)
        for t, new in enumerate(plan[s]):
            prompt = history + new
            with lock:
                shared = w.system_tokens if system_seen[s % w.tenants] else 0
                system_seen[s % w.tenants] = True
            send = time.perf_counter()
            stream = client.stream(prompt, temperature=0.0, max_tokens=w.output_tokens, ignore_eos=True,
                                   retain_kv=retain, timeout=600)
            first, output = None, []
            for delta in stream:
                if delta and first is None:
                    first = time.perf_counter()
                output += delta
            end = time.perf_counter()
            rec = TurnRecord(s, t, len(prompt), stream.result.cached_tokens,
                             ideal_cached(len(prompt), max(seen, shared), w.block_size), (first or end) - send,
                             end - send, len(output))
            with lock:
                records.append(rec)
            if bar is not None:
                bar.update(1)
            history, seen = prompt + output, len(prompt) + len(output) - 1
            time.sleep(w.think_s)

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                s = pending.pop(0)
            session(s)

    threads = [threading.Thread(target=worker) for _ in range(min(w.concurrency, w.sessions))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(records, key=lambda r: (r.session, r.turn))


def summarize(records: list[TurnRecord], seconds: float) -> dict:
    """Per turn: TTFT p50/p99, prompt tokens computed (prompt − cached); overall: hit rate against the ideal and
    against all prompt tokens, output tokens per second."""
    turns = sorted({r.turn for r in records})
    per_turn = []
    for t in turns:
        rs = [r for r in records if r.turn == t]
        ttft = [r.ttft_s for r in rs]
        per_turn.append({"turn": t + 1, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                         "prompt_tokens": sum(r.prompt_tokens for r in rs) / len(rs),
                         "computed_tokens": sum(r.prompt_tokens - r.cached_tokens for r in rs) / len(rs),
                         "cached_tokens": sum(r.cached_tokens for r in rs) / len(rs)})
    cached, ideal = sum(r.cached_tokens for r in records), sum(r.ideal_cached for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    return {"per_turn": per_turn, "cached_tokens": cached, "ideal_cached_tokens": ideal, "prompt_tokens": prompt,
            "hit_rate_vs_ideal": cached / ideal if ideal else None, "hit_rate": cached / prompt if prompt else 0.0,
            "ideal_hit_rate": ideal / prompt if prompt else 0.0,
            "output_tokens_per_s": sum(r.output_tokens for r in records) / seconds, "seconds": seconds}


def compare(on: dict, off: dict, from_turn: int = 5) -> dict:
    """Cache on against off: computed prompt tokens per turn (ratio, turns ≥ 2) and TTFT p50 from ``from_turn``."""
    pairs = [(a, b) for a, b in zip(on["per_turn"], off["per_turn"], strict=True) if a["turn"] >= 2]
    late = [(a, b) for a, b in zip(on["per_turn"], off["per_turn"], strict=True) if a["turn"] >= from_turn]
    return {"computed_ratio_per_turn": {a["turn"]: a["computed_tokens"] / b["computed_tokens"] for a, b in pairs},
            "max_computed_ratio": max(a["computed_tokens"] / b["computed_tokens"] for a, b in pairs),
            f"ttft_p50_ratio_from_turn_{from_turn}": {a["turn"]: a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in late},
            "max_ttft_p50_ratio": max((a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in late), default=None)}


def run_rounds(client: Client, w: Workload) -> list[TurnRecord]:
    """Every session's turn t, ``w.concurrency`` at a time, before any session's turn t + 1: each session waits (on
    a tool, a user) while every other session takes its turn, so a small pool evicts it in between. Greedy outputs of
    ``w.output_tokens``; ``w.think_s`` between rounds."""
    plan, records, lock = segments(w), [], threading.Lock()
    histories: list[list[int]] = [[] for _ in range(w.sessions)]
    seen = [0] * w.sessions

    def turn(s: int, t: int) -> None:
        prompt = histories[s] + plan[s][t]
        send = time.perf_counter()
        stream = client.stream(prompt, temperature=0.0, max_tokens=w.output_tokens, ignore_eos=True, timeout=600)
        first, output = None, []
        for delta in stream:
            if delta and first is None:
                first = time.perf_counter()
            output += delta
        end = time.perf_counter()
        with lock:
            records.append(TurnRecord(s, t, len(prompt), stream.result.cached_tokens,
                                      ideal_cached(len(prompt), seen[s], w.block_size), (first or end) - send,
                                      end - send, len(output)))
        histories[s], seen[s] = prompt + output, len(prompt) + len(output) - 1

    for t in range(w.turns):
        pending = list(range(w.sessions))

        def worker(t=t, pending=pending) -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    s = pending.pop(0)
                turn(s, t)
        threads = [threading.Thread(target=worker) for _ in range(min(w.concurrency, w.sessions))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        time.sleep(w.think_s)
    return sorted(records, key=lambda r: (r.session, r.turn))


def tier_comparison(arms: dict[str, list[TurnRecord]], host: str = "host", cold: str = "no_tier") -> dict:
    """Per arm the token-weighted hit rate (cached over prompt tokens) and prompt tokens computed; then the turns the
    ``host`` arm served mostly from cache (≥ half the ideal) against the same (session, turn) pairs in the ``cold``
    arm: TTFT p50/p99 of each and their ratio."""
    out = {}
    for name, records in arms.items():
        prompt, cached = sum(r.prompt_tokens for r in records), sum(r.cached_tokens for r in records)
        out[name] = {"hit_rate": cached / prompt, "cached_tokens": cached, "prompt_tokens": prompt,
                     "computed_tokens": prompt - cached,
                     "ideal_hit_rate": sum(r.ideal_cached for r in records) / prompt}
    warm = {(r.session, r.turn): r for r in arms[host] if r.turn > 0 and 2 * r.cached_tokens >= r.ideal_cached > 0}
    same = [r for r in arms[cold] if (r.session, r.turn) in warm]
    hot, base = [warm[(r.session, r.turn)].ttft_s for r in same], [r.ttft_s for r in same]
    out["host_hit_turns"] = {
        "turns": len(same), "cold_cached_tokens": sum(r.cached_tokens for r in same),
        "ttft_p50_s": percentile(hot, 50) if hot else None, "ttft_p99_s": percentile(hot, 99) if hot else None,
        "cold_ttft_p50_s": percentile(base, 50) if base else None,
        "cold_ttft_p99_s": percentile(base, 99) if base else None,
        "ttft_p50_ratio": percentile(hot, 50) / percentile(base, 50) if hot else None}
    return out


# ---- side experiments ----------------------------------------------------------------------------------------


def peak_running(client: Client, requests: int, prompt_tokens: int, min_tokens: int, seed: int = 1) -> dict:
    """``requests`` at once with ``max_tokens`` unset (the engine's default: the rest of max_model_len) and outputs
    that end soon after ``min_tokens`` (a third of the vocabulary are stop ids): the most requests running at once,
    sampled from GetLoads while they run."""
    rng = random.Random(seed)
    stops = list(range(PRINTABLE[0], PRINTABLE[1], 3))
    peak, done = 0, threading.Event()

    def run(prompt):
        list(client.stream(prompt, temperature=0.0, min_tokens=min_tokens, stop_token_ids=stops, timeout=600))

    threads = [threading.Thread(target=run, args=([rng.randrange(*PRINTABLE) for _ in range(prompt_tokens)],))
               for _ in range(requests)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()

    def watch():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, client.loads()["num_running_reqs"])
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    for th in threads:
        th.join()
    done.set()
    watcher.join()
    return {"requests": requests, "peak_running": peak, "seconds": time.perf_counter() - t0}


def retention_probe(client: Client, w: Workload, noise_requests: int, noise_tokens: int, retain: bool) -> dict:
    """Agent turns that end and wait on a tool (asking for retention, or not) while unrelated traffic fills the pool;
    their next turns' cached tokens against what they could have had."""
    rng = random.Random(w.seed + 7)
    plan = segments(w)
    firsts = []
    for s in range(w.sessions):  # each turn ends in a tool call: it asks for retention (or not, to compare)
        prompt = plan[s][0]
        stream = client.stream(prompt, retain_kv=retain, temperature=0.0, max_tokens=w.output_tokens, ignore_eos=True)
        firsts.append(prompt + [t for delta in stream for t in delta])
    for _ in range(noise_requests):  # the agents think; others' traffic churns the pool
        client.generate([rng.randrange(*PRINTABLE) for _ in range(noise_tokens)], temperature=0.0, max_tokens=4,
                        ignore_eos=True)
    got = ideal = 0
    for s, history in enumerate(firsts):
        prompt = history + plan[s][1]
        got += client.generate(prompt, temperature=0.0, max_tokens=4, ignore_eos=True).cached_tokens
        ideal += ideal_cached(len(prompt), len(history) - 1, w.block_size)
    return {"retain": retain, "cached_tokens": got, "ideal_cached_tokens": ideal, "hit_rate_vs_ideal": got / ideal}


@dataclass
class Landing:
    """Where one session's turns ran (worker index per turn), before and after a worker's flush."""

    session: int
    workers: list[int] = field(default_factory=list)


def index_blocks(metrics_url: str) -> dict[str, float]:
    """smg's ``smg_kv_index_blocks`` gauge per worker label set: the blocks its event-fed index holds."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("smg_kv_index_blocks{")}


def smg_sessions(base_url: str, metrics_url: str, workers: list[Client], w: Workload, flush_after_turn: int,
                 decode) -> dict:
    """Sessions one at a time through smg's OpenAI completions (text prompts), each turn attributed to the worker
    whose prompt-token counter moved; after turn ``flush_after_turn`` the worker holding most sessions is flushed.
    Returns per session the workers of its turns, the share of turns 2.. that landed where its prefix was, smg's
    index sizes per worker before and after the flush, and where the flushed worker's sessions went next."""
    plan = segments(w)
    landings = [Landing(s) for s in range(w.sessions)]
    histories = [""] * w.sessions

    def counters():
        return [c.engine_info()["kv"]["prompt_tokens"] for c in workers]

    def turn(s: int, t: int) -> None:
        before = counters()
        prompt = histories[s] + decode(plan[s][t])
        body = json.dumps({"model": "tiny_agent", "prompt": prompt, "max_tokens": w.output_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
        text = json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]["text"]
        moved = [a - b for a, b in zip(counters(), before, strict=True)]
        landings[s].workers.append(max(range(len(workers)), key=lambda i: moved[i]))
        histories[s] = prompt + text

    for t in range(flush_after_turn):
        for s in range(w.sessions):
            turn(s, t)
    held = [sum(lnd.workers[-1] == i for lnd in landings) for i in range(len(workers))]
    flushed = max(range(len(workers)), key=lambda i: held[i])
    before = index_blocks(metrics_url)
    ok, why = workers[flushed].flush_cache(timeout_s=5.0)
    time.sleep(1.0)  # smg applies the KvCacheCleared event
    after_flush = index_blocks(metrics_url)
    moved_sessions = [lnd.session for lnd in landings if lnd.workers[-1] == flushed]
    for t in range(flush_after_turn, w.turns):
        for s in range(w.sessions):
            turn(s, t)
    stayed = [lnd.workers[t] == lnd.workers[0] for lnd in landings for t in range(1, flush_after_turn)]
    after = [landings[s].workers[flush_after_turn] for s in moved_sessions]
    return {"landings": [asdict(lnd) for lnd in landings], "flushed_worker": flushed, "flush": [ok, why],
            "smg_index_blocks_before_flush": before, "smg_index_blocks_after_flush": after_flush,
            "turns_on_prefix_worker_before_flush": sum(stayed) / len(stayed) if stayed else None,
            "flushed_sessions_next_turn_on": after,
            "flushed_sessions_left_it": sum(a != flushed for a in after) / len(after) if after else None}


def smg_rounds(base_url: str, workers: list[Client], w: Workload, decode, between_rounds=None) -> list[dict]:
    """Every session's turn t, one request at a time, through smg's streaming OpenAI completions (text prompts),
    before any turn t + 1; ``between_rounds(t)`` after round t. Per turn: the worker it landed on (whose prompt-token
    counter moved), prompt and cached tokens (``usage``), TTFT, and the error if it failed."""
    plan = segments(w)
    histories = [""] * w.sessions
    out = []

    def counters():
        return [c.engine_info()["kv"]["prompt_tokens"] for c in workers]

    for t in range(w.turns):
        for s in range(w.sessions):
            prompt = histories[s] + decode(plan[s][t])
            before = counters()
            body = json.dumps({"model": "tiny_agent", "prompt": prompt, "max_tokens": w.output_tokens,
                               "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
            rec = {"session": s, "turn": t, "prompt_tokens": 0, "cached_tokens": 0, "ttft_s": None, "error": None}
            text, send = "", time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=600) as resp:
                    for line in resp:
                        line = line.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices", []):
                            if choice.get("text") and rec["ttft_s"] is None:
                                rec["ttft_s"] = time.perf_counter() - send
                            text += choice.get("text") or ""
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            rec["prompt_tokens"] = usage["prompt_tokens"]
                            rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            except OSError as e:
                rec["error"] = str(e)
            moved = [a - b for a, b in zip(counters(), before, strict=True)]
            rec["worker"] = max(range(len(workers)), key=lambda i: moved[i])
            out.append(rec)
            histories[s] = prompt + text
        if between_rounds is not None:
            between_rounds(t)
    return out


def moved_turns(records: list[dict]) -> list[dict]:
    """The turns that landed on another worker than the session's previous turn."""
    last = {}
    moved = []
    for r in sorted(records, key=lambda r: (r["turn"], r["session"])):
        if r["session"] in last and last[r["session"]] != r["worker"]:
            moved.append(r)
        last[r["session"]] = r["worker"]
    return moved


def store_comparison(arms: dict[str, list[dict]], store: str = "store", cold: str = "no_store") -> dict:
    """Per arm: turns that changed worker, the token-weighted hit rate over them, failed requests; then the moved
    turns the ``store`` arm served at least half from cache against the same (session, turn) in the ``cold`` arm:
    TTFT."""
    out = {}
    for name, records in arms.items():
        moved = moved_turns(records)
        prompt = sum(r["prompt_tokens"] for r in moved)
        out[name] = {"turns": len(records), "moved_turns": len(moved),
                     "moved_hit_rate": sum(r["cached_tokens"] for r in moved) / prompt if prompt else None,
                     "failed": sum(r["error"] is not None for r in records)}
    hot = {(r["session"], r["turn"]): r for r in moved_turns(arms[store])
           if r["error"] is None and 2 * r["cached_tokens"] >= r["prompt_tokens"]}
    pairs = [(hot[(r["session"], r["turn"])]["ttft_s"], r["ttft_s"]) for r in arms[cold]
             if (r["session"], r["turn"]) in hot and r["ttft_s"] is not None]
    if pairs:
        warm, base = [a for a, _ in pairs], [b for _, b in pairs]
        out["store_hit_turns"] = {"turns": len(pairs), "ttft_p50_s": percentile(warm, 50),
                                  "cold_ttft_p50_s": percentile(base, 50),
                                  "ttft_p50_ratio": percentile(warm, 50) / percentile(base, 50)}
    return out

