"""How many distinct local experts each MoE layer reads per forward: the routed-expert bytes a step really moves.

:class:`ExpertTally` hooks every MoE layer's experts (a forward pre-hook on ``LocalExperts``) and adds, on the
device, the number of distinct local slots the layer's input routes to, and one forward. No host
synchronisation: the ops are captured into a CUDA graph like the rest of the step and keep counting on replay.
``armed`` is read when the hook runs (for a graph: at capture), so a caller arms it for the forwards it wants
counted. Used by the engine (``engine.expert_tally``: decode and verify steps, read through ``GetEngineInfo``)
and by ``bench/gpu/roofline.py`` (one eager step).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from model.moe import MoE
from parallelism.dispatch_base import ExpertInput


class ExpertTally:
    """Per MoE layer of ``model``: distinct local experts summed over the counted forwards, and their number."""

    def __init__(self, model: nn.Module):
        layers = [m.experts for m in model.modules() if isinstance(m, MoE)]
        device = next(itertools.chain(layers[0].parameters(), layers[0].buffers())).device if layers else \
            torch.device("cpu")  # LocalExperts holds parameters, QuantExperts buffers
        self.sums = torch.zeros(len(layers), 2, dtype=torch.int64, device=device)  # [L, (experts, forwards)]
        self.armed = True
        self._hooks = [experts.register_forward_pre_hook(self._hook(i)) for i, experts in enumerate(layers)]

    def _hook(self, layer: int):
        def count(module: nn.Module, args: tuple[ExpertInput]) -> None:
            if self.armed:
                slots, experts = args[0].slots, len(module.global_ids)  # LocalExperts and QuantExperts
                hit = torch.zeros(experts + 1, dtype=torch.int64, device=slots.device)  # the last: not local
                hit.index_fill_(0, torch.where(slots >= 0, slots, experts).reshape(-1).long(), 1)
                self.sums[layer, 0].add_(hit[:experts].sum())
                self.sums[layer, 1].add_(1)
        return count

    def snapshot(self) -> dict[str, list[int]]:
        """``{"experts": [per layer], "forwards": [per layer]}`` since construction (reads the device)."""
        experts, forwards = self.sums.T.tolist()
        return {"experts": experts, "forwards": forwards}

    def remove(self) -> None:
        """Takes the hooks off the model."""
        for h in self._hooks:
            h.remove()


def touched_per_layer(before: dict[str, list[int]], after: dict[str, list[int]]) -> float | None:
    """Mean distinct experts per MoE layer per counted forward between two :meth:`ExpertTally.snapshot`; None
    when no forward was counted."""
    experts = sum(after["experts"]) - sum(before["experts"])
    forwards = sum(after["forwards"]) - sum(before["forwards"])
    return experts / forwards if forwards else None
