"""Torch reference kernels (fp32 on CPU). Triton versions, where they exist, are checked against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` normalised in fp32, scaled by ``weight [D]`` (HF semantics: cast back, then scale)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate | up) → ``silu(gate) * up`` ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: ``q [n, h, d]``, ``k [m, h, d]``, ``v [m, h, dv]``; ``mask [n, m]`` bool (True = attend)
    or None for causal with the queries at the last n positions. Returns ``[n, h, dv]``."""
    n, m = q.shape[0], k.shape[0]
    if mask is None:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("hnm,mhd->nhd", probs, v)
