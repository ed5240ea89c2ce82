"""The edge between a front (the gRPC server's event loop) and the engine thread: the requests the engine thread
takes — a closed union of frozen types, dispatched by type (``engine/async_engine.py``) — and what it answers
besides request outputs and step records: the engine's fixed facts and one frozen snapshot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.params import Constraint, SamplingParams
from engine.profiling import ProfilePlan


@dataclass(frozen=True, kw_only=True)
class AddRequest:
    """Admit a request (replies None; a bad request: RequestError or SamplingError; over capacity: Overloaded).
    ``arrival``: ``time.monotonic()`` when it reached the server (its TTFT and queue time start there)."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    dp_rank: int | None = None
    retain_kv: bool = False
    arrival: float
    kv: Any = None  # a KVSource its leading prompt tokens' KV is read from (a prefill worker's hand-off)
    lease: Any = None  # a PeerLease: keep its prompt's KV for a decode worker (this is a prefill worker)
    kv_missing: bool = False  # a decode worker got it without a hand-off (smg relays none for n > 1): counted


@dataclass(frozen=True)
class AbortRequest:
    """End a request if the engine still holds it (no reply; its stream gets a finished "abort" output)."""

    request_id: str


@dataclass(frozen=True)
class Precompile:
    """The other ranks start compiling ``constraint`` now, between steps (no reply)."""

    constraint: Constraint


@dataclass(frozen=True)
class FlushCache:
    """Empty the prefix cache if no request holds blocks (replies :class:`FlushResult`)."""


@dataclass(frozen=True)
class FlushResult:
    flushed: bool
    busy: int  # requests in the engine (running + waiting) when it was tried
    leased_blocks: int = 0  # blocks a prefill worker's leases held then (engine.core.leases)


@dataclass(frozen=True, kw_only=True)
class KVTier:
    """One KV tier since start (``KVTransfers.tiers``): ``tier`` "device", "host" or "store"; ``hit_tokens``: prompt
    tokens admissions took from it; ``blocks``: blocks it holds now (cached; None for the shared store, whose size is
    its master's to report); ``load_*``: copied from it into the device pool,
    ``store_*``: copied into it out of the device pool (bytes over every rank of the DP groups, seconds of rank 0's
    copy thread). ``queried_tokens``: prompt tokens it was asked for (host: past the device pool's hit)."""

    tier: str
    hit_tokens: int
    queried_tokens: int
    blocks: int | None
    load_bytes: int = 0
    store_bytes: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    errors: Mapping[str, int] = field(default_factory=dict)  # the shared store's failed calls by reason (rank 0's)


@dataclass(frozen=True, kw_only=True)
class HandOffs:
    """Prefill/decode hand-offs since start (``KVTransfers.hand_offs``): on a decode worker the blocks and bytes read
    from prefill workers, the seconds rank 0's copy thread spent on them, the prompt tokens it computed beyond each
    request's last one (0 when every hand-off delivered) and its failed reads by reason; on a prefill worker the
    blocks leased now and the leases that ended."""

    received_blocks: int = 0
    received_bytes: int = 0
    seconds: float = 0.0
    recomputed_tokens: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)
    leased_blocks: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_reclaimed: int = 0  # ended early because the prefill pool ran short (Leases.reclaim)


@dataclass(frozen=True)
class TakeSnapshot:
    """Replies the :class:`EngineSnapshot` of this moment."""


@dataclass(frozen=True)
class SetDraining:
    """The server stopped taking requests (SIGTERM): the rest of the engine's idle time counts as draining."""


@dataclass(frozen=True)
class StartProfile:
    """``torch.profiler`` on every rank for ``plan``'s steps (replies None; ProfileError when one runs)."""

    plan: ProfilePlan


@dataclass(frozen=True)
class StopProfile:
    """Write every rank's trace (replies the files; ProfileError when none runs)."""


@dataclass(frozen=True)
class BalanceExperts:
    """Replies the expert load and placement (``engine.snapshot.expert_balance``); with ``rebalance`` the balancer
    also rebalances at the next step boundary (RequestError when it does not run)."""

    rebalance: bool = False


@dataclass(frozen=True)
class Stop:
    """Drain the step in flight and release the other ranks (replies None); the engine thread ends."""


EngineRequest = (AddRequest | AbortRequest | Precompile | FlushCache | TakeSnapshot | SetDraining | StartProfile
                 | StopProfile | BalanceExperts | Stop)


@dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """What the engine is, fixed at start-up: model, KV layout, limits, parallel layout and speculation. Safe to
    read from any thread."""

    vocab_size: int
    max_model_len: int
    model_type: str
    eos_token_ids: tuple[int, ...]
    dtype: str
    attention: str  # "mla" or "gqa"
    kv_block_size: int  # tokens per KV-cache block (engine.block_size)
    max_num_seqs: int  # running slots per attention-DP rank (engine.max_num_seqs)
    dp_size: int  # attention-DP ranks
    layout: str  # the parallel layout, described
    draft_positions: int  # speculation: drafted positions per request step (0: off)
    drafted_per_step: int  # speculation: draft tokens verified per request step (0: off)
    grammar: bool  # structured output is available (the checkpoint has a tokenizer)
    kv_fingerprint: str = ""  # KV made here loads only where this is equal (kv_shape, block bytes and size)


@dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    """The engine at one moment, built on its thread from its components' own ``stats()`` (EngineInfo's document).
    Every section is JSON-ready."""

    layout: str
    parallel: Mapping[str, Any]
    dispatcher: str
    comm: Mapping[str, Any]
    steps: Mapping[str, Any]
    idle_s: Mapping[str, float]
    telemetry: Mapping[str, Any]
    cuda_graphs: Mapping[str, Any]
    experts_touched: Any
    expert_load: Any  # engine/snapshot.py expert_load: tokens per expert and balancedness per MoE layer, or None
    warmup: Mapping[str, Any]
    spec_decode: Mapping[str, Any]
    scheduler: Mapping[str, Any]
    kv: Mapping[str, Any]
