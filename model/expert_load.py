"""Expert load: tokens routed to each logical expert, per MoE layer — what an expert placement is balanced on.

:class:`ExpertLoad` hooks every MoE layer's router (a forward hook on ``Router``) and adds, on the device, one count
per (row, top-k choice) to its layer's row of ``counts [L, E]`` (``index_add_``: no host synchronisation, graph-safe:
a CUDA graph captured with the hook keeps counting on replay). Only the first ``valid_rows`` rows of a forward count
(a device scalar the engine's runner sets before each step: a static step's padding rows, at the end, do not), and
``armed`` is read when the hook runs. Every rank that runs a router sees the rows of its attention-DP group; under
attention TP the ranks of a group see the same rows, so only its attention-TP rank 0 counts (``counting``).
"""

from __future__ import annotations

import torch
from torch import nn

from model.batch import ForwardBatch
from model.moe import MoE

ALL_ROWS = 2**62  # valid_rows outside static steps: every row counts


class ExpertLoad:
    """Per MoE layer of ``model``: tokens routed to each logical expert over the counted forwards."""

    def __init__(self, model: nn.Module, counting: bool = True):
        routers = [m.gate for m in model.modules() if isinstance(m, MoE)]
        experts = routers[0].cfg.num_experts if routers else 0
        device = routers[0].weight.device if routers else torch.device("cpu")
        self.counts = torch.zeros(len(routers), experts, dtype=torch.int64, device=device)  # [L, E]
        self.valid_rows = torch.full((), ALL_ROWS, dtype=torch.int64, device=device)  # rows of a forward that count
        self.armed, self.counting = True, counting
        hooks = counting and routers
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)] if hooks else []

    def _hook(self, layer: int):
        def count(module: nn.Module, args, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self.armed:
                ids = output[0]  # topk_ids [T, k]
                rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
                self.counts[layer].index_add_(0, ids.reshape(-1), (rows < self.valid_rows).reshape(-1).long())
        return count

    def reset(self) -> torch.Tensor:
        """The counts so far (on the host), then zeroes them in place (captured graphs keep their address)."""
        counts = self.counts.to("cpu", copy=True)  # a copy also on the CPU, where .cpu() is the tensor itself
        self.counts.zero_()
        return counts

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
