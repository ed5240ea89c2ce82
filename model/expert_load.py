"""Expert load: tokens routed to each logical expert, per MoE layer — what an expert placement is balanced on.

:class:`ExpertLoad` hooks every MoE layer's router (a forward hook on ``Router``) and adds, on the device, one count
per (row, top-k choice) to its layer's row of ``counts [L, E]`` (``index_add_``: no host synchronisation, graph-safe).
``armed`` is read when the hook runs, so a caller arms it for the forwards it wants counted. Every rank that runs a
router counts the rows it was given: under attention TP the ranks of a group see the same rows, so one of them (its
attention-TP rank 0) is the one to read.
"""

from __future__ import annotations

import torch
from torch import nn

from model.batch import ForwardBatch
from model.moe import MoE


class ExpertLoad:
    """Per MoE layer of ``model``: tokens routed to each logical expert over the counted forwards."""

    def __init__(self, model: nn.Module):
        routers = [m.gate for m in model.modules() if isinstance(m, MoE)]
        experts = routers[0].cfg.num_experts if routers else 0
        device = routers[0].weight.device if routers else torch.device("cpu")
        self.counts = torch.zeros(len(routers), experts, dtype=torch.int64, device=device)  # [L, E]
        self.armed = True
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def count(module: nn.Module, args, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self.armed:
                ids = output[0].reshape(-1)  # topk_ids [T, k]
                self.counts[layer].index_add_(0, ids, torch.ones_like(ids))
        return count

    def remove(self) -> None:
        """Takes the hooks off the model."""
        for h in self._hooks:
            h.remove()


def record_load(model: nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """``[L, E]`` int64 tokens per logical expert per MoE layer over one prefill forward of each of ``seqs`` (a
    single-rank model: every row is this rank's)."""
    load = ExpertLoad(model)
    try:
        with torch.no_grad():
            for seq in seqs:
                model(ForwardBatch.from_sequences([seq]))
    finally:
        load.remove()
    return load.counts.cpu()
