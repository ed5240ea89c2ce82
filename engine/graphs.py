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


def eager_reason(dispatcher_graph_safe: bool) -> str:
    """Why this process cannot replay graphs at all (empty string: it could)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not dispatcher_graph_safe:
        return "dispatcher is not CUDA-graph safe"
    return "graph capture not built for this step kind yet"


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
