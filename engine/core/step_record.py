"""One stats record per step: :class:`StepRecord`, built once on rank 0 (``engine/core/recorder.py``) and handed to
every subscriber — EngineInfo's counters (:class:`engine.core.recorder.EngineStats`), the Prometheus exporter
(``rpc/metrics.py``), the bench and ``scripts/host_per_step.py``. What each rank sends with a step's result gather
is a :class:`RankReport`. Definitions (idle reasons included): ``docs/metrics.md``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.step import Record, StepKind

IDLE_REASONS = ("no_work", "blocked_kv", "admission_limit", "host_bound", "draining")
HOST_PHASES = ("schedule", "launch", "readback", "update")  # rank 0's phases of Engine.step
LAUNCH_PARTS = ("draft", "target")  # launch split by the runner: the speculator's draft, then the target step


@dataclass(frozen=True, kw_only=True)
class RankLoad:
    """One attention-DP rank's requests and KV blocks. ``blocks_used``: referenced (non-evictable; leased blocks
    included); ``blocks_cached``: in the prefix index (referenced or not); ``blocks_empty``: holding no cached KV;
    cached unreferenced blocks count as free (``blocks_free``: empty + evictable). The
    unpinned waiting requests (one queue) are counted on rank 0; ``cache_hit_rate``: prompt tokens served from this
    rank's prefix cache over those admitted to it."""

    running: int = 0
    waiting: int = 0
    deferred: int = 0  # of the waiting, those put off for a prefix another request is prefilling
    loading: int = 0  # of the waiting, those whose KV is being loaded (engine/worker/kv_loads.py)
    blocks_used: int = 0
    blocks_cached: int = 0
    blocks_empty: int = 0
    blocks_total: int = 1
    waiting_uncached_tokens: int = 0
    cache_hit_rate: float = 0.0

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used


@dataclass(frozen=True, kw_only=True)
class TokenCounts:
    """Tokens of one step. ``prompt_computed``: fed by prefill items (prompt chunks; a resumed request's earlier
    output too); ``prompt_queried`` / ``prompt_cached``: prompt tokens looked up in / served from the prefix cache by
    the admissions of this step; ``generated``: given to requests (first tokens included); ``decoded``: of those, by
    decode and verify items; ``spec_requests`` / ``spec_committed``: speculative items and the tokens they committed
    (bonus included)."""

    prompt_computed: int = 0
    prompt_queried: int = 0
    prompt_cached: int = 0
    generated: int = 0
    decoded: int = 0
    spec_requests: int = 0
    spec_committed: int = 0


@dataclass(frozen=True, kw_only=True)
class RequestEnd:
    """A request that ended (stop, length, abort): vLLM's per-request figures. ``queue_s``: arrival to first
    admission (its whole life when it never ran). ``empty_turn``: a chat answer that stopped with neither content
    nor a call after its thought (``engine/core/turns.py``)."""

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    e2e_s: float
    queue_s: float
    empty_turn: bool = False


@dataclass(frozen=True, kw_only=True)
class RequestTimes:
    """Per-request latencies observed by one record, as vLLM defines them: time to first token (from arrival), one
    inter-token latency per request per step that gave it tokens after its first, and the requests that ended (aborts
    between steps ride on the next record). ``first_prompt_tokens`` / ``first_cached_tokens``: prompt tokens (and those
    from the prefix cache) of the requests that got their first token."""

    ttft_s: tuple[float, ...] = ()
    itl_s: tuple[float, ...] = ()
    first_prompt_tokens: int = 0
    first_cached_tokens: int = 0
    ended: tuple[RequestEnd, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One engine step (``kind`` a :class:`StepKind`) or idle heartbeat (``kind`` None: no forward), on rank 0.

    Time: the record covers ``gap_s + wall_s`` seconds ending at ``t_end`` (monotonic): the gap since the previous
    record, then the step's own ``Engine.step`` calls (with ``engine.overlap=on`` a call finishes the step launched by
    the call before). ``host_ms``: rank 0's phases (:data:`HOST_PHASES`; ``draft`` / ``target``: the runner's split of
    ``launch``); ``device_ms``: the step's device span between CUDA events around its launch (None off CUDA, and
    when the span had not ended at the step's readback).
    ``graphs``: every rank's coverage records; ``comm``: rank 0's collectives ``(calls, bytes)`` by ``(group, op)``
    counted since the previous record; ``kv``: per attention-DP rank after the step; ``accepted``: per speculative
    request, the drafts it accepted (bonus excluded); ``telemetry``: the samples ranks sent with this gather, by rank;
    ``idle_s``: the covered seconds in which the GPUs could have done more, by reason (:data:`IDLE_REASONS`,
    ``docs/metrics.md``)."""

    step_id: int | None
    kind: StepKind | None
    t_end: float
    gap_s: float
    wall_s: float
    host_ms: Mapping[str, float] = field(default_factory=dict)
    device_ms: float | None = None
    tokens: TokenCounts = TokenCounts()
    generated_by_dp: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()
    graphs: tuple[Mapping[StepKind, Record], ...] = ()
    comm: Mapping[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    kv: tuple[RankLoad, ...] = ()
    preemptions: int = 0
    requests: RequestTimes = RequestTimes()
    telemetry: Mapping[int, dict] = field(default_factory=dict)
    idle_s: Mapping[str, float] = field(default_factory=dict)
    # the expert balancer's figures (engine.balancer.ExpertBalancer.figures) when it runs: the last window's
    # balancedness per MoE layer and the totals of rebalances, bytes and seconds moved
    eplb: Mapping[str, Any] | None = None

    @property
    def tau(self) -> float | None:
        """Committed tokens per speculative request this step (bonus included); None without speculative items."""
        t = self.tokens
        return t.spec_committed / t.spec_requests if t.spec_requests else None


def idle_seconds(*, gap_s: float, gap_empty_s: float, wall_s: float, host_s: float, blocked: str,
                 draining: bool) -> dict[str, float]:
    """Attributes a record's seconds to idle reasons (``docs/metrics.md``, "Idle reasons"). The gap before a step:
    ``gap_empty_s`` of it with no request in the engine (``no_work``), the rest ``host_bound``. The step: ``host_s`` of
    its ``wall_s`` with the device waiting on the host (``host_bound``), the rest counted under ``blocked`` ("kv" →
    ``blocked_kv``, "max_num_seqs" → ``admission_limit``) when requests waited for it, else busy (not idle). While
    ``draining``, every second not host-bound is ``draining``."""
    host = min(max(host_s, 0.0), wall_s)
    out = dict.fromkeys(IDLE_REASONS, 0.0)
    empty = min(max(gap_empty_s, 0.0), gap_s)
    out["host_bound"] = gap_s - empty + host
    busy_part = wall_s - host
    if draining:
        out["draining"] = empty + busy_part
    else:
        out["no_work"] = empty
        if blocked == "kv":
            out["blocked_kv"] = busy_part
        elif blocked == "max_num_seqs":
            out["admission_limit"] = busy_part
    return out
