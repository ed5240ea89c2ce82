"""Fused MoE over locally held experts with INT4 (W4A16) or FP8 block (W8A16, W8A8) weights, sorted and
DeepEP-packed layouts.

The shape of :mod:`model.triton.moe`'s fused MoE (``moe_align_block_size`` → gate_up GEMM with SiLU·mul →
down GEMM with the routing weight, atomically added), with each weight tile unpacked and scaled in registers
(:func:`model.triton.quant_gemm.dequant_tile`); DeepEP's packed low-latency layout (``inp.packed_counts``) runs a
masked grouped GEMM on the layout itself, as :func:`model.triton.moe.masked_moe` (unweighted; rows past a count
unwritten). W8A8 quantizes the activations per token before each GEMM. Graph-safe: no host sync. ``invariant``
(``engine.batch_invariant``, sorted layout only): one tile config for every shape and the per-pair store summed in
top-k order of :func:`model.triton.moe.fused_moe`'s ``ordered_combine``.

Weights (``E`` local experts, ``I`` this rank's intermediate): INT4 ``w13 [E, 2I, H/8]``, ``s13 [E, 2I, H/G]``,
``w2 [E, H, I/8]``, ``s2 [E, H, I/G]``; FP8 ``w13 [E, 2I, H]``, ``s13 [E, 2I/Bo, ⌈H/Bi⌉]``, ``w2 [E, H, I]``,
``s2 [E, ⌈H/Bo⌉, I/Bi]``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from model.invariant import finish_pairs
from model.quant.reference import act_qdq, act_quant
from model.triton.invariant_matmul import MOE_TILES
from model.triton.moe import combine_store, default_tiles, moe_align_block_size
from model.triton.precision import dot_precision
from model.triton.quant_gemm import dequant_tile, fp8_block_dot
from parallelism.dispatch_base import ExpertInput


@triton.jit
def _block_rows(sorted_ptr, expert_ptr, pid_m, num_pairs, top_k, BLOCK_M: tl.constexpr):
    """One BLOCK_M block of :func:`moe_align_block_size`'s order: sorted positions, pair ids, validity, token
    rows, expert."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    ok = pair < num_pairs
    return rows, pair, ok, pair // top_k, tl.load(expert_ptr + pid_m).to(tl.int64)


@triton.jit
def _masked_rows(counts_ptr, rows_per_expert, BLOCK_M: tl.constexpr):
    """A masked-GEMM program (grid ``(row blocks, N tiles, E)``: an expert's row blocks run back to back on each
    weight tile): its expert, that expert's row count, its BLOCK_M rows and their validity."""
    e = tl.program_id(2).to(tl.int64)
    count = tl.load(counts_ptr + e)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, count, rows, rows < tl.minimum(count, rows_per_expert)


@triton.jit
def _q_gate_up_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs, top_k,
                      hidden, inter, stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                      INT4: tl.constexpr, A_FP8: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(P // BLOCK_M, cdiv(I, BLOCK_N))``: ``h[row] = silu(x[tok] @ Wg[e]ᵀ) * (x[tok] @ Wu[e]ᵀ)``.
    ``A_FP8`` (W8A8): ``x`` is e4m3 with per-token block scales ``xs [N, H/BLOCK_K]``, ``BLOCK_K == S_COLS``."""
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
        if A_FP8:
            kb = k0 // BLOCK_K
            a_s = tl.load(xs_ptr + tok.to(tl.int64) * stride_xs + kb, mask=ok, other=0.0)
            gate += fp8_block_dot(a, a_s, w_e, s_e, n, kk, kb, mask, n_ok, stride_wn, stride_sn, S_ROWS)
            up += fp8_block_dot(a, a_s, w_e, s_e, inter + n, kk, kb, mask, n_ok, stride_wn, stride_sn, S_ROWS)
        else:
            wg = dequant_tile(w_e, s_e, n, kk, mask, k0, hidden, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
            wu = dequant_tile(w_e, s_e, inter + n, kk, mask, k0, hidden, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
            gate += tl.dot(a, wg.to(a.dtype), input_precision=DOT)
            up += tl.dot(a, wu.to(a.dtype), input_precision=DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _q_down_kernel(h_ptr, hs_ptr, w_ptr, s_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs,
                   top_k, hidden, inter, stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                   INT4: tl.constexpr, A_FP8: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                   PER_PAIR: tl.constexpr = False):
    """Grid ``(P // BLOCK_M, cdiv(H, BLOCK_N))``: ``out[tok] += weight[pair] * (h[row] @ Wd[e]ᵀ)`` (fp32 out);
    ``A_FP8``: ``h`` e4m3 with per-row block scales ``hs [P, I/BLOCK_K]``. ``PER_PAIR``: ``out [N*k, H]``,
    ``out[pair] = ...`` (:func:`model.triton.moe.combine_store`)."""
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
        mask = k_ok[:, None] & n_ok[None, :]
        if A_FP8:
            kb = k0 // BLOCK_K
            a_s = tl.load(hs_ptr + rows.to(tl.int64) * stride_hs + kb, mask=ok, other=0.0)
            acc += fp8_block_dot(a, a_s, w_e, s_e, n, kk, kb, mask, n_ok, stride_wn, stride_sn, S_ROWS)
        else:
            w = dequant_tile(w_e, s_e, n, kk, mask, k0, inter, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT)
    acc *= tl.load(weight_ptr + pair, mask=ok, other=0.0)[:, None]
    combine_store(out_ptr, acc, pair, tok, n, ok[:, None] & n_ok[None, :], stride_out, PER_PAIR)


@triton.jit
def _q_masked_gate_up_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, counts_ptr, rows_per_expert, hidden, inter,
                             stride_xe, stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_he,
                             stride_h, INT4: tl.constexpr, A_FP8: tl.constexpr, S_ROWS: tl.constexpr,
                             S_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_M), cdiv(I, BLOCK_N), E)`` on DeepEP's ``x [E, R, H]``: ``h[e, r]`` for ``r <
    counts[e]``; ``xs [E*R, H/BLOCK_K]`` (W8A8) indexed by ``e * R + r``."""
    e, count, rows, ok = _masked_rows(counts_ptr, rows_per_expert, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    x_rows = x_ptr + e * stride_xe + rows[:, None].to(tl.int64) * stride_x
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        a = tl.load(x_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        if A_FP8:
            kb = k0 // BLOCK_K
            a_s = tl.load(xs_ptr + (e * rows_per_expert + rows) * stride_xs + kb, mask=ok, other=0.0)
            gate += fp8_block_dot(a, a_s, w_e, s_e, n, kk, kb, mask, n_ok, stride_wn, stride_sn, S_ROWS)
            up += fp8_block_dot(a, a_s, w_e, s_e, inter + n, kk, kb, mask, n_ok, stride_wn, stride_sn, S_ROWS)
        else:
            wg = dequant_tile(w_e, s_e, n, kk, mask, k0, hidden, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
            wu = dequant_tile(w_e, s_e, inter + n, kk, mask, k0, hidden, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
            gate += tl.dot(a, wg.to(a.dtype), input_precision=DOT)
            up += tl.dot(a, wu.to(a.dtype), input_precision=DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + e * stride_he + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _q_masked_down_kernel(h_ptr, hs_ptr, w_ptr, s_ptr, out_ptr, counts_ptr, rows_per_expert, hidden, inter,
                          stride_he, stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_oe,
                          stride_o, INT4: tl.constexpr, A_FP8: tl.constexpr, S_ROWS: tl.constexpr,
                          S_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_M), cdiv(H, BLOCK_N), E)``: ``out[e, r] = h[e, r] @ Wd[e]ᵀ`` for ``r < counts[e]``,
    unweighted (DeepEP's combine applies the routing weights)."""
    e, count, rows, ok = _masked_rows(counts_ptr, rows_per_expert, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    h_rows = h_ptr + e * stride_he + rows[:, None].to(tl.int64) * stride_h
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter
        a = tl.load(h_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        if A_FP8:
            kb = k0 // BLOCK_K
            a_s = tl.load(hs_ptr + (e * rows_per_expert + rows) * stride_hs + kb, mask=ok, other=0.0)
            acc += fp8_block_dot(a, a_s, w_e, s_e, n, kk, kb, mask, n_ok, stride_wn, stride_sn, S_ROWS)
        else:
            w = dequant_tile(w_e, s_e, n, kk, mask, k0, inter, stride_wn, stride_sn, INT4, S_ROWS, S_COLS)
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT)
    tl.store(out_ptr + e * stride_oe + rows[:, None].to(tl.int64) * stride_o + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


def _masked(inp: ExpertInput, w13, s13, w2, s2, int4: bool, s_rows: int, s_cols: int, inter: int,
            a_fp8: bool) -> torch.Tensor:
    """Both GEMMs on DeepEP's packed rows (``inp.packed_counts``); returns ``[E*R, H]``, valid rows only."""
    experts = inp.packed_counts.shape[0]
    flat = inp.hidden
    out = torch.empty_like(flat)
    if experts == 0 or flat.shape[0] == 0:
        return out
    hidden, rows_per_expert = flat.shape[1], flat.shape[0] // experts
    t = default_tiles(rows_per_expert, hidden, inter)
    qdq = a_fp8 and s_cols < 16  # as in _fused
    a_fp8 = a_fp8 and not qdq
    if qdq:
        flat = act_qdq(flat, s_cols)
    a, a_s = act_quant(flat, s_cols) if a_fp8 else (flat.contiguous(), flat)
    w13, s13, w2, s2 = (v.contiguous() for v in (w13, s13, w2, s2))
    counts = inp.packed_counts.to(torch.int32).contiguous()
    h = torch.empty(experts, rows_per_expert, inter, dtype=flat.dtype, device=flat.device)
    x3 = a.view(experts, rows_per_expert, hidden)
    meta = dict(INT4=int4, A_FP8=a_fp8, S_ROWS=s_rows, S_COLS=s_cols, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                BLOCK_K=s_cols if a_fp8 else t.block_k, DOT=dot_precision(flat.dtype), num_warps=t.num_warps)
    m_blocks = triton.cdiv(rows_per_expert, t.block_m)
    _q_masked_gate_up_kernel[(m_blocks, triton.cdiv(inter, t.block_n), experts)](
        x3, a_s, w13, s13, h, counts, rows_per_expert, hidden, inter, x3.stride(0), x3.stride(1), a_s.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), h.stride(1), **meta)
    h2 = h.view(experts * rows_per_expert, inter)
    hq, h_s = act_quant(h2, s_cols) if a_fp8 else (act_qdq(h2, s_cols) if qdq else h2, h2)
    hq3, out3 = hq.view(experts, rows_per_expert, inter), out.view(experts, rows_per_expert, hidden)
    _q_masked_down_kernel[(m_blocks, triton.cdiv(hidden, t.block_n), experts)](
        hq3, h_s, w2, s2, out3, counts, rows_per_expert, hidden, inter, hq3.stride(0), hq3.stride(1), h_s.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out3.stride(0), out3.stride(1), **meta)
    return out


def _fused(inp: ExpertInput, w13, s13, w2, s2, int4: bool, s_rows: int, s_cols: int, inter: int,
           a_fp8: bool = False, invariant: bool = False) -> torch.Tensor:
    """Both GEMMs; ``a_fp8``: W8A8 (activations quantized per token in ``1 × s_cols`` groups before each);
    ``invariant``: :data:`MOE_TILES` for every shape and the ordered combine (``engine.batch_invariant``)."""
    if inp.packed_counts is not None:
        return _masked(inp, w13, s13, w2, s2, int4, s_rows, s_cols, inter, a_fp8)
    x = inp.hidden.contiguous()
    (n, hidden), experts, pairs = x.shape, w13.shape[0], inp.slots.numel()
    if pairs == 0 or experts == 0:
        return x.new_zeros(n, inp.slots.shape[1], hidden) if inp.unsummed else torch.zeros_like(x)
    t = MOE_TILES if invariant else default_tiles(pairs, hidden, inter)
    qdq = a_fp8 and s_cols < 16  # tl.dot needs K >= 16: quantize-dequantize the activations, dequantized weights
    a_fp8 = a_fp8 and not qdq
    if qdq:
        x = act_qdq(x, s_cols)
    block_k = s_cols if a_fp8 else t.block_k
    sorted_ids, expert_ids, num_post = moe_align_block_size(inp.slots, experts, t.block_m)
    w13, s13, w2, s2 = (v.contiguous() for v in (w13, s13, w2, s2))
    a, a_s = act_quant(x, s_cols) if a_fp8 else (x, x)
    h = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(n * inp.slots.shape[1] if invariant else n, hidden, dtype=torch.float32, device=x.device)
    blocks, top_k = expert_ids.numel(), inp.slots.shape[1]
    meta = dict(INT4=int4, A_FP8=a_fp8, S_ROWS=s_rows, S_COLS=s_cols, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                BLOCK_K=block_k, DOT=dot_precision(x.dtype), num_warps=t.num_warps)
    _q_gate_up_kernel[(blocks, triton.cdiv(inter, t.block_n))](
        a, a_s, w13, s13, h, sorted_ids, expert_ids, num_post, pairs, top_k, hidden, inter, a.stride(0),
        a_s.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), **meta)
    weights = inp.weights.reshape(-1).float().contiguous()
    hq, h_s = act_quant(h, s_cols) if a_fp8 else (act_qdq(h, s_cols) if qdq else h, h)
    _q_down_kernel[(blocks, triton.cdiv(hidden, t.block_n))](
        hq, h_s, w2, s2, out, weights, sorted_ids, expert_ids, num_post, pairs, top_k, hidden, inter, hq.stride(0),
        h_s.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0), PER_PAIR=invariant,
        **meta)
    return finish_pairs(out.view(n, top_k, hidden), inp, x.dtype) if invariant else out.to(x.dtype)


def w4a16_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              group_size: int, invariant: bool = False) -> torch.Tensor:
    """Routed experts with INT4 weights → ``[N, H]``; ``invariant``: fixed tiles, ordered combine (:func:`_fused`).
    Reference: :func:`model.quant.reference.w4a16_moe`."""
    return _fused(inp, w13, s13, w2, s2, True, 1, group_size, w13.shape[1] // 2, invariant=invariant)


def w8a16_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              block: tuple[int, int], invariant: bool = False) -> torch.Tensor:
    """Routed experts with FP8 block weights, activations unquantized → ``[N, H]``.
    Reference: :func:`model.quant.reference.w8a16_moe`."""
    return _fused(inp, w13, s13, w2, s2, False, block[0], block[1], w13.shape[1] // 2, invariant=invariant)


def w8a8_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
             block: tuple[int, int], invariant: bool = False) -> torch.Tensor:
    """Routed experts with FP8 block weights and per-token ``1 × block[1]`` FP8 activations before both GEMMs
    (FP8 tensor cores, sm ≥ 89; with ``block[1]`` < 16, too narrow for ``tl.dot``, the activations are quantized
    and dequantized and the weights dequantized in registers: the same definition). Reference:
    :func:`model.quant.reference.w8a8_moe`."""
    return _fused(inp, w13, s13, w2, s2, False, block[0], block[1], w13.shape[1] // 2, a_fp8=True,
                  invariant=invariant)


# the batch-invariant version of each op (``engine.batch_invariant``: model.kernel_select); DeepEP's packed layout
# (``inp.packed_counts``) has none: it keeps its per-expert tiles
INVARIANT = {op: functools.partial(op, invariant=True) for op in (w4a16_moe, w8a16_moe, w8a8_moe)}
