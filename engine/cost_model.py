"""A latency + bytes/bandwidth cost model of one decode step of an MoE model under a parallel layout.

It answers "what would this layout do on that box" for boxes we do not have: each collective costs
``α + bytes·factor/bandwidth`` (formulas below, from REFERENCES.md), the weights and KV a rank reads cost
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

The all-to-all line is REFERENCES.md's dispatch formula ``α + (tokens/p)·R·bytes/BW`` with
``R = (p−1)(1−(1−1/p)^k)`` remote ranks per token: under uniform routing a token's rows go to
``p(1−(1−1/p)^k)`` ranks, ``(p−1)/p`` of them remote.

What the model ignores is listed in docs/cost_model.md (kernel efficiency, launch overhead unless given
as ``host_overhead_s``, routing skew, prefill, the drafter's own cost).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from parallelism.layout import Layout

REF = "REFERENCES.md"
VENDOR = "vendor spec, not measured here"
ASSUMED = "assumption, not measured here"

# The parallel presets of conf/parallel/ (tests check they agree).
LAYOUTS: dict[str, Layout] = {
    "tp8": Layout(world_size=8, attn_tp=8, attn_dp=1, moe_tp=8, moe_ep=1),
    "ep8": Layout(world_size=8, attn_tp=8, attn_dp=1, moe_tp=1, moe_ep=8),
    "dp8_ep8": Layout(world_size=8, attn_tp=1, attn_dp=8, moe_tp=1, moe_ep=8),
    "tp2_ep4": Layout(world_size=8, attn_tp=8, attn_dp=1, moe_tp=2, moe_ep=4),
    "tp4_ep2": Layout(world_size=8, attn_tp=8, attn_dp=1, moe_tp=4, moe_ep=2),
    "tp2xdp4_ep8": Layout(world_size=8, attn_tp=2, attn_dp=4, moe_tp=1, moe_ep=8),
}

# op → (bandwidth attribute of Hardware, bytes factor as a function of the group size p)
_OPS = {
    "all_reduce": ("bus_bw", lambda p: 2 * (p - 1) / p),
    "all_gather": ("bus_bw", lambda p: p - 1),
    "gather": ("bus_bw", lambda p: p - 1),
    "reduce_scatter": ("bus_bw", lambda p: (p - 1) / p),
    "broadcast": ("bus_bw", lambda p: 1.0),
    "all_to_all": ("a2a_bw", lambda p: (p - 1) / p),
}


# ---------------------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """One box of ``num_gpus`` identical GPUs. Every number is per GPU; ``sources`` names where each came from."""

    name: str
    num_gpus: int
    mem_bw: float        # B/s, HBM/GDDR bandwidth
    peak_flops: float    # FLOP/s, dense bf16 tensor-core peak
    mem_capacity: float  # bytes of device memory
    link: str            # the interconnect, in words
    bus_bw: float        # B/s, ring all-reduce bus bandwidth (also all-gather/reduce-scatter/gather/broadcast)
    a2a_bw: float        # B/s, all-to-all / point-to-point bandwidth per rank
    alpha_s: float       # s, fixed cost of one collective call
    sources: Mapping[str, str] = field(default_factory=dict)

    def parameters(self) -> list[dict]:
        """``[{"parameter", "value", "unit", "source"}]`` for printing beside projections."""
        rows = [("mem_bw", self.mem_bw / 1e9, "GB/s"), ("peak_flops", self.peak_flops / 1e12, "TFLOP/s"),
                ("mem_capacity", self.mem_capacity / 1e9, "GB"), ("bus_bw", self.bus_bw / 1e9, "GB/s"),
                ("a2a_bw", self.a2a_bw / 1e9, "GB/s"), ("alpha_s", self.alpha_s * 1e6, "µs")]
        out = [{"parameter": "link", "value": self.link, "unit": "", "source": self.sources.get("link", "")}]
        return out + [{"parameter": k, "value": v, "unit": u, "source": self.sources.get(k, "")} for k, v, u in rows]


B300_NVLINK5 = Hardware(
    name="8x B300 NVLink5", num_gpus=8, mem_bw=8.0e12, peak_flops=2.25e15, mem_capacity=288e9,
    link="NVLink5, 1.8 TB/s bidirectional per GPU", bus_bw=740e9, a2a_bw=690e9, alpha_s=8e-6,
    sources={
        "mem_bw": f"HBM3e 8 TB/s; {VENDOR}",
        "peak_flops": f"HGX B300 36 PFLOPS sparse FP16/BF16 per 8 GPUs -> 2.25 dense per GPU; {VENDOR}",
        "mem_capacity": f"288 GB HBM3e; {VENDOR}",
        "link": REF,
        "bus_bw": "derived: REFERENCES.md's NVLink4 ratio (370 GB/s busBW of 450 GB/s per direction) "
                  "applied to NVLink5's 900 GB/s per direction; not measured",
        "a2a_bw": "derived: DeepEP's 153 GB/s on H800 (200 GB/s per direction, REFERENCES.md) scaled to "
                  "900 GB/s per direction; not measured",
        "alpha_s": f"typical NCCL small-message latency inside one NVLink node; {ASSUMED}",
    },
)

H200_NVLINK4 = Hardware(
    name="8x H200 NVLink4", num_gpus=8, mem_bw=4.8e12, peak_flops=989e12, mem_capacity=141e9,
    link="NVLink4, 900 GB/s bidirectional per GPU", bus_bw=370e9, a2a_bw=344e9, alpha_s=8e-6,
    sources={
        "mem_bw": f"HBM3e 4.8 TB/s; {VENDOR}",
        "peak_flops": f"H200 SXM 1979 TFLOPS BF16 with sparsity -> 989 dense; {VENDOR}",
        "mem_capacity": f"141 GB HBM3e; {VENDOR}",
        "link": REF,
        "bus_bw": f"{REF}: ~370 GB/s ring all-reduce bus bandwidth (~480 with NVLS, not used here)",
        "a2a_bw": "derived: DeepEP's 153 GB/s on H800 (REFERENCES.md) scaled from 200 to 450 GB/s per "
                  "direction; not measured",
        "alpha_s": f"typical NCCL small-message latency inside one NVLink node; {ASSUMED}",
    },
)

RTX_PRO_6000_PCIE5 = Hardware(
    name="8x RTX PRO 6000 PCIe Gen5", num_gpus=8, mem_bw=1.792e12, peak_flops=500e12, mem_capacity=96e9,
    link="PCIe Gen5 x16, ~63 GB/s per direction, P2P ~54 GB/s", bus_bw=22e9, a2a_bw=54e9, alpha_s=24e-6,
    sources={
        "mem_bw": f"GDDR7 1792 GB/s; {VENDOR}",
        "peak_flops": f"~4000 AI TOPS FP4 sparse -> ~500 TFLOPS dense BF16 (derived); {VENDOR}",
        "mem_capacity": f"96 GB GDDR7; {VENDOR}",
        "link": REF,
        "bus_bw": f"{REF}: NCCL all-reduce bus bandwidth 22 GB/s default (38-41 tuned)",
        "a2a_bw": f"{REF}: P2P ~54 GB/s",
        "alpha_s": f"{REF}: small all-reduce ~24 µs (used for every collective)",
    },
)

HARDWARE: dict[str, Hardware] = {"b300": B300_NVLINK5, "h200": H200_NVLINK4, "rtx_pro_6000": RTX_PRO_6000_PCIE5}


def profile_for_gpu(name: str | None) -> Hardware | None:
    """The profile of a box of ``name`` GPUs (an NVML device name, e.g. "NVIDIA H200"), or None when none is
    known: floors for a measured cell on that box (its native links, also under ``topology=pcie``)."""
    known = {r"\bB300\b": B300_NVLINK5, r"\bH200\b(?! NVL)": H200_NVLINK4, r"\bRTX PRO 6000\b": RTX_PRO_6000_PCIE5}
    return next((hw for pattern, hw in known.items() if name and re.search(pattern, name)), None)


def cpu_box(num_ranks: int, mem_bw_total: float, flops_total: float, alpha_s: float, bus_bw: float,
            name: str = "CPU ranks, gloo over loopback") -> Hardware:
    """A crude profile for ranks sharing one CPU host (the gloo demo): totals (B/s, FLOP/s) split evenly
    over ``num_ranks``; ``alpha_s`` (s) and ``bus_bw`` (B/s) should be measured on the box."""
    src = "caller-supplied for this host; crude (ranks time-share cores and memory)"
    return Hardware(name=name, num_gpus=num_ranks, mem_bw=mem_bw_total / num_ranks,
                    peak_flops=flops_total / num_ranks, mem_capacity=float("inf"), link="gloo over loopback",
                    bus_bw=bus_bw, a2a_bw=bus_bw, alpha_s=alpha_s,
                    sources=dict.fromkeys(("mem_bw", "peak_flops", "bus_bw", "a2a_bw", "alpha_s", "link"), src))


# ------------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide bytes, FLOPs and message sizes. MLA when ``kv_lora_rank > 0``, else GQA.

    Bytes per element: ``weight_bytes`` for attention, dense MLP, shared experts, embedding and LM head;
    ``expert_weight_bytes`` for routed experts (INT4 checkpoints: ~0.5625 = 4 bits + a bf16 scale per 32);
    ``router_bytes`` for the gate (fp32 in this engine); ``kv_bytes`` per cached element; ``act_bytes`` per
    activation element on the wire (hidden states and logits).
    """

    name: str
    num_layers: int
    num_dense_layers: int
    hidden: int
    num_heads: int
    vocab: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    num_shared_experts: int
    dense_intermediate: int
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_kv_heads: int = 0  # GQA only
    head_dim: int = 0      # GQA only
    weight_bytes: float = 2.0
    expert_weight_bytes: float = 2.0
    router_bytes: float = 4.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attn_params(self) -> tuple[int, int]:
        """Per layer: (params replicated over attention-TP, params split over attention-TP)."""
        h, n = self.hidden, self.num_heads
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            o = n * self.v_head_dim * h
            if self.q_lora_rank:
                return h * self.q_lora_rank + kv_a, self.q_lora_rank * n * qk + kv_b + o
            return kv_a, h * n * qk + kv_b + o
        d = self.head_dim
        return 0, h * n * d * 2 + 2 * h * self.num_kv_heads * d

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def kv_elems_per_token_layer(self) -> int:
        """Cached elements per token per layer for the whole model (MLA: latent + rope key; GQA: K and V)."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def total_params(self) -> int:
        repl, shard = self.attn_params
        per_moe = self.num_experts * self.expert_params + self.num_shared_experts * self.expert_params
        per_moe += self.num_experts * self.hidden
        return (self.num_layers * (repl + shard) + self.num_dense_layers * 3 * self.hidden * self.dense_intermediate
                + self.num_moe_layers * per_moe + 2 * self.vocab * self.hidden)

    def active_params(self) -> int:
        """Params one token touches: attention, dense MLP, shared + top-k routed experts, router, LM head."""
        repl, shard = self.attn_params
        per_moe = (self.top_k + self.num_shared_experts) * self.expert_params + self.num_experts * self.hidden
        return (self.num_layers * (repl + shard) + self.num_dense_layers * 3 * self.hidden * self.dense_intermediate
                + self.num_moe_layers * per_moe + self.vocab * self.hidden)

    @staticmethod
    def from_config(cfg, name: str = "", **bytes_per_element) -> ModelShape:
        """From a :class:`model.config.ModelConfig`; ``bytes_per_element`` overrides the ``*_bytes`` fields."""
        m, moe = cfg.mla, cfg.moe
        dense = sum(1 for x in cfg.moe_layers if not x)
        kw = dict(name=name or cfg.model_type, num_layers=cfg.num_layers, num_dense_layers=dense,
                  hidden=cfg.hidden_size, num_heads=cfg.num_heads, vocab=cfg.vocab_size, num_experts=moe.num_experts,
                  top_k=moe.top_k, moe_intermediate=moe.intermediate_size, num_shared_experts=moe.num_shared_experts,
                  dense_intermediate=cfg.intermediate_size)
        if m is not None:
            kw.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                      qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim)
        else:
            kw.update(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        return ModelShape(**kw, **bytes_per_element)


# Kimi K2 text model (K2.5/K2.6 wrap the same text_config). Dims from REFERENCES.md and the public config.json
# (qk_nope 128, v_head 128, dense intermediate 18432, as DeepSeek-V3).
KIMI_K2 = ModelShape(
    name="Kimi-K2 (bf16)", num_layers=61, num_dense_layers=1, hidden=7168, num_heads=64, vocab=163840,
    num_experts=384, top_k=8, moe_intermediate=2048, num_shared_experts=1, dense_intermediate=18432,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
# Kimi K2.5/K2.6 as deployed: INT4 routed experts (compressed-tensors, group 32, bf16 scales: 4.5 bits; an
# assumption from the public checkpoint config, not verified here), everything else bf16.
KIMI_K2_INT4 = replace(KIMI_K2, name="Kimi-K2.x (INT4 experts)", expert_weight_bytes=0.5625)


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
    expert groups: ``(p−1)(1−(1−1/ep)^k)`` (REFERENCES.md's R for ``moe_tp == 1``; with expert-TP shards
    every rank of a hit group receives the row)."""
    ep = p // moe_tp
    return (p - 1) * (1 - (1 - 1 / ep) ** k)


def dispatch_time(tokens: int, row_bytes: float, p: int, k: int, a2a_bw: float, alpha_s: float) -> float:
    """REFERENCES.md dispatch (or combine) estimate: ``α + (tokens/p)·R·row_bytes/BW`` (s)."""
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


def step_bytes(layout: Layout | str, model: ModelShape, batch: int, context: int,
               tokens_per_seq: int = 1) -> dict[str, float]:
    """Bytes the busiest rank reads in one decode step, by part (weights each read once per step).

    ``batch`` sequences, each with ``context`` cached tokens and ``tokens_per_seq`` new tokens (1 for plain
    decoding, the verify width for speculative steps). Routed experts: the busiest expert group's expected
    active experts (:func:`busiest_group_active_experts`), ``1/moe_tp`` of each."""
    lay, m = _resolve(layout), model
    seqs, t_rank, t_all = _ranks_tokens(lay, batch, tokens_per_seq)
    tp, w = lay.attn_tp, m.weight_bytes
    repl, shard = m.attn_params
    if m.mla:
        kv = seqs * context * m.kv_elems_per_token_layer * m.kv_bytes * m.num_layers  # latent replicated over TP
    else:
        local_kv = max(1.0, m.num_kv_heads / tp)
        kv = seqs * context * 2 * local_kv * m.head_dim * m.kv_bytes * m.num_layers
    active = busiest_group_active_experts(m.num_experts, m.top_k, t_all, lay.moe_ep)
    busy = t_rank > 0
    return {
        "attention": busy * (repl + shard / tp) * m.num_layers * w,
        "kv_cache": float(kv),
        "dense_mlp": busy * 3 * m.hidden * m.dense_intermediate / tp * m.num_dense_layers * w,
        "shared_experts": busy * m.num_shared_experts * m.expert_params / tp * m.num_moe_layers * w,
        "router": busy * m.num_experts * m.hidden * m.router_bytes * m.num_moe_layers,
        "routed_experts": active * m.expert_params / lay.moe_tp * m.expert_weight_bytes * m.num_moe_layers,
        "embedding": t_rank * m.hidden * w,
        "lm_head": busy * m.vocab / tp * m.hidden * w,
    }


def step_flops(layout: Layout | str, model: ModelShape, batch: int, context: int,
               tokens_per_seq: int = 1) -> dict[str, float]:
    """FLOPs of the busiest rank in one decode step, by part: 2 × params touched × tokens, plus attention
    over ``context`` (MLA absorbed decode: ``2·(2·kv_lora + rope)`` per head per cached token; GQA ``4·d``).
    Routed experts use the mean load ``tokens·k/ep``."""
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
        "routed_experts": 2 * t_all * m.top_k / lay.moe_ep * m.expert_params / lay.moe_tp * m.num_moe_layers,
        "lm_head": 2 * t_rank * m.vocab / tp * m.hidden,
    }


def resident_bytes(layout: Layout | str, model: ModelShape) -> float:
    """Weight bytes one rank holds (capacity check; KV and activations not included)."""
    lay, m = _resolve(layout), model
    tp, w = lay.attn_tp, m.weight_bytes
    repl, shard = m.attn_params
    experts = m.num_experts // lay.moe_ep * m.expert_params / lay.moe_tp * m.expert_weight_bytes
    return ((repl + shard / tp) * m.num_layers * w + 3 * m.hidden * m.dense_intermediate / tp * m.num_dense_layers * w
            + m.num_moe_layers * (experts + m.num_shared_experts * m.expert_params / tp * w
                                  + m.num_experts * m.hidden * m.router_bytes)
            + 2 * m.vocab / tp * m.hidden * w)


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


def _bytes_per_call(key: str, lay: Layout, m: ModelShape, batch: int, tokens_per_seq: int) -> float:
    """Bytes per call (CommCounter's convention) of a ``"group/op"`` for the target model; 0 = α only."""
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
        return (p * 8 + t_moe * hits * (2 * row + 2 * m.top_k * 4)) / 4
    if op == "all_gather":  # dispatcher allgather per MoE layer: counts, rows, routing
        return (8 + t_moe * (row + 2 * m.top_k * 4)) / 3
    if op == "reduce_scatter":
        return p * t_moe * row
    return 0.0


def step_comm(layout: Layout | str, model: ModelShape, batch: int, calls_per_step: Mapping[str, float] | None = None,
              tokens_per_seq: int = 1) -> dict[str, dict[str, float]]:
    """``{"group/op": {"calls", "bytes"}}`` of one step on the busiest rank for ``model``: calls from
    ``calls_per_step`` (default: one forward by :func:`forward_calls`), bytes per call from the model's dims."""
    lay = _resolve(layout)
    calls = forward_calls(lay, model) if calls_per_step is None else calls_per_step
    return {k: {"calls": c, "bytes": c * _bytes_per_call(k, lay, model, batch, tokens_per_seq)}
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
                comm_per_step: Mapping[str, Mapping[str, float]] | None = None, tokens_per_seq: int = 1) -> Floors:
    """Memory floor = bytes read / ``mem_bw``; compute floor = FLOPs / ``peak_flops``; interconnect floor =
    Σ calls·α + bytes·factor/bandwidth over ``comm_per_step`` (``{"group/op": {"calls", "bytes"}}`` per step,
    e.g. a measured CommCounter delta divided by steps; default: :func:`step_comm` for ``model``)."""
    lay = _resolve(layout)
    b = step_bytes(lay, model, batch, context, tokens_per_seq)
    f = step_flops(lay, model, batch, context, tokens_per_seq)
    comm = step_comm(lay, model, batch, tokens_per_seq=tokens_per_seq) if comm_per_step is None else comm_per_step
    comm_s, comm_detail = comm_time(comm, lay, hw)
    return Floors(sum(b.values()) / hw.mem_bw, sum(f.values()) / hw.peak_flops, comm_s,
                  {"bytes": b, "flops": f, "comm": comm_detail})


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

    def as_dict(self) -> dict:
        return asdict(self)


def project(layout: Layout | str, hw: Hardware, model: ModelShape, batch: int, context: int,
            comm_calls_per_token_by_op: Mapping[str, float] | None = None, *, tokens_per_seq: int = 1,
            tau: float = 1.0, host_overhead_s: float = 0.0, overlap: str = "serial") -> Projection:
    """Projected decode step time and tok/s of ``layout`` on ``hw`` for ``model``.

    ``batch`` concurrent sequences with ``context`` cached tokens each. ``comm_calls_per_token_by_op``: calls
    per output token by ``"group/op"`` as the bench measures them (CommCounter delta / output tokens, for
    this model's depth: see :func:`rescale_calls`); a step makes ``calls·batch·tau`` of them. Default: the
    documented forward formula. Speculative decoding: ``tokens_per_seq`` = verify width, ``tau`` = mean
    tokens accepted per step; ``tok_s = batch·tau/step_s``. ``overlap``: "serial" (default) or "full", see
    the module docstring. ``host_overhead_s`` adds a fixed host/launch time per step (default 0: pure floors).
    """
    if overlap not in ("serial", "full"):
        raise ValueError(f"overlap must be 'serial' or 'full', got {overlap!r}")
    name = layout if isinstance(layout, str) else layout.describe()
    lay = _resolve(layout)
    calls = None
    if comm_calls_per_token_by_op is not None:
        calls = {k: v * batch * tau for k, v in comm_calls_per_token_by_op.items()}
    comm = step_comm(lay, model, batch, calls, tokens_per_seq)
    fl = step_floors(lay, hw, model, batch, context, comm, tokens_per_seq)
    local = max(fl.memory_s, fl.compute_s)
    if overlap == "serial":
        step = local + fl.interconnect_s + host_overhead_s
    else:
        step = max(local, fl.interconnect_s) + host_overhead_s
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
    )


def project_matrix(model: ModelShape = KIMI_K2_INT4, hardware: Mapping[str, Hardware] | None = None,
                   layouts: tuple[str, ...] = tuple(LAYOUTS), batches: tuple[int, ...] = (1, 8, 64),
                   context: int = 4096, **kw) -> list[Projection]:
    """Every (box, layout, batch) projection; ``kw`` goes to :func:`project`."""
    boxes = HARDWARE if hardware is None else hardware
    return [project(lay, hw, model, b, context, **kw) for hw in boxes.values() for lay in layouts for b in batches]


def projection_table(projections: list[Projection]) -> str:
    """Markdown table of projections (times in ms)."""
    head = ("| box | layout | batch | context | memory ms | compute ms | comm ms | step ms | tok/s | tok/s/user "
            "| bound | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {p.hardware} | {p.layout} | {p.batch} | {p.context} | {p.memory_s * 1e3:.3f} | "
            f"{p.compute_s * 1e3:.3f} | {p.comm_s * 1e3:.3f} | {p.step_s * 1e3:.3f} | {p.tok_s:.1f} | "
            f"{p.tok_s_per_user:.1f} | {p.bound} | {'yes' if p.fits else 'no'} |" for p in projections]
    return "\n".join([head, *rows])


def hardware_table(hw: Hardware) -> str:
    """Markdown table of one profile's parameters with their sources."""
    rows = []
    for r in hw.parameters():
        value = r["value"] if isinstance(r["value"], str) else f"{r['value']:g} {r['unit']}"
        rows.append(f"| {r['parameter']} | {value} | {r['source']} |")
    return "\n".join([f"**{hw.name}**", "", "| parameter | value | source |", "|---|---|---|", *rows])


# ------------------------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class Published:
    """A published single-box decode figure to check projections against (tok/s per user at ``batch``)."""

    case: str
    hardware: Hardware
    model: ModelShape
    layout: str
    batch: int
    tok_s: float
    source: str
    note: str = ""


# The autoregressive B300 figure is derived: 303 tok/s with speculative decoding at 2.15x over autoregressive.
B300_AR_TOK_S = 303 / 2.15

PUBLISHED: tuple[Published, ...] = (
    Published("origin story: Kimi K2.6, 8x RTX PRO 6000 PCIe, TP8, C=1", RTX_PRO_6000_PCIE5, KIMI_K2_INT4,
              "tp8", 1, 26.0, REF),
    Published("origin story: Kimi K2.6, 8x RTX PRO 6000 PCIe, EP8, C=1", RTX_PRO_6000_PCIE5, KIMI_K2_INT4,
              "ep8", 1, 65.0, REF, "EP8 with TP attention (vLLM --enable-expert-parallel, DP=1)"),
    Published("origin story: Kimi K2.6, 8x B300 NVLink5, TP8 + graphs, C=1, autoregressive", B300_NVLINK5,
              KIMI_K2_INT4, "tp8", 1, B300_AR_TOK_S, REF, "derived: 303 tok/s with spec decode / 2.15x"),
    Published("Kimi K2.5, 8x RTX PRO 6000 PCIe, vLLM TP8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, "tp8", 1, 90.0, REF,
              "concurrency not stated; compared at C=1"),
    Published("Kimi K2.5, 8x RTX PRO 6000 PCIe, SGLang EP8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, "ep8", 1, 101.0,
              REF, "concurrency not stated; compared at C=1; assumed TP attention (no DP attention)"),
)

# The speculative B300 figure: tau is not published, so it is solved for instead of compared.
B300_SPEC = Published("origin story: Kimi K2.6, 8x B300 NVLink5, TP8 + DFlash/DDTree, C=1", B300_NVLINK5,
                      KIMI_K2_INT4, "tp8", 1, 303.0, REF, "2.15x over autoregressive; tau not published")


def validate(context: int = 2048, verify_width: int = 8, **kw) -> list[dict]:
    """Projections against :data:`PUBLISHED` (pure floors unless ``kw`` adds ``host_overhead_s``).

    Each row: ``case, layout, published_tok_s, projected_tok_s, ratio`` (projected/published),
    ``error_pct`` (100·(ratio−1)), ``unexplained_ms`` (published step − projected step: what the floors miss),
    ``bound``, ``note``. Then the EP8/TP8 ratios, and the B300 speculative row, where the τ that the model
    needs to reach 303 tok/s with a ``verify_width``-token verify step is reported instead of an error.
    ``context``: cached tokens per sequence (not published; an assumption)."""
    rows = []
    by_case = {}
    for pub in PUBLISHED:
        pr = project(pub.layout, pub.hardware, pub.model, pub.batch, context, **kw)
        ratio = pr.tok_s_per_user / pub.tok_s
        by_case[pub.case] = (pub, pr)
        rows.append({"case": pub.case, "layout": pub.layout, "published_tok_s": pub.tok_s,
                     "projected_tok_s": pr.tok_s_per_user, "ratio": ratio, "error_pct": 100 * (ratio - 1),
                     "unexplained_ms": (1 / pub.tok_s - pr.step_s) * 1e3, "bound": pr.bound,
                     "note": pub.note, "source": pub.source})
    cases = [p.case for p in PUBLISHED]
    for label, tp_case, ep_case in (("EP8/TP8, origin story (Kimi K2.6, PCIe)", cases[0], cases[1]),
                                    ("EP8/TP8, SGLang vs vLLM (Kimi K2.5, PCIe)", cases[3], cases[4])):
        (tp_pub, tp_pr), (ep_pub, ep_pr) = by_case[tp_case], by_case[ep_case]
        published, projected = ep_pub.tok_s / tp_pub.tok_s, ep_pr.tok_s_per_user / tp_pr.tok_s_per_user
        rows.append({"case": label, "layout": "ep8/tp8",
                     "published_tok_s": published, "projected_tok_s": projected, "ratio": projected / published,
                     "error_pct": 100 * (projected / published - 1), "unexplained_ms": None, "bound": "",
                     "note": "ratio of the two rows above", "source": REF})
    ar = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, context, **kw)
    spec = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, context, tokens_per_seq=verify_width, **kw)
    tau_needed = B300_SPEC.tok_s * spec.step_s
    rows.append({"case": B300_SPEC.case, "layout": "tp8", "published_tok_s": B300_SPEC.tok_s,
                 "projected_tok_s": None, "ratio": None, "error_pct": None, "unexplained_ms": None,
                 "bound": spec.bound, "tau_needed": tau_needed,
                 "tau_for_2_15x": 2.15 * spec.step_s / ar.step_s, "source": REF,
                 "note": f"tau is not published: tau the floors need for 303 tok/s with a {verify_width}-token "
                         "verify step (drafter cost ignored), and tau that 2.15x implies over the projected "
                         "autoregressive step"})
    return rows


def validation_table(rows: list[dict]) -> str:
    """Markdown table of :func:`validate` rows."""
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    head = ("| case | published | projected | projected/published | error | unexplained ms/step | note |\n"
            "|---|---|---|---|---|---|---|")
    out = []
    for r in rows:
        note = r["note"]
        if "tau_needed" in r:
            note = f"tau needed {r['tau_needed']:.2f}; tau implied by 2.15x {r['tau_for_2_15x']:.2f}. {note}"
        num = ".2f" if r["layout"] == "ep8/tp8" else ".1f"
        out.append(f"| {r['case']} | {f(r['published_tok_s'], num)} | {f(r['projected_tok_s'], num)} | "
                   f"{f(r['ratio'], '.2f')} | {f(r['error_pct'], '+.0f')}{'' if r['error_pct'] is None else ' %'} | "
                   f"{f(r['unexplained_ms'], '.2f')} | {note} |")
    return "\n".join([head, *out])
