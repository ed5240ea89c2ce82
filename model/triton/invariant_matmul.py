"""Batch-invariant GEMMs for the GPU path (``engine.batch_invariant``; docs/batch_invariance.md).

One tile config for every shape — ``BLOCK_M × BLOCK_N`` output tiles, the K dim walked in ``BLOCK_K`` steps in
order, fp32 accumulation, no split-K — so an output row's reduction order is fixed by K alone, whatever M (the
rows sharing the launch) is: the M=1 decode row and the same row inside a 257-row tree verify get the same bits.
cuBLAS picks its algorithm (and split-K) from M, which is what this replaces.

:func:`moe_experts` is :func:`model.triton.moe.fused_moe` with one fixed tile config and its ordered combine
(per-pair outputs summed in top-k order, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.triton.moe import MoETiles, fused_moe
from model.triton.precision import dot_precision
from parallelism.dispatch_base import ExpertInput

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # one config for every shape (a tuned table would change K order per bucket)
MOE_TILES = MoETiles(16, 64, 64, 4)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``: ``y[rows, cols] = x[rows] @ w[cols].T (+ b[cols])``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, c_ok = rows < m, cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):  # K in order, one step per BLOCK_K: the row's only reduction
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :] * stride_xk,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk,
                    mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """``x [M, K]``, ``w [N, K]`` (any strides), ``y [M, N]`` (unit column stride) ← ``x @ w.T (+ bias)``."""
    (m, k), n = x.shape, w.shape[0]
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), x.stride(1), w.stride(0),
                             w.stride(1), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, DOT=dot_precision(x.dtype))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` row-invariantly: ``x [..., K]``, ``weight [N, K]`` → ``[..., N]`` in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.empty(flat.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _launch(flat, weight, bias, y).view(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, h, K]``, ``w [h, K, N]`` → ``[T, h, N]``, one launch per head."""
    t, h = x.shape[:2]
    y = torch.empty(t, h, w.shape[2], dtype=x.dtype, device=x.device)
    for i in range(h):
        _launch(x[:, i], w[i].t(), None, y[:, i])
    return y


def moe_experts(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """:func:`model.triton.moe.fused_moe` with :data:`MOE_TILES` for every shape and the ordered combine."""
    return fused_moe(inp, w_gate_up, w_down, MOE_TILES, ordered_combine=True)
