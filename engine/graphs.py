"""CUDA-graph coverage: per step kind, how many steps replayed a captured graph, and why the others ran eager.

"Are CUDA graphs working?" is answered from these numbers (``GetServerInfo``, bench reports). Capture
itself needs a CUDA device and a graph-safe step (static buffers, no host synchronisation: the Triton
MoE and paged-attention kernels, a graph-safe dispatcher); until a step kind has that, every step of
that kind runs eager with the reason recorded here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# draft and commit: the drafter step and the walk + KV compaction of a verify step
STEP_KINDS = ("prefill", "decode", "verify", "mixed", "draft", "commit")


def capture_blocker(model) -> str:
    """Why no forward of ``model`` can be captured, whatever the step: "", or the MoE dispatcher that makes the
    host wait on the device (e.g. the all-to-all reads its row counts), or :func:`kernel_blocker`. Decided up
    front: a capture that fails half-way leaves NCCL and the caching allocator in states PyTorch does not
    always recover from."""
    unsafe = sorted({layer.mlp.dispatcher.name for layer in model.model.layers
                     if hasattr(layer.mlp, "dispatcher") and not layer.mlp.dispatcher.graph_safe})
    if unsafe:
        return f"dispatcher {unsafe[0]!r} is not CUDA-graph safe (it waits on the host)"
    return kernel_blocker(model)


def kernel_blocker(model) -> str:
    """Why ``model``'s kernel set cannot be captured: "" for the Triton set; the torch references read sequence
    lengths and expert row counts on the host (``.tolist()``, boolean indexing)."""
    kernels = model.kernels
    if kernels.graph_safe:
        return ""
    why = kernels.reasons.get("moe_experts", "torch reference kernels")
    return f"{why}: the torch references wait on the host, capture needs the Triton kernels"


def token_limit_blocker(model, tokens: int) -> str:
    """Why a step of ``tokens`` tokens per rank cannot be captured although the dispatcher is graph-safe: ""
    or the dispatcher whose graph-safe path holds fewer tokens (DeepEP's low-latency buffers are sized for
    ``parallel.deepep_max_decode_tokens``). Decided before capture, the same on every rank, so no rank starts
    a collective inside a capture that another rank refuses."""
    limits = {(d.graph_token_limit, d.name) for d in (getattr(layer.mlp, "dispatcher", None)
                                                      for layer in model.model.layers)
              if d is not None and d.graph_token_limit is not None}
    if not limits:
        return ""
    limit, name = min(limits)
    return (f"{tokens} tokens per rank exceed dispatcher {name!r}'s graph-safe bound of {limit} (from "
            "parallel.deepep_max_decode_tokens, times attn_tp when attention TP ranks split their tokens)"
            ) if tokens > limit else ""


def eager_reason(model, static_steps: str) -> str:
    """Why a process whose runner has no static steps replays no graphs (``static_steps``:
    ``engine.static_steps``)."""
    if model.device.type != "cuda":
        return "no CUDA device" if not torch.cuda.is_available() else "model not on a CUDA device"
    return capture_blocker(model) or f"static steps off (engine.static_steps={static_steps})"


@dataclass
class GraphCoverage:
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    replays: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    reasons: dict[str, str] = field(default_factory=dict)

    def record(self, kind: str, replayed: bool, reason: str = "") -> None:
        self.steps[kind] += 1
        if replayed:
            self.replays[kind] += 1
        elif reason:
            self.reasons[kind] = reason

    def summary(self) -> dict[str, dict]:
        """``{kind: {"replays": r, "steps": n, "coverage": r/n, "eager_reason": str}}`` for kinds that ran."""
        return {k: {"replays": self.replays[k], "steps": n, "coverage": self.replays[k] / n,
                    "eager_reason": self.reasons.get(k, "")}
                for k, n in self.steps.items() if n}
