"""Dequantizing GEMMs: INT4 (W4A16) and FP8 block (W8A16; W8A8 with per-token FP8 activations) linears.

Weights stay packed in memory; each ``[BLOCK_K, BLOCK_N]`` tile is unpacked and scaled in registers
(:func:`dequant_tile`) and fed to ``tl.dot`` in the activations' dtype — the torch reference's "dequantize,
then matmul" (:mod:`model.quant.reference`), tile by tile. W8A8 instead multiplies e4m3 tiles of activations
and weights in the tensor cores (``BLOCK_K`` = the scale block, so one activation scale per row and one weight
scale per column apply to each partial product), as DeepSeek-V3's ``fp8_gemm`` does.

Formats (``N`` output rows, ``K`` input columns): INT4 ``w [N, K/8]`` int32 (value ``j`` of a word in bits
``4j..4j+3``, stored ``q + 8``), ``s [N, K/G]``; FP8 ``w [N, K]`` e4m3, ``s [⌈N/Bo⌉, ⌈K/Bi⌉]`` fp32.
No host synchronisation: the grid depends on shapes only (graph-safe).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from model.quant.reference import act_qdq, act_quant
from model.triton.precision import dot_precision


@triton.jit
def dequant_tile(w_ptr, s_ptr, rows, kk, mask, k0, K, stride_wn, stride_sn,
                 INT4: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr):
    """``Wᵀ[kk, rows]`` dequantized to fp32 (``[BLOCK_K, BLOCK_N]``): output rows ``rows``, input columns
    ``kk = k0 + arange(BLOCK_K)`` (``mask``: in range); the scale of ``(r, k)`` sits at
    ``s[r // S_ROWS, k // S_COLS]``. INT4 loads each packed word once (``[BLOCK_K/8, BLOCK_N]``) and splits it
    into its eight nibbles in registers."""
    if INT4:
        words = k0 // 8 + tl.arange(0, kk.shape[0] // 8)
        w_mask = (words < K // 8)[:, None] & (tl.max(mask.to(tl.int32), axis=0) > 0)[None, :]
        word = tl.load(w_ptr + rows[None, :].to(tl.int64) * stride_wn + words[:, None], mask=w_mask, other=0)
        nibbles = (word[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # [BLOCK_K/8, 8, BLOCK_N]
        v = (tl.reshape(nibbles, (kk.shape[0], rows.shape[0])) - 8).to(tl.float32)
    else:
        v = tl.load(w_ptr + rows[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rows[None, :] // S_ROWS).to(tl.int64) * stride_sn + kk[:, None] // S_COLS, mask=mask,
                other=0.0)
    return v * s.to(tl.float32)


@triton.jit
def fp8_block_dot(a, a_s, w_ptr, s_ptr, rows, kk, kb, mask, rows_ok, stride_wn, stride_sn, S_ROWS: tl.constexpr):
    """``(a · wᵀ)`` over one scale block of columns, scaled: ``a [BLOCK_M, BLOCK_K]`` e4m3 with per-row scales
    ``a_s [BLOCK_M]``, weight rows ``rows`` and columns ``kk`` (block ``kb``) e4m3 with their block scale."""
    w = tl.load(w_ptr + rows[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=mask, other=0.0)
    w_s = tl.load(s_ptr + (rows // S_ROWS).to(tl.int64) * stride_sn + kb, mask=rows_ok, other=0.0)
    return tl.dot(a, w) * a_s[:, None] * w_s[None, :]


@triton.jit
def _dequant_matmul_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_wn, stride_sn, stride_o,
                           INT4: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``: ``out = x @ dequant(w)ᵀ``, accumulated in fp32."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = dequant_tile(w_ptr, s_ptr, n, kk, k_ok[:, None] & n_ok[None, :], k0, K, stride_wn, stride_sn, INT4, S_ROWS,
                         S_COLS)
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8a8_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_xs, stride_wn, stride_sn,
                 stride_o, S_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid as :func:`_dequant_matmul_kernel`; ``BLOCK_K`` = the scale block's columns. ``xq [M, K]`` e4m3 with
    ``xs [M, ⌈K/BLOCK_K⌉]``: ``out = Σ_kb (xq·wqᵀ)_kb · xs[:, kb] · s[n // S_ROWS, kb]``."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(xq_ptr + m[:, None].to(tl.int64) * stride_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        a_s = tl.load(xs_ptr + m.to(tl.int64) * stride_xs + kb, mask=m_ok, other=0.0)
        acc += fp8_block_dot(a, a_s, w_ptr, s_ptr, n, kk, kb, k_ok[:, None] & n_ok[None, :], n_ok, stride_wn,
                             stride_sn, S_ROWS)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, n: int, k: int, invariant: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``; ``invariant``: BLOCK_M fixed, every tile from N and K only, so a
    row's reduction order does not depend on M (``engine.batch_invariant``)."""
    cap = lambda dim, most: max(16, min(most, triton.next_power_of_2(dim)))
    block_m = 16 if invariant or m <= 64 else 64
    return block_m, cap(n, 64), cap(k, 64), 4


def _launch(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, n: int, int4: bool, s_rows: int,
            s_cols: int, invariant: bool) -> torch.Tensor:
    x, w, s = x.contiguous(), w.contiguous(), s.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = _tiles(m, n, k, invariant)
    _dequant_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, s, out, m, n, k, x.stride(0), w.stride(0), s.stride(0), out.stride(0), INT4=int4, S_ROWS=s_rows,
        S_COLS=s_cols, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT=dot_precision(x.dtype), num_warps=warps)
    return out


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                 invariant: bool = False) -> torch.Tensor:
    """``x [T, K]`` @ INT4 ``packed [N, K/8]``, ``scale [N, K/G]`` → ``[T, N]`` in x's dtype; ``invariant``: one
    tile config for every T (:func:`_tiles`). Reference: :func:`model.quant.reference.w4a16_linear`."""
    return _launch(x, packed, scale, packed.shape[0], True, 1, group_size, invariant)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 invariant: bool = False) -> torch.Tensor:
    """``x [T, K]`` @ FP8 ``weight [N, K]`` with block scales → ``[T, N]``; activations stay in x's dtype
    (devices without FP8 tensor cores). Reference: :func:`model.quant.reference.w8a16_linear`."""
    return _launch(x, weight, scale_inv, weight.shape[0], False, block[0], block[1], invariant)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                invariant: bool = False) -> torch.Tensor:
    """As :func:`w8a16_linear` with ``x`` quantized per token in ``1 × block[1]`` groups (e4m3) and an FP8
    tensor-core GEMM (sm ≥ 89). Reference: :func:`model.quant.reference.w8a8_linear`."""
    m, k = x.shape
    n = weight.shape[0]
    if block[1] < 16:  # tl.dot needs K >= 16: same definition, weights dequantized in registers
        return _launch(act_qdq(x, block[1]), weight, scale_inv, n, False, block[0], block[1], invariant)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xq, xs = act_quant(x, block[1])
    weight, scale_inv = weight.contiguous(), scale_inv.contiguous()
    bm, bn, _, warps = _tiles(m, n, k, invariant)
    _w8a8_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        xq, xs, weight, scale_inv, out, m, n, k, xq.stride(0), xs.stride(0), weight.stride(0), scale_inv.stride(0),
        out.stride(0), S_ROWS=block[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1], num_warps=warps)
    return out


# the batch-invariant version of each linear (``engine.batch_invariant``: model.kernel_select)
INVARIANT = {op: functools.partial(op, invariant=True) for op in (w4a16_linear, w8a16_linear, w8a8_linear)}
