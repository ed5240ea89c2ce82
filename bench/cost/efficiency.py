"""Kernel efficiencies measured on one H200 in the first GPU run (``docs/records/gpu_first_run.md``; the figures in
``docs/kernel_efficiency.json``) and the rules that turn them into a fraction of the byte floor for each kernel
class of a decode step (docs/cost_model.md, "Calibration").

Classes: ``attention`` (KV bytes: paged decode attention), ``moe`` (routed-expert bytes: fused MoE) and
``dense`` (every other weight byte: projections, dense MLP, shared experts, router, LM head). Every fraction is
of the byte floor at the *measured* copy bandwidth; :attr:`KernelEfficiency.copy_fraction` (copy / spec
bandwidth on the H200) carries it to a profile's spec bandwidth. Other GPUs are assumed to reach the H200's
fractions (an assumption, not a measurement); the kernels are bf16, before the roofline rework. INT4 experts:
the fraction applies to the INT4 bytes (time scales with bytes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from bench.cost.formulas import step_bytes
from bench.cost.shapes import ModelShape
from parallelism.layout import Layout

EFFICIENCY_FILE = Path(__file__).resolve().parents[2] / "docs" / "kernel_efficiency.json"
ASSUMPTION = ("B300 and RTX PRO 6000 assumed to reach the H200's measured fractions (assumption, not measured); "
              "bf16 kernels before the roofline rework; INT4 experts at the bf16 fraction of their (INT4) bytes")


def interp_log2(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log2(x) through ``(x, y)`` points (x > 0), constant beyond the first and last."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0)) if x1 > x0 else 0.0
            return y0 + w * (y1 - y0)
    raise AssertionError("unreachable")


def step_model(model: Mapping) -> ModelShape:
    """The decode-step measurement's bf16 model (3 layers: 1 dense + 2 MoE) as a :class:`ModelShape`."""
    keys = ("hidden", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "num_layers", "num_dense_layers", "dense_intermediate", "num_experts", "top_k",
            "moe_intermediate", "num_shared_experts", "vocab")
    return ModelShape(name="H200 decode-step slice (bf16)", **{k: model[k] for k in keys})


@dataclass(frozen=True)
class KernelEfficiency:
    """Per-class fractions of the byte floor from a loaded ``kernel_efficiency.json`` (``data``).

    ``dense="step"`` (default): the dense class at what the engine's measured decode step leaves after
    attention and MoE at their own fractions (:meth:`step_residuals`; contains this engine's host time and small
    kernels). ``dense="kernel"``: the eager profile's cuBLAS share instead (kernels only, batch 8)."""

    data: Mapping
    dense_rule: str = "step"

    def __post_init__(self):
        if self.dense_rule not in ("step", "kernel"):
            raise ValueError(f"dense_rule must be 'step' or 'kernel', got {self.dense_rule!r}")

    @property
    def copy_bw(self) -> float:
        return self.data["hardware"]["copy_gb_s"] * 1e9

    @property
    def copy_fraction(self) -> float:
        """Measured copy bandwidth / spec bandwidth of the measuring GPU (0.888 on the H200)."""
        hw = self.data["hardware"]
        return hw["copy_gb_s"] / hw["spec_mem_gb_s"]

    @property
    def label(self) -> str:
        hw = self.data["hardware"]
        return (f"{hw['name']} ({hw['sms']} SMs, {hw['power_limit_w']} W, copy {hw['copy_gb_s']} GB/s) at "
                f"{self.data['project_commit']}, dense={self.dense_rule}")

    def attention(self, heads: float, batch: float, mla: bool = True) -> float:
        """Paged decode attention: rows of the kernel (MLA or GQA) whose query heads are nearest ``heads`` in
        log2 (a tie takes the lower fraction), interpolated in log2(batch) and clamped; context is ignored."""
        rows = [r for r in self.data["attention"]["rows"] if r["kernel"] == ("mla" if mla else "gqa")]
        dist = {r["heads"]: abs(math.log2(r["heads"]) - math.log2(max(heads, 1))) for r in rows}
        best = min(dist.values())
        groups = {h for h, d in dist.items() if d - best < 1e-9}
        fracs = {h: interp_log2([(r["batch"], r["fraction"]) for r in rows if r["heads"] == h], max(batch, 1))
                 for h in groups}
        return min(fracs.values())

    def moe(self, tokens: float) -> float:
        """Fused MoE: interpolated in log2(tokens of the step) between 64, 256, 1024, 4096; clamped."""
        return interp_log2([(r["tokens"], r["fraction"]) for r in self.data["moe"]["rows"]], max(tokens, 1))

    def dense(self, tokens: float) -> float:
        """Everything else: by ``dense_rule``; "step" interpolates the residuals in log2(tokens per rank)."""
        if self.dense_rule == "kernel":
            return self.dense_kernel
        return interp_log2([(r["batch"], r["fraction"]) for r in self.step_residuals], max(tokens, 1))

    @cached_property
    def dense_kernel(self) -> float:
        """cuBLAS projections in the eager profile: their bytes / copy bandwidth over their share of GPU time."""
        row = self.data["dense_gemm"]["rows"][0]
        m = step_model(self.data["decode_step"]["model"])
        b = step_bytes(Layout(), m, 1, self.data["decode_step"]["model"]["context"])
        gemm = b["attention"] + b["dense_mlp"] + b["shared_experts"] + b["lm_head"]
        return gemm / self.copy_bw / (row["share"] * row["gpu_ms_per_step"] * 1e-3)

    @cached_property
    def step_residuals(self) -> list[dict]:
        """Per measured batch (graphs on): the dense class's fraction = its bytes / copy bandwidth over the step
        time minus attention and MoE at their fractions; also the floor recomputed here (``floor_ms``)."""
        ds = self.data["decode_step"]
        m = step_model(ds["model"])
        out = []
        for r in ds["rows"]:
            if not r["graphs"]:
                continue
            b = step_bytes(Layout(), m, r["batch"], ds["model"]["context"])
            attn = b["kv_cache"] / (self.attention(m.num_heads, r["batch"]) * self.copy_bw)
            moe = b["routed_experts"] / (self.moe(r["batch"]) * self.copy_bw)
            dense_bytes = sum(v for k, v in b.items() if k not in ("kv_cache", "routed_experts", "embedding"))
            left = r["step_ms"] * 1e-3 - attn - moe
            out.append({"batch": r["batch"], "fraction": dense_bytes / self.copy_bw / left,
                        "floor_ms": (sum(b.values()) - b["embedding"] - b["kv_cache"]) / self.copy_bw * 1e3,
                        "step_ms": r["step_ms"], "measured_floor_ms": r["floor_ms"]})
        return out

    def fractions(self, bytes_by_part: Mapping[str, float], heads: float, seqs: int, tokens_rank: int,
                  tokens_job: int, mla: bool = True) -> dict[str, float]:
        """The fraction applied to each :func:`bench.cost.formulas.step_bytes` part."""
        attn, moe, dense = self.attention(heads, seqs, mla), self.moe(tokens_job), self.dense(tokens_rank)
        return {k: attn if k == "kv_cache" else moe if k == "routed_experts" else dense for k in bytes_by_part}


def load_efficiency(path: Path | str = EFFICIENCY_FILE, dense_rule: str = "step") -> KernelEfficiency:
    """The measured efficiencies; raises if an entry lacks its hardware or source."""
    data = json.loads(Path(path).read_text())
    for section in ("attention", "moe", "decode_step", "dense_gemm"):
        for row in data[section]["rows"]:
            if not row.get("hardware") or not row.get("source"):
                raise ValueError(f"{path}: a {section} row names no hardware or source: {row}")
    return KernelEfficiency(data, dense_rule)
