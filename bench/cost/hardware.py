"""Hardware profiles of the cost model: one box of identical GPUs, every number per GPU with its source.

Units: bytes, seconds, FLOP, bytes/s, FLOP/s. The formulas that use them: :mod:`bench.cost.formulas`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

REF = "docs/records/field_notes.md"
VENDOR = "vendor spec, not measured here"
ASSUMED = "assumption, not measured here"


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
        "bus_bw": "derived: docs/records/field_notes.md's NVLink4 ratio (370 GB/s busBW of 450 GB/s per direction) "
                  "applied to NVLink5's 900 GB/s per direction; not measured",
        "a2a_bw": "derived: DeepEP's 153 GB/s on H800 (200 GB/s per direction, docs/records/field_notes.md) scaled to "
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
        "a2a_bw": "derived: DeepEP's 153 GB/s on H800 (docs/records/field_notes.md) scaled from 200 to 450 GB/s per "
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

