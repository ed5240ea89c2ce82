"""Small replicated building blocks: RMSNorm and the dense (and shared-expert) MLP."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from model.kernel_select import KernelSet, reference_kernels
from parallelism.comm import Comm
from parallelism.linear import (
    CheckpointTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
    ShardedModule,
    copy_into,
)


class RMSNorm(ShardedModule):
    """Replicated RMSNorm over the last dim."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.kernels: KernelSet = reference_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)`` in one kernel where the kernel set has it fused."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        yield CheckpointTensor("weight", tuple(self.weight.shape), lambda s: copy_into(self.weight, s.read()))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, intermediate dim split over ``comm``.

    ``reduce=False`` leaves the partial sum ``[T, H]`` unreduced for the caller to fuse (shared experts).
    Checkpoint names: ``gate_proj``, ``up_proj``, ``down_proj``.
    """

    def __init__(self, hidden: int, intermediate: int, comm: Comm, reduce: bool = True, dtype=torch.float32):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       ["gate_proj", "up_proj"], comm, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, comm, reduce=reduce, dtype=dtype)
        self.kernels: KernelSet = reference_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
