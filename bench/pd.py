"""Prefill/decode disaggregation against one aggregated worker under the same mix (``scripts/bench_pd.py``):
decode-heavy streams through smg, and long prompts arriving on a schedule. What is measured per deployment and phase:
the decode streams' inter-token latency (from the arrival times of their SSE chunks), and from the decode worker's
``/metrics`` the hand-off blocks, bytes and seconds and the prompt tokens it recomputed."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from bench.metrics import describe


@dataclass(frozen=True)
class Mix:
    streams: int = 3  # decode streams running at once
    stream_prompt_chars: int = 64
    stream_tokens: int = 48
    long_prompt_chars: int = 4096  # the long prefills (one character is one token of tiny_agent)
    long_every_s: float = 3.0
    phase_s: float = 30.0


@dataclass
class Phase:
    itl_s: list[float] = field(default_factory=list)  # every gap between two chunks of a decode stream
    streams: int = 0
    long_prompts: int = 0
    long_ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # requests the gateway failed (HTTP status and which kind)


def _post(url: str, body: dict, stream: bool):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


def decode_stream(base: str, model: str, prompt: str, tokens: int) -> list[float]:
    """One streamed completion; the arrival time of every chunk that carried text."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    times = []
    with _post(f"{base}/v1/completions", body, stream=True) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


def long_prefill(base: str, model: str, prompt: str) -> float:
    """One long prompt with one output token; its seconds to the answer."""
    t0 = time.perf_counter()
    with _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                          "temperature": 0.0}, stream=False) as resp:
        json.load(resp)
    return time.perf_counter() - t0


def run_phase(base: str, model: str, mix: Mix, with_long: bool, seed: int) -> Phase:
    """``mix.streams`` closed-loop decode streams for ``mix.phase_s`` seconds; with ``with_long``, a long prompt every
    ``mix.long_every_s`` seconds (each a different text, so no prefix cache helps)."""
    phase, lock, stop = Phase(), threading.Lock(), time.monotonic() + mix.phase_s

    def streams(k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            prompt = "".join(chr(97 + (seed + 7 * k + 3 * i + j) % 26) for j in range(mix.stream_prompt_chars))
            try:
                times = decode_stream(base, model, prompt, mix.stream_tokens)
            except urllib.error.HTTPError as e:
                with lock:
                    phase.errors.append(f"stream: HTTP {e.code}")
                continue
            with lock:
                phase.itl_s += [b - a for a, b in zip(times, times[1:], strict=False)]
                phase.streams += 1
            i += 1

    def longs() -> None:
        i = 0
        while time.monotonic() < stop - mix.long_every_s:
            t0 = time.monotonic()
            prompt = "".join(chr(65 + (seed + 11 * i + j * (i + 3)) % 26) for j in range(mix.long_prompt_chars))
            try:
                ttft = long_prefill(base, model, prompt)
            except urllib.error.HTTPError as e:
                with lock:
                    phase.errors.append(f"long prompt: HTTP {e.code}")
                ttft = None
            with lock:
                phase.long_prompts += 1
                if ttft is not None:
                    phase.long_ttft_s.append(ttft)
            i += 1
            time.sleep(max(mix.long_every_s - (time.monotonic() - t0), 0.0))

    threads = [threading.Thread(target=streams, args=(k,)) for k in range(mix.streams)]
    if with_long:
        threads.append(threading.Thread(target=longs))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return phase


def summarize(phase: Phase) -> dict:
    itl = describe(phase.itl_s, (50.0, 99.0))
    return {"streams": phase.streams, "itl_s": itl, "long_prompts": phase.long_prompts,
            "long_latency_s": describe(phase.long_ttft_s, (50.0,)) if phase.long_ttft_s else None,
            "errors": phase.errors}


def pd_samples(metrics_url: str) -> dict[str, float]:
    """The worker's ``switchyard:pd_*`` samples by name (labels folded into the name)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("switchyard:pd_"):
            name, value = line.rsplit(" ", 1)
            labels = [p for p in name.split("{", 1)[1].rstrip("}").split(",") if not p.startswith(("engine", "model"))]
            out[name.split("{")[0] + (f"{{{','.join(labels)}}}" if labels else "")] = float(value)
    return out
