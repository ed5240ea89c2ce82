"""A latency + bytes/bandwidth cost model of one decode step of an MoE model under a parallel layout.

It answers "what would this layout do on that box" for boxes we do not have: each collective costs
``α + bytes·factor/bandwidth`` (formulas below; sources in docs/records/field_notes.md), the weights and KV a rank
reads cost
``bytes / memory bandwidth``, its FLOPs cost ``FLOPs / peak``. Everything is per rank and per step; the
step time is set by the busiest rank. Units: bytes, seconds, FLOP, bytes/s, FLOP/s.

Overlap assumption (``overlap="serial"``, the default): memory traffic and compute of one rank overlap
perfectly (roofline: ``max(memory, compute)``); collectives do not overlap with either, because in decode
every collective sits between two dependent layers (o_proj → all-reduce → next norm), so
``step = max(memory, compute) + comm + host``. ``overlap="full"`` gives the optimistic
``max(memory, compute, comm) + host``.

Collective costs, ``S`` = bytes as :class:`parallelism.comm.CommCounter` records them for one call:

=================  ==========================  ===================================================
op                 S is                        time
=================  ==========================  ===================================================
all_reduce         the tensor                  α + S·2(p−1)/p / busBW      (ring)
all_gather         this rank's part            α + S·(p−1) / busBW          (= S_total·(p−1)/p)
gather             this rank's part            α + S·(p−1) / busBW          (root's ingress)
reduce_scatter     the full input              α + S·(p−1)/p / busBW
broadcast          the tensor                  α + S / busBW                (pipelined)
all_to_all         the send buffer             α + S·(p−1)/p / a2aBW        (remote share)
=================  ==========================  ===================================================

The all-to-all line is the dispatch formula of docs/records/field_notes.md, ``α + (tokens/p)·R·bytes/BW`` with
``R = (p−1)(1−(1−1/p)^k)`` remote ranks per token: under uniform routing a token's rows go to
``p(1−(1−1/p)^k)`` ranks, ``(p−1)/p`` of them remote.

Calibration (``project(..., efficiency=load_efficiency())``): each part of the bytes read is timed at the
fraction of the byte floor its kernel class reached on one H200 (:mod:`bench.cost.efficiency`); without it the
projection is the ideal floor, which every projection also carries (``floor_step_s``). What the model ignores
is listed in docs/cost_model.md (launch overhead unless given as ``host_overhead_s``, routing skew, prefill,
the drafter's own cost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
import yaml

from bench import CONF
from bench.cost.floors import floor_bytes
from bench.cost.hardware import HARDWARE, Hardware
from bench.cost.shapes import KIMI_K2_INT4, ModelShape
from parallelism.layout import Layout


class KernelEfficiency(Protocol):
    """What a projection needs of measured efficiencies (:class:`bench.cost.efficiency.KernelEfficiency`)."""

    copy_fraction: float
    label: str

    def fractions(self, bytes_by_part: Mapping[str, float], heads: float, seqs: int, tokens_rank: int,
                  tokens_job: int, mla: bool = True) -> dict[str, float]: ...

# the 8-GPU presets of conf/parallel/ that the projections cover, in table order
BOX_PRESETS = ("tp8", "ep8", "dp8_ep8", "tp2_ep4", "tp4_ep2", "tp2xdp4_ep8")


def preset(name: str) -> Layout:
    """The layout of ``conf/parallel/<name>.yaml`` (the file the scripts compose)."""
    return Layout(**yaml.safe_load((CONF / "parallel" / f"{name}.yaml").read_text()))


LAYOUTS: dict[str, Layout] = {name: preset(name) for name in BOX_PRESETS}

# op → (bandwidth attribute of Hardware, bytes factor as a function of the group size p)
_OPS = {
    "all_reduce": ("bus_bw", lambda p: 2 * (p - 1) / p),
    "all_gather": ("bus_bw", lambda p: p - 1),
    "gather": ("bus_bw", lambda p: p - 1),
    "reduce_scatter": ("bus_bw", lambda p: (p - 1) / p),
    "broadcast": ("bus_bw", lambda p: 1.0),
    "all_to_all": ("a2a_bw", lambda p: (p - 1) / p),
}


# ------------------------------------------------------------------------------------- collective costs
def group_size(layout: Layout, group: str) -> int:
    """Ranks in a process-group kind of ``layout`` (``world``, ``attn_tp``, ``attn_dp``, ``moe_tp``, ``moe_ep``)."""
    sizes = {"world": layout.world_size, "attn_tp": layout.attn_tp, "attn_tp_split": layout.attn_tp,
             "attn_dp": layout.attn_dp, "moe_tp": layout.moe_tp, "moe_ep": layout.moe_ep}
    if group not in sizes:
        raise ValueError(f"unknown group kind {group!r}; known: {sorted(sizes)}")
    return sizes[group]


def collective_time(op: str, nbytes: float, p: int, hw: Hardware, calls: float = 1.0) -> float:
    """Seconds for ``calls`` calls of ``op`` over ``p`` ranks moving ``nbytes`` in total (CommCounter's
    convention, see the module table): ``calls·α + nbytes·factor(p)/bandwidth``. ``p == 1`` costs nothing."""
    if op not in _OPS:
        raise ValueError(f"no cost formula for collective {op!r}; known: {sorted(_OPS)}")
    if p <= 1 or calls == 0:
        return 0.0
    bw_attr, factor = _OPS[op]
    return calls * hw.alpha_s + nbytes * factor(p) / getattr(hw, bw_attr)


def allreduce_time(nbytes: float, p: int, bus_bw: float, alpha_s: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``p`` ranks: ``α + S·2(p−1)/p / busBW`` (s; B/s)."""
    return 0.0 if p <= 1 else alpha_s + nbytes * 2 * (p - 1) / p / bus_bw


def remote_ranks_per_token(p: int, k: int, moe_tp: int = 1) -> float:
    """Expected remote ranks a token's rows go to in all-to-all dispatch, uniform routing over ``p // moe_tp``
    expert groups: ``(p−1)(1−(1−1/ep)^k)`` (docs/records/field_notes.md's R for ``moe_tp == 1``; with expert-TP shards
    every rank of a hit group receives the row)."""
    ep = p // moe_tp
    return (p - 1) * (1 - (1 - 1 / ep) ** k)


def dispatch_time(tokens: int, row_bytes: float, p: int, k: int, a2a_bw: float, alpha_s: float) -> float:
    """The dispatch (or combine) estimate of docs/records/field_notes.md: ``α + (tokens/p)·R·row_bytes/BW`` (s)."""
    return alpha_s + tokens / p * remote_ranks_per_token(p, k) * row_bytes / a2a_bw


def comm_time(per_op: Mapping[str, Mapping[str, float]], layout: Layout, hw: Hardware) -> tuple[float, dict]:
    """Interconnect time of ``{"group/op": {"calls", "bytes"}}`` (one step, one rank; CommCounter's byte
    convention) → (seconds, per-op ``{"calls", "bytes", "p", "s"}``)."""
    detail, total = {}, 0.0
    for key, v in per_op.items():
        group, op = key.split("/", 1)
        p = group_size(layout, group)
        s = collective_time(op, float(v.get("bytes", 0.0)), p, hw, calls=float(v.get("calls", 0.0)))
        detail[key] = {"calls": v.get("calls", 0.0), "bytes": v.get("bytes", 0.0), "p": p, "s": s}
        total += s
    return total, detail


# ------------------------------------------------------------------------------------- step accounting
def _resolve(layout: Layout | str) -> Layout:
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout preset {layout!r}; known: {sorted(LAYOUTS)}")
        return LAYOUTS[layout]
    return layout


def _emax_fixed(n: int, groups: int, d: int) -> float:
    """Exact E[max group count] when ``d`` distinct experts are drawn uniformly from ``groups`` groups of ``n``:
    ``P(max ≤ m) = [x^d] (Σ_{j≤m} C(n, j) x^j)^groups / C(n·groups, d)``."""
    if d <= 0:
        return 0.0
    if d >= n * groups:
        return float(n)
    total = math.comb(n * groups, d)
    out = 0.0
    for m in range(n):
        poly = np.array([math.comb(n, j) for j in range(min(m, d) + 1)], dtype=np.float64)
        acc = np.ones(1)
        for _ in range(groups):
            acc = np.convolve(acc, poly)[: d + 1]
        p_le = acc[d] / total if d < len(acc) else 0.0
        out += 1.0 - p_le
        if p_le >= 1.0 - 1e-12:
            break
    return out


def busiest_group_active_experts(num_experts: int, top_k: int, tokens: int, groups: int) -> float:
    """Expected active experts in the busiest of ``groups`` equal expert groups when ``tokens`` tokens each
    pick ``top_k`` distinct experts uniformly and independently.

    Active experts: ``D = E·(1−(1−k/E)^T)`` on average; the busiest group's count is computed exactly for
    ``D`` distinct experts spread uniformly (interpolated between ⌊D⌋ and ⌈D⌉). Exact at ``T = 1``; within
    1 % of a Monte Carlo for Kimi K2 (384 experts, top-8, 8 groups) at T = 1…64."""
    if tokens <= 0:
        return 0.0
    d = num_experts * (1 - (1 - top_k / num_experts) ** tokens)
    if groups == 1:
        return d
    n = num_experts // groups
    lo = math.floor(d + 1e-9)
    frac = max(0.0, d - lo)
    return (1 - frac) * _emax_fixed(n, groups, lo) + (frac * _emax_fixed(n, groups, lo + 1) if frac else 0.0)


def _ranks_tokens(layout: Layout, batch: int, tokens_per_seq: int) -> tuple[int, int, int]:
    """(sequences on the busiest rank, tokens on the busiest rank, tokens over the whole job)."""
    seqs = math.ceil(batch / layout.attn_dp)
    return seqs, seqs * tokens_per_seq, batch * tokens_per_seq


def active_experts(layout: Layout | str, model: ModelShape, batch: int, tokens_per_seq: int = 1,
                   touched: float | None = None) -> tuple[float, str]:
    """Distinct routed experts per MoE layer the busiest rank reads in one step, and where the number comes from:
    ``touched`` when given (``"measured"``: the mean a run counted, :func:`model.expert_tally.touched_per_layer`),
    else the busiest expert group's expectation under uniform routing (``"formula"``:
    :func:`busiest_group_active_experts` over the job's tokens)."""
    if touched is not None:
        return touched, "measured"
    lay = _resolve(layout)
    _, _, t_all = _ranks_tokens(lay, batch, tokens_per_seq)
    return busiest_group_active_experts(model.num_experts, model.top_k, t_all, lay.moe_ep), "formula"


def step_bytes(layout: Layout | str, model: ModelShape, batch: int, context: int,
               tokens_per_seq: int = 1, touched: float | None = None) -> dict[str, float]:
    """Bytes the busiest rank reads in one decode step, by part (weights each read once per step), through the
    one floor arithmetic (:func:`bench.cost.floors.floor_bytes`).

    ``batch`` sequences, each with ``context`` cached tokens and ``tokens_per_seq`` new tokens (1 for plain
    decoding, the verify width for speculative steps), whose KV is read too. Routed experts: the distinct
    experts per MoE layer of :func:`active_experts` (``touched`` if measured), ``1/moe_tp`` of each."""
    lay, m = _resolve(layout), model
    seqs, t_rank, _ = _ranks_tokens(lay, batch, tokens_per_seq)
    tp, w = lay.attn_tp, m.weight_bytes
    repl, shard = m.attn_params
    busy = t_rank > 0
    dense = {
        "attention": busy * (repl + shard / tp) * m.num_layers * w,
        "dense_mlp": busy * 3 * m.hidden * m.dense_intermediate / tp * m.num_dense_layers * w,
        "shared_experts": busy * m.num_shared_experts * m.expert_params / tp * m.num_moe_layers * w,
        "router": busy * m.num_experts * m.hidden * m.router_bytes * m.num_moe_layers,
        "embedding": t_rank * m.hidden * w,
        "lm_head": busy * m.vocab / tp * m.hidden * w,
    }
    active, _ = active_experts(lay, m, batch, tokens_per_seq, touched)
    per_expert = m.expert_params / lay.moe_tp * m.expert_weight_bytes
    return floor_bytes(dense, [per_expert] * m.num_moe_layers, [active] * m.num_moe_layers,
                       kv_bytes_per_token_rank(lay, m), [context] * seqs, tokens_per_seq)


def step_flops(layout: Layout | str, model: ModelShape, batch: int, context: int,
               tokens_per_seq: int = 1, balancedness: float = 1.0) -> dict[str, float]:
    """FLOPs of the busiest rank in one decode step, by part: 2 × params touched × tokens, plus attention
    over ``context`` (MLA absorbed decode: ``2·(2·kv_lora + rope)`` per head per cached token; GQA ``4·d``).
    Routed experts: the busiest EP rank's load, the mean ``tokens·k/ep`` ÷ ``balancedness`` (mean ÷ max tokens per
    EP rank: 1 = uniform routing; ``docs/eplb.md``)."""
    if not 0 < balancedness <= 1:
        raise ValueError(f"balancedness is mean / max tokens per EP rank, in (0, 1]; got {balancedness}")
    lay, m = _resolve(layout), model
    _, t_rank, t_all = _ranks_tokens(lay, batch, tokens_per_seq)
    tp = lay.attn_tp
    repl, shard = m.attn_params
    per_pos = 2 * (2 * m.kv_lora_rank + m.qk_rope_head_dim) if m.mla else 4 * m.head_dim
    return {
        "attention_proj": 2 * t_rank * (repl + shard / tp) * m.num_layers,
        "attention_core": t_rank * m.num_heads / tp * context * per_pos * m.num_layers,
        "dense_mlp": 2 * t_rank * 3 * m.hidden * m.dense_intermediate / tp * m.num_dense_layers,
        "shared_experts": 2 * t_rank * m.num_shared_experts * m.expert_params / tp * m.num_moe_layers,
        "router": 2 * t_rank * m.num_experts * m.hidden * m.num_moe_layers,
        "routed_experts": 2 * t_all * m.top_k / lay.moe_ep / balancedness * m.expert_params / lay.moe_tp
                          * m.num_moe_layers,
        "lm_head": 2 * t_rank * m.vocab / tp * m.hidden,
    }


def resident_bytes(layout: Layout | str, model: ModelShape) -> float:
    """Weight bytes one rank holds (capacity check; KV and activations not included): attention
    ``repl + shard/attn_tp``, dense MLP, shared experts, embedding and LM head ``/attn_tp``, the router whole,
    ``E/moe_ep`` routed experts at ``1/moe_tp`` each (``expert_weight_bytes``: 0.5625 for INT4 group 32)."""
    lay, m = _resolve(layout), model
    tp, w = lay.attn_tp, m.weight_bytes
    repl, shard = m.attn_params
    experts = m.num_experts // lay.moe_ep * m.expert_params / lay.moe_tp * m.expert_weight_bytes
    return ((repl + shard / tp) * m.num_layers * w + 3 * m.hidden * m.dense_intermediate / tp * m.num_dense_layers * w
            + m.num_moe_layers * (experts + m.num_shared_experts * m.expert_params / tp * w
                                  + m.num_experts * m.hidden * m.router_bytes)
            + 2 * m.vocab / tp * m.hidden * w)


def kv_bytes_per_token_rank(layout: Layout | str, model: ModelShape) -> float:
    """KV bytes one cached token costs on a rank that holds its sequence, all layers: MLA's latent + rope key is
    replicated on every attention-TP rank; GQA splits the KV heads (at least one per rank)."""
    lay, m = _resolve(layout), model
    if m.mla:
        return m.kv_elems_per_token_layer * m.kv_bytes * m.num_layers
    return 2 * max(1.0, m.num_kv_heads / lay.attn_tp) * m.head_dim * m.kv_bytes * m.num_layers


def memory_fit(layout: Layout | str, hw: Hardware, model: ModelShape, utilization: float = 0.9) -> dict:
    """Weights per rank (:func:`resident_bytes`) against ``utilization × mem_capacity``: ``weights``, ``fits``,
    ``kv_room`` (bytes left, 0 when they do not fit), ``kv_tokens_rank`` (tokens of KV that room holds) and
    ``kv_tokens_box`` (× ``attn_dp``: each attention-DP group caches its own sequences). Activations, CUDA graphs
    and the allocator's slack are not counted (they come out of the ``1 − utilization`` share)."""
    lay = _resolve(layout)
    weights = resident_bytes(lay, model)
    room = max(0.0, utilization * hw.mem_capacity - weights)
    tokens = int(room // kv_bytes_per_token_rank(lay, model))
    return {"weights": weights, "fits": weights <= utilization * hw.mem_capacity, "kv_room": room,
            "kv_tokens_rank": tokens, "kv_tokens_box": tokens * lay.attn_dp}


def forward_calls(layout: Layout | str, model: ModelShape) -> dict[str, int]:
    """Collective calls of one forward per rank, by ``"group/op"``: parallelism.dispatch's documented formula."""
    from parallelism.dispatch import expected_forward_calls  # imports torch; keep this module light

    return expected_forward_calls(_resolve(layout), model.num_layers, model.num_moe_layers,
                                  shared_experts=model.num_shared_experts > 0)


def rescale_calls(calls: Mapping[str, float], layout: Layout | str, measured: tuple[int, int],
                  target: tuple[int, int]) -> dict[str, float]:
    """Calls measured on one model (``measured = (layers, moe_layers)``, e.g. the tiny checkpoint) carried to
    another's depth: each key is scaled by the formula's target/measured ratio, so a measured deviation from
    the formula survives as a ratio; keys outside the formula are kept as measured."""
    from parallelism.dispatch import expected_forward_calls

    lay = _resolve(layout)
    src, dst = expected_forward_calls(lay, *measured), expected_forward_calls(lay, *target)
    return {k: v * dst[k] / src[k] if src.get(k) and k in dst else v for k, v in calls.items()}


def _bytes_per_call(key: str, lay: Layout, m: ModelShape, batch: int, tokens_per_seq: int,
                    balancedness: float = 1.0) -> float:
    """Bytes per call (CommCounter's convention) of a ``"group/op"`` for the target model; 0 = α only. The expert
    dispatchers' rows reach the busiest EP rank at ``1 / balancedness`` times the mean."""
    group, op = key.split("/", 1)
    _, t_rank, _ = _ranks_tokens(lay, batch, tokens_per_seq)
    row = m.hidden * m.act_bytes
    p = group_size(lay, group)
    if op == "all_reduce":
        return t_rank * row
    if op in ("gather", "all_gather") and group == "attn_tp":  # LM-head logits (gather; all_gather when speculating)
        return t_rank * math.ceil(m.vocab / p) * m.act_bytes
    # a partitioned dispatcher under attention TP dispatches each TP rank's share of the group's tokens
    t_moe = math.ceil(t_rank / lay.attn_tp) if lay.resolved_dispatcher != "allreduce" else t_rank
    if group == "attn_tp_split":  # the shares all-gathered back; the shared experts' partials reduce-scattered
        return t_moe * row * (p if op == "reduce_scatter" else 1)
    hits = lay.moe_tp * lay.moe_ep * (1 - (1 - 1 / lay.moe_ep) ** m.top_k)  # ranks a token's rows go to
    if op == "all_to_all":  # dispatcher alltoall per MoE layer: counts, rows, routing, combine rows
        return (p * 8 + t_moe * hits * (2 * row + 2 * m.top_k * 4) / balancedness) / 4
    if op == "all_gather":  # dispatcher allgather per MoE layer: counts, rows, routing (every rank gets all rows)
        return (8 + t_moe * (row + 2 * m.top_k * 4)) / 3
    if op == "reduce_scatter":
        return p * t_moe * row
    return 0.0


def step_comm(layout: Layout | str, model: ModelShape, batch: int, calls_per_step: Mapping[str, float] | None = None,
              tokens_per_seq: int = 1, balancedness: float = 1.0) -> dict[str, dict[str, float]]:
    """``{"group/op": {"calls", "bytes"}}`` of one step on the busiest rank for ``model``: calls from
    ``calls_per_step`` (default: one forward by :func:`forward_calls`), bytes per call from the model's dims
    (``balancedness``: see :func:`_bytes_per_call`)."""
    lay = _resolve(layout)
    calls = forward_calls(lay, model) if calls_per_step is None else calls_per_step
    return {k: {"calls": c, "bytes": c * _bytes_per_call(k, lay, model, batch, tokens_per_seq, balancedness)}
            for k, c in calls.items()}


@dataclass(frozen=True)
class Floors:
    """Lower bounds of one step's time (s) on one rank, and what they were computed from."""

    memory_s: float
    compute_s: float
    interconnect_s: float
    detail: Mapping = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        return {"memory": self.memory_s, "compute": self.compute_s, "interconnect": self.interconnect_s}


def step_floors(layout: Layout | str, hw: Hardware, model: ModelShape, batch: int, context: int,
                comm_per_step: Mapping[str, Mapping[str, float]] | None = None, tokens_per_seq: int = 1,
                efficiency: KernelEfficiency | None = None, touched: float | None = None,
                balancedness: float = 1.0) -> Floors:
    """Memory floor = bytes read / ``mem_bw``; compute floor = FLOPs / ``peak_flops``; interconnect floor =
    Σ calls·α + bytes·factor/bandwidth over ``comm_per_step`` (``{"group/op": {"calls", "bytes"}}`` per step,
    e.g. a measured CommCounter delta divided by steps; default: :func:`step_comm` for ``model``).
    ``efficiency``: memory time = Σ part bytes / (part's measured fraction × copy fraction × ``mem_bw``).
    ``touched``: measured distinct experts per MoE layer (:func:`active_experts`); ``detail["experts"]`` says
    which count the memory floor used. ``balancedness``: the routed experts' load on the busiest EP rank
    (:func:`step_flops`); the bytes keep uniform routing's active-expert count."""
    lay = _resolve(layout)
    b = step_bytes(lay, model, batch, context, tokens_per_seq, touched)
    f = step_flops(lay, model, batch, context, tokens_per_seq, balancedness)
    comm = step_comm(lay, model, batch, tokens_per_seq=tokens_per_seq) if comm_per_step is None else comm_per_step
    comm_s, comm_detail = comm_time(comm, lay, hw)
    active, source = active_experts(lay, model, batch, tokens_per_seq, touched)
    detail = {"bytes": b, "flops": f, "comm": comm_detail, "experts": {"per_moe_layer": active, "source": source}}
    memory_s = sum(b.values()) / hw.mem_bw
    if efficiency is not None:
        seqs, t_rank, t_all = _ranks_tokens(lay, batch, tokens_per_seq)
        frac = efficiency.fractions(b, model.num_heads / lay.attn_tp, seqs, t_rank, t_all, model.mla)
        memory_s = sum(v / (frac[k] * efficiency.copy_fraction * hw.mem_bw) for k, v in b.items())
        detail["fractions"] = frac
    return Floors(memory_s, sum(f.values()) / hw.peak_flops, comm_s, detail)


# ------------------------------------------------------------------------------------------- projection
@dataclass(frozen=True)
class Projection:
    """Projected decode step of one layout on one box (s; tok/s). ``tok_s`` counts every sequence."""

    layout: str
    hardware: str
    model: str
    batch: int
    context: int
    tokens_per_seq: int
    tau: float
    memory_s: float
    compute_s: float
    comm_s: float
    host_s: float
    step_s: float
    tok_s: float
    tok_s_per_user: float
    bound: str
    resident_gb_per_rank: float
    fits: bool
    overlap: str
    comm: Mapping = field(default_factory=dict)
    floor_step_s: float = 0.0  # the ideal-floor step (equal to step_s when no efficiency was applied)
    calibration: str = "ideal floors"
    fractions: Mapping = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def project(layout: Layout | str, hw: Hardware, model: ModelShape, batch: int, context: int,
            comm_calls_per_token_by_op: Mapping[str, float] | None = None, *, tokens_per_seq: int = 1,
            tau: float = 1.0, host_overhead_s: float = 0.0, overlap: str = "serial",
            efficiency: KernelEfficiency | None = None, balancedness: float = 1.0) -> Projection:
    """Projected decode step time and tok/s of ``layout`` on ``hw`` for ``model``.

    ``batch`` concurrent sequences with ``context`` cached tokens each. ``comm_calls_per_token_by_op``: calls
    per output token by ``"group/op"`` as the bench measures them (CommCounter delta / output tokens, for
    this model's depth: see :func:`rescale_calls`); a step makes ``calls·batch·tau`` of them. Default: the
    documented forward formula. Speculative decoding: ``tokens_per_seq`` = verify width, ``tau`` = mean
    tokens accepted per step; ``tok_s = batch·tau/step_s``. ``overlap``: "serial" (default) or "full", see
    the module docstring. ``host_overhead_s`` adds a fixed host/launch time per step (default 0: pure floors).
    ``efficiency`` (:func:`bench.cost.efficiency.load_efficiency`): memory time at the measured per-class
    fractions instead of the ideal floor; ``floor_step_s`` keeps the ideal step either way. ``balancedness``: mean
    ÷ max tokens per EP rank of the routed experts (1 = uniform routing, the default): the busiest rank's expert
    FLOPs (:func:`step_flops`) and all-to-all rows (:func:`step_comm`) grow by its inverse.
    """
    if overlap not in ("serial", "full"):
        raise ValueError(f"overlap must be 'serial' or 'full', got {overlap!r}")
    name = layout if isinstance(layout, str) else layout.describe()
    lay = _resolve(layout)
    calls = None
    if comm_calls_per_token_by_op is not None:
        calls = {k: v * batch * tau for k, v in comm_calls_per_token_by_op.items()}
    comm = step_comm(lay, model, batch, calls, tokens_per_seq, balancedness)
    fl = step_floors(lay, hw, model, batch, context, comm, tokens_per_seq, efficiency, balancedness=balancedness)
    ideal = fl if efficiency is None else step_floors(lay, hw, model, batch, context, comm, tokens_per_seq,
                                                      balancedness=balancedness)

    def combine(memory_s: float) -> float:
        local = max(memory_s, fl.compute_s)
        if overlap == "serial":
            return local + fl.interconnect_s + host_overhead_s
        return max(local, fl.interconnect_s) + host_overhead_s

    step = combine(fl.memory_s)
    parts = {"memory": fl.memory_s, "compute": fl.compute_s, "interconnect": fl.interconnect_s,
             "host/launch": host_overhead_s}
    resident = resident_bytes(lay, model)
    kv = step_bytes(lay, model, batch, context, tokens_per_seq)["kv_cache"]
    return Projection(
        layout=name, hardware=hw.name, model=model.name, batch=batch, context=context,
        tokens_per_seq=tokens_per_seq, tau=tau, memory_s=fl.memory_s, compute_s=fl.compute_s,
        comm_s=fl.interconnect_s, host_s=host_overhead_s, step_s=step, tok_s=batch * tau / step,
        tok_s_per_user=tau / step, bound=max(parts, key=parts.get), resident_gb_per_rank=resident / 1e9,
        fits=resident + kv <= hw.mem_capacity, overlap=overlap, comm=fl.detail["comm"],
        floor_step_s=combine(ideal.memory_s), calibration="ideal floors" if efficiency is None else efficiency.label,
        fractions=fl.detail.get("fractions", {}),
    )


def project_matrix(model: ModelShape = KIMI_K2_INT4, hardware: Mapping[str, Hardware] | None = None,
                   layouts: tuple[str, ...] = tuple(LAYOUTS), batches: tuple[int, ...] = (1, 8, 64),
                   context: int = 4096, **kw) -> list[Projection]:
    """Every (box, layout, batch) projection; ``kw`` goes to :func:`project`."""
    boxes = HARDWARE if hardware is None else hardware
    return [project(lay, hw, model, b, context, **kw) for hw in boxes.values() for lay in layouts for b in batches]
