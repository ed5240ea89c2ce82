"""Fused MoE over locally held experts with INT4 (W4A16) or FP8 block (W8A16) weights, sorted layout.

The shape of :mod:`model.triton.moe`'s fused MoE (``moe_align_block_size`` → gate_up GEMM with SiLU·mul →
down GEMM with the routing weight, atomically added), with each weight tile unpacked and scaled in registers
(:func:`model.triton.quant_gemm.dequant_tile`). DeepEP's packed low-latency layout goes through the same
kernels: its ``slots`` mark expert ``e`` on the valid rows and −1 elsewhere, so the sort picks the valid rows
(rows past a count come back zero, which ``low_latency_combine`` never reads). Graph-safe: no host sync.

Weights (``E`` local experts, ``I`` this rank's intermediate): INT4 ``w13 [E, 2I, H/8]``, ``s13 [E, 2I, H/G]``,
``w2 [E, H, I/8]``, ``s2 [E, H, I/G]``; FP8 ``w13 [E, 2I, H]``, ``s13 [E, 2I/Bo, ⌈H/Bi⌉]``, ``w2 [E, H, I]``,
``s2 [E, ⌈H/Bo⌉, I/Bi]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.triton.moe import _block_rows, default_tiles, moe_align_block_size
from model.triton.quant_gemm import dequant_tile
from model.triton.reference import dot_precision
from parallelism.dispatch import ExpertInput


@triton.jit
def _q_gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs, top_k, hidden,
                      inter, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                      INT4: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(P // BLOCK_M, cdiv(I, BLOCK_N))``: ``h[row] = silu(x[tok] @ Wg[e]ᵀ) * (x[tok] @ Wu[e]ᵀ)``."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows, pair, ok, tok, e = _block_rows(sorted_ptr, expert_ptr, pid_m, num_pairs, top_k, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        a = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_x + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                    other=0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        wg = dequant_tile(w_e, s_e, n, kk, mask, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
        wu = dequant_tile(w_e, s_e, inter + n, kk, mask, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
        gate += tl.dot(a, wg.to(a.dtype), input_precision=DOT)
        up += tl.dot(a, wu.to(a.dtype), input_precision=DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _q_down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs, top_k,
                   hidden, inter, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                   INT4: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(P // BLOCK_M, cdiv(H, BLOCK_N))``: ``out[tok] += weight[pair] * (h[row] @ Wd[e]ᵀ)`` (fp32 out)."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows, pair, ok, tok, e = _block_rows(sorted_ptr, expert_ptr, pid_m, num_pairs, top_k, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = dequant_tile(w_e, s_e, n, kk, k_ok[:, None] & n_ok[None, :], stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT)
    acc *= tl.load(weight_ptr + pair, mask=ok, other=0.0)[:, None]
    tl.atomic_add(out_ptr + tok[:, None].to(tl.int64) * stride_out + n[None, :], acc,
                  mask=ok[:, None] & n_ok[None, :])


def _fused(inp: ExpertInput, w13, s13, w2, s2, int4: bool, s_rows: int, s_cols: int, inter: int) -> torch.Tensor:
    x = inp.hidden.contiguous()
    (n, hidden), experts, pairs = x.shape, w13.shape[0], inp.slots.numel()
    if pairs == 0 or experts == 0:
        return torch.zeros_like(x)
    t = default_tiles(pairs, hidden, inter)
    sorted_ids, expert_ids, num_post = moe_align_block_size(inp.slots, experts, t.block_m)
    w13, s13, w2, s2 = (v.contiguous() for v in (w13, s13, w2, s2))
    h = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(n, hidden, dtype=torch.float32, device=x.device)
    blocks, top_k = expert_ids.numel(), inp.slots.shape[1]
    meta = dict(INT4=int4, S_ROWS=s_rows, S_COLS=s_cols, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                DOT=dot_precision(x.dtype), num_warps=t.num_warps)
    _q_gate_up_kernel[(blocks, triton.cdiv(inter, t.block_n))](
        x, w13, s13, h, sorted_ids, expert_ids, num_post, pairs, top_k, hidden, inter, x.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), **meta)
    weights = inp.weights.reshape(-1).float().contiguous()
    _q_down_kernel[(blocks, triton.cdiv(hidden, t.block_n))](
        h, w2, s2, out, weights, sorted_ids, expert_ids, num_post, pairs, top_k, hidden, inter, h.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0), **meta)
    return out.to(x.dtype)


def w4a16_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """Routed experts with INT4 weights → ``[N, H]``. Reference: :func:`model.quant.reference.w4a16_moe`."""
    return _fused(inp, w13, s13, w2, s2, True, 1, group_size, w13.shape[1] // 2)


def w8a16_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              block: tuple[int, int]) -> torch.Tensor:
    """Routed experts with FP8 block weights, activations unquantized → ``[N, H]``.
    Reference: :func:`model.quant.reference.w8a16_moe`."""
    return _fused(inp, w13, s13, w2, s2, False, block[0], block[1], w13.shape[1] // 2)
