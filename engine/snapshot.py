"""The engine's fixed facts and its snapshot (``engine/messages.py``), built on the engine thread from each
component's own report: the scheduler's and KV manager's ``stats()``, the step records folded in ``EngineStats``, the
comm counter, rank 0's expert tally. Nobody outside the engine reads the components themselves."""

from __future__ import annotations

from dataclasses import asdict

import torch

from engine.config import RequestError
from engine.engine import Engine
from engine.messages import EngineFacts, EngineSnapshot
from engine.worker.control import ReadExpertLoad
from parallelism.eplb import balancedness, rank_loads


def engine_facts(engine: Engine) -> EngineFacts:
    cfg, sched, cache = engine.model.cfg, engine.scheduler.cfg.scheduler, engine.scheduler.cfg.cache
    facts = engine.speculation.facts if engine.speculation is not None else None
    return EngineFacts(vocab_size=cfg.vocab_size, max_model_len=min(sched.max_model_len, cfg.max_position_embeddings),
                       model_type=cfg.model_type, eos_token_ids=tuple(cfg.eos_token_ids), dtype=str(engine.model.dtype),
                       attention="mla" if cfg.mla is not None else "gqa", kv_block_size=cache.block_size,
                       max_num_seqs=sched.max_num_seqs, dp_size=engine.groups.layout.attn_dp,
                       layout=engine.groups.layout.describe(), draft_positions=facts.draft_rows if facts else 0,
                       drafted_per_step=facts.tree_size - 1 if facts else 0, grammar=engine.grammar is not None,
                       kv_fingerprint=engine.transfers.fingerprint)


def take_snapshot(engine: Engine) -> EngineSnapshot:
    """The engine now (its thread only: the counters are its own)."""
    lay, s, counter, tally = engine.groups.layout, engine.stats, engine.groups.counter, engine.runner.tally
    return EngineSnapshot(
        layout=lay.describe(), parallel=asdict(lay), dispatcher=lay.resolved_dispatcher,
        comm={"per_op": counter.snapshot(), "calls": counter.total_calls(), "bytes": counter.total_bytes(),
              "note": "rank 0's view since start-up; heartbeats not counted"},
        steps={"total": s.steps, "kinds": dict(s.step_kinds), "prefill_tokens": s.prefill_tokens,
               "decode_tokens": s.decode_tokens,
               "decode_tokens_per_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
               "prefill_tokens_per_s": s.prefill_tokens / s.prefill_s if s.prefill_s else 0.0,
               "host_ms_per_step": {k: 1e3 * v / max(s.steps, 1) for k, v in s.host_s.items()},
               "device_ms_per_step": 1e3 * s.device_s / s.device_steps if s.device_steps else None},
        idle_s=dict(s.idle_s), telemetry={str(rank): sample for rank, sample in sorted(s.telemetry.items())},
        cuda_graphs=_graphs(engine), experts_touched=tally.snapshot() if tally is not None else None,
        expert_load=expert_load(engine),
        warmup={"seconds": s.warmup_s, "shapes": s.warmup_shapes}, spec_decode=_speculation(engine),
        scheduler=engine.scheduler.cfg.keys(), kv=_kv(engine))


def expert_load(engine: Engine) -> dict | None:
    """``engine.expert_load``'s counts since warm-up (with the balancer on: since its last window), gathered from
    every attention-DP group's counting rank and summed: ``tokens_per_expert [L][E]`` per MoE layer, ``rank_tokens
    [L][moe_ep]`` and each layer's ``balancedness`` (mean ÷ max tokens per EP rank; 1.0 = even) at the current
    expert placement, a replicated expert's tokens split evenly over its replicas; with the balancer on, what it
    did (``balancer``). None when the engine does not count."""
    if engine.runner.expert_load is None:
        return None
    tokens = torch.stack([c for c in engine.control.send(ReadExpertLoad(), engine.rank) if c is not None]).sum(0)
    slots = engine.runner.expert_maps.placements()
    lay = engine.groups.layout
    out = {"tokens_per_expert": tokens.tolist(), "moe_ep": lay.moe_ep,
           "rank_tokens": rank_loads(tokens, slots, lay.moe_ep).tolist(),
           "balancedness": balancedness(tokens, slots, lay.moe_ep).tolist()}
    if engine.balancer is not None:
        out["balancer"] = asdict(engine.balancer.stats) | {"versions": list(engine.balancer.versions),
                                                           "pending_layers": [la for la, _ in engine.balancer.pending]}
    return out


def expert_balance(engine: Engine, rebalance: bool = False) -> dict:
    """What an operator asks of the expert balancer (the engine's ``BalanceExperts`` request): ``load``, tokens per
    expert per MoE layer over the balancer's last complete window (before the first one, or with the balancer off:
    the counts so far) — a file of this document seeds ``eplb.placement_file`` — the current ``phy2log`` and
    ``versions``, and :func:`expert_load`'s figures. ``rebalance``: the balancer rebalances from the counts it has at
    the next step boundary. Raises RequestError naming the setting when the engine does not count."""
    if engine.runner.expert_load is None:
        raise RequestError("expert load is not counted on this worker: start it with eplb.enabled=true (or "
                           "engine.expert_load=true to read the load without rebalancing)")
    if rebalance and engine.balancer is None:
        raise RequestError("no expert balancer runs on this worker: start it with eplb.enabled=true")
    figures = expert_load(engine)
    window = engine.balancer.window if engine.balancer is not None else None
    if rebalance:
        engine.balancer.request_rebalance()
    return {"load": window.tolist() if window is not None else figures["tokens_per_expert"],
            "load_is": "last complete window" if window is not None else "counts so far",
            "phy2log": engine.runner.expert_maps.placements().tolist(),
            "versions": list(engine.runner.expert_maps.versions), "expert_load": figures,
            "rebalance_requested": rebalance}


def _kv(engine: Engine) -> dict:
    """Settings, prefix-cache counters, and per attention-DP rank blocks used (referenced), cached (indexed) and free
    (empty or evictable), with a digest of the index's block hashes; ``tiers``: each KV tier's hits, blocks and copies
    (``KVTransfers.tiers``; ``cached_tokens`` counts the device pool's hits, ``tiers`` both)."""
    cfg, s, kv = engine.scheduler.cfg, engine.scheduler.stats(), engine.scheduler.kv.stats()
    used, total = sum(p.blocks_used for p in kv.per_dp), sum(p.blocks_total for p in kv.per_dp)
    return {"prefix_caching": cfg.cache.prefix_caching, "allocation": cfg.scheduler.kv_allocation,
            "kv_block_size": cfg.cache.block_size, "retention_s": cfg.cache.kv_retention_s,
            "prompt_tokens": kv.prompt_tokens, "cached_tokens": kv.cached_tokens,
            "hit_rate": kv.hit_rate, "evictions": kv.evictions, "preemptions": s.preemptions,
            "blocks_used": used, "blocks_total": total, "usage": used / total, "index_digest": kv.index_digest,
            "requests_loading": s.loading, "host_kv_cache_gb": cfg.cache.host_kv_cache_gb,
            "host_kv_write": cfg.cache.host_kv_write, "host_slots": kv.host.slots if kv.host else 0,
            "tiers": [asdict(t) for t in engine.transfers.tiers()],
            "per_dp": [{"running": s.per_dp[dp].running, "blocks_used": p.blocks_used, "blocks_cached": p.blocks_cached,
                        "blocks_free": p.blocks_free, "index_digest": p.index_digest}
                       for dp, p in enumerate(kv.per_dp)]}


def _graphs(engine: Engine) -> dict:
    per_kind = engine.stats.coverage.summary()
    steps = sum(k["steps"] for k in per_kind.values())
    replays = sum(k["replays"] for k in per_kind.values())
    reasons = sorted({k["eager_reason"] for k in per_kind.values() if k["eager_reason"]})
    if not reasons and not torch.cuda.is_available():
        reasons = ["no CUDA device"]
    summary = (f"cuda graphs: {replays}/{steps} steps replayed" if replays else
               f"cuda graphs: off ({'; '.join(reasons) or 'no steps yet'})")
    return {"per_kind": per_kind, "steps": steps, "replays": replays, "summary": summary}


def _speculation(engine: Engine) -> dict:
    """The speculation's facts (``SpeculationFacts``, names as in docs/GLOSSARY.md) and its acceptance so far."""
    s = engine.stats
    tau = s.acceptance_length or None
    doc = {"enabled": engine.speculation is not None, "method": "none", "acceptance_length": tau,
           "request_steps": s.spec_request_steps, "committed_tokens": s.spec_tokens}
    if engine.speculation is None:
        doc["summary"] = "spec-decode acceptance: none yet (speculative decoding off)"
    else:
        facts = engine.speculation.facts
        doc.update({k: v for k, v in asdict(facts).items() if k != "context_kv"},
                   drafter_kv_bytes_per_token=facts.context_kv.bytes_per_token() if facts.context_kv else 0,
                   summary=f"spec-decode acceptance length: {tau:.2f}" if tau else "spec-decode acceptance: none yet")
    return doc
