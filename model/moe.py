"""One MoE layer: Router → Dispatcher.dispatch → local Experts → Dispatcher.combine, plus shared experts."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from model.config import ModelConfig, MoEConfig
from model.kernel_select import KernelSet, check_unsummed, reference_kernels
from model.layers import GatedMLP
from parallelism.comm import ParallelGroups
from parallelism.dispatch_base import Dispatcher, ExpertInput
from parallelism.layout import ExpertPlacement, divide
from parallelism.linear import CheckpointTensor, ShardedModule, copy_into


class Router(ShardedModule):
    """fp32 gate. DeepSeek-V3: sigmoid + ``e_score_correction_bias`` for choice, group-limited top-k
    (best ``topk_group`` of ``n_group`` groups by the sum of each group's top-2), weights from the
    un-biased scores, optional renorm, × ``routed_scaling_factor``. Qwen3: softmax top-k, optional renorm.
    """

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
                                        if cfg.correction_bias else None)
        self.kernels: KernelSet = reference_kernels()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` → ``topk_ids [T, k]`` int64, ``topk_weights [T, k]`` fp32."""
        c = self.cfg
        logits = self.matmul(x.float(), self.weight)  # [T, E]
        if c.scoring == "softmax":
            probs = logits.softmax(dim=-1)
            weights, ids = probs.topk(c.top_k, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights
        scores = self.kernels.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.num_experts // c.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(-1, c.num_experts)
        ids = choice.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        yield CheckpointTensor("weight", tuple(self.weight.shape), lambda s: copy_into(self.weight, s.read()))
        if self.e_score_correction_bias is not None:
            b = self.e_score_correction_bias
            yield CheckpointTensor("e_score_correction_bias", tuple(b.shape), lambda s: copy_into(b, s.read()))


class LocalExperts(ShardedModule):
    """The routed experts this rank holds, each with ``1/moe_tp`` of its intermediate dim.

    Weights: ``w_gate_up [E_local, 2*I_shard, H]``, ``w_down [E_local, H, I_shard]``. Loaded from
    HF per-expert tensors ``{e}.gate_proj/up_proj/down_proj.weight`` of the local experts only.
    """

    def __init__(self, hidden: int, cfg: MoEConfig, placement: ExpertPlacement, ep_rank: int, tp_rank: int,
                 dtype=torch.float32):
        super().__init__()
        self.global_ids = placement.local_experts(ep_rank)
        self.inter = divide(cfg.intermediate_size, placement.moe_tp, "moe_intermediate_size over moe_tp")
        self.full_inter, self.tp_rank, self.hidden = cfg.intermediate_size, tp_rank, hidden
        n = len(self.global_ids)
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, hidden, self.inter, dtype=dtype), requires_grad=False)
        self.kernels: KernelSet = reference_kernels()

    def forward(self, inp: ExpertInput) -> torch.Tensor:
        """Weighted sum over each row's local experts: ``[N, H]`` (the kernel set's ``moe_experts``: the
        Triton fused MoE, or :func:`model.kernels.local_experts`); each pair's output ``[N, k, H]`` when
        ``inp.unsummed`` (batch-invariant kernels only)."""
        check_unsummed(inp, self.kernels)
        return self.kernels.moe_experts(inp, self.w_gate_up, self.w_down)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        i, full, h = self.inter, self.full_inter, self.hidden
        for slot, e in enumerate(self.global_ids):
            for half, name in enumerate(("gate_proj", "up_proj")):
                def load(s, slot=slot, half=half):
                    copy_into(self.w_gate_up[slot, half * i:(half + 1) * i], s.narrow(0, self.tp_rank * i, i))
                yield CheckpointTensor(f"{e}.{name}.weight", (full, h), load)

            def load_down(s, slot=slot):
                copy_into(self.w_down[slot], s.narrow(1, self.tp_rank * i, i))
            yield CheckpointTensor(f"{e}.down_proj.weight", (h, full), load_down)


class MoE(nn.Module):
    """Router, dispatcher, local experts and (optional) shared experts, composed as siblings.

    Shared experts are split over the attention-TP group and left unreduced, so with the allreduce
    dispatcher routed and shared partial sums share one all-reduce.
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, placement: ExpertPlacement,
                 dispatcher: Dispatcher, dtype=torch.float32):
        super().__init__()
        c = groups.coords
        self.gate = Router(cfg.hidden_size, cfg.moe)
        self.experts = LocalExperts(cfg.hidden_size, cfg.moe, placement, c.moe_ep_rank, c.moe_tp_rank, dtype)
        self.dispatcher = dispatcher
        self.shared_experts = None
        if cfg.moe.num_shared_experts:
            inter = cfg.moe.intermediate_size * cfg.moe.num_shared_experts
            self.shared_experts = GatedMLP(cfg.hidden_size, inter, groups.attn_tp, reduce=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        topk_ids, topk_weights = self.gate(x)
        expert_input, meta = self.dispatcher.dispatch(x, topk_ids, topk_weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return self.dispatcher.combine(self.experts(expert_input), meta, shared)
