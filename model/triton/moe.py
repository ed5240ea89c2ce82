"""Fused MoE over the locally held experts: a grouped GEMM over tokens sorted by expert, block-aligned.

:func:`moe_align_block_size` (one single-program Triton kernel, no host synchronisation; torch reference
:func:`align_block_size_reference`) sorts the ``(row, choice)`` pairs whose slot is local by expert and pads
each expert's run to a multiple of ``block_m``, so every BLOCK_M block of the sorted order belongs to one
expert. Two kernels then walk those blocks, in grouped order (GROUP_M row blocks sweep the N tiles together,
so an expert's weight tile is read from HBM once and reused from L2 by its neighbouring row blocks):

1. gate_up GEMM with SiLU·mul in the epilogue → intermediate ``[P, I]`` in the sorted order;
2. down GEMM with the routing weight applied in the epilogue, atomically added (fp32) into the output row — or,
   with ``ordered_combine`` (``engine.batch_invariant``), stored to the pair's own row and summed per token in
   top-k order afterwards: atomics add in whatever order the blocks land.

The intermediate stays in sorted order, so no gather or scatter happens between the GEMMs. The number of
blocks is bounded from shapes alone (padding blocks exit at once), which keeps the launch graph-safe. Tiles
come from vLLM-style tables (:mod:`model.triton.launch_tables`, token bucket → tiles), else
:func:`default_tiles`.

Prefill chunks (:data:`PREFILL_TOKENS` rows or more; :func:`moe_path`) sit at or past the ridge point: an
expert has hundreds of rows, and tensor-core efficiency counts more than weight reads. :func:`grouped_moe` runs
both projections as ``F.grouped_mm`` over the expert-sorted rows (the align kernel at block 1 sorts them; an
``index_add_`` combines) where the device has CUTLASS's sm_90+ grouped GEMM (TMA loads of contiguous rows,
wgmma, persistent tile scheduling over all experts in one launch), the weights are bf16 and rows 16-byte
aligned: the sorted kernels gather their A rows by index (no TMA) and, at the 64-row untuned tiles, read each
weight tile once per 64 rows; on an H200 they were no faster than per-expert cuBLAS at 4096 tokens (47 % of the
weight floor). Elsewhere (sm_8x, fp16/fp32) the sorted kernels run with the large :func:`prefill_tiles`. Given
``tiles`` or ``ordered_combine`` (tuning, batch-invariant mode) keep the sorted kernels exactly as asked.

DeepEP's low-latency dispatch already groups rows by expert (``[E_local, R, H]``, expert ``e``'s rows
``[0, counts[e])`` valid): :func:`masked_moe` runs on that layout directly — a masked grouped GEMM, the
shape of DeepGEMM's ``m_grouped_*_masked`` — with no sort, no atomics, and its output in the layout
``low_latency_combine`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model import invariant, kernels
from model.triton.launch_tables import moe_config
from model.triton.precision import dot_precision
from parallelism.dispatch_base import ExpertInput


def _align_size(pairs: int, num_experts: int, block_m: int) -> int:
    """``P``: the padded length for ``pairs`` pairs, from shapes only."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m


def align_block_size_reference(slots: torch.Tensor, num_experts: int,
                               block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`moe_align_block_size` (same contract), ~15 torch ops."""
    flat = slots.reshape(-1)
    pairs, dev = flat.numel(), slots.device
    key = torch.where(flat >= 0, flat, num_experts).long()  # not-local pairs sort last
    counts = kernels.expert_counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    size = _align_size(pairs, num_experts, block_m)
    order = torch.argsort(key, stable=True)
    expert = key[order]
    local = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    rank_in_expert = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[e]
    dest = torch.where(local, ends[e] - padded[e] + rank_in_expert, size)  # not-local pairs: a dropped slot
    sorted_ids = torch.full((size + 1,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.int())
    block_expert = torch.searchsorted(ends, torch.arange(0, size, block_m, device=dev), right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).int()
    return sorted_ids[:size], expert_ids, ends[-1:].int()


@triton.jit
def _align_kernel(slots_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, cursor_ptr, num_pairs, num_experts, block_m,
                  size, E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    """Grid ``(1,)``. Counts per expert (histogram), padded run starts (cumsum), sentinel fill and the expert of
    each block; then the pairs, BLOCK at a time in order, go to ``start[e] + (earlier pairs of e)``: stable.
    ``cursor [E_PAD]`` int32 scratch holds the next free position of each expert between chunks."""
    e = tl.arange(0, E_PAD)
    lane = tl.arange(0, BLOCK)
    counts = tl.zeros([E_PAD], tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        s = tl.load(slots_ptr + p0 + lane, mask=p0 + lane < num_pairs, other=-1)
        local = (s >= 0) & (s < num_experts)
        counts += tl.histogram(tl.where(local, s, 0), E_PAD, mask=local)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, ends - padded)
    tl.store(num_post_ptr, tl.sum(padded, 0))
    for i0 in range(0, size, BLOCK):
        tl.store(sorted_ptr + i0 + lane, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=i0 + lane < size)
    for j0 in range(0, size // block_m, BLOCK_B):
        j = j0 + tl.arange(0, BLOCK_B)
        ex = tl.sum((j[:, None] * block_m >= ends[None, :]).to(tl.int32), axis=1)  # searchsorted(ends, right)
        tl.store(expert_ids_ptr + j, tl.where(ex < num_experts, ex, -1), mask=j < size // block_m)
    tl.debug_barrier()  # the fill and the cursor are visible to every thread before the scatter
    run = ends - padded
    for p0 in range(0, num_pairs, BLOCK):
        s = tl.load(slots_ptr + p0 + lane, mask=p0 + lane < num_pairs, other=-1)
        local = (s >= 0) & (s < num_experts)
        key = tl.where(local, s, -1)
        earlier = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + key, mask=local, other=0)
        tl.store(sorted_ptr + base + rank, (p0 + lane).to(tl.int32), mask=local)
        run += tl.histogram(tl.where(local, s, 0), E_PAD, mask=local)
        tl.debug_barrier()  # every thread has read the old cursor
        tl.store(cursor_ptr + e, run)
        tl.debug_barrier()


def moe_align_block_size(slots: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``slots [N, k]`` int (local expert slot, −1 = not local) → the block-aligned sorted order.

    Returns ``sorted_token_ids [P]`` int32: flat pair ids ``row * k + choice`` grouped by expert (stable
    within an expert), each expert's run padded to a multiple of ``block_m`` with the sentinel ``N * k``;
    ``expert_ids [P // block_m]`` int32, the expert of each block (−1 past the end);
    ``num_tokens_post_padded [1]`` int32, the padded length actually used. ``P = round_up(N*k +
    min(E, N*k) * (block_m - 1), block_m)`` depends on shapes only. One Triton launch (one program);
    reference: :func:`align_block_size_reference`.
    """
    flat = slots.reshape(-1).to(torch.int32).contiguous()
    pairs, dev = flat.numel(), slots.device
    size = _align_size(pairs, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post, cursor, pairs, num_experts, block_m, size,
                        E_PAD=e_pad, BLOCK=128, BLOCK_B=max(16, min(64, 8192 // e_pad)), num_warps=4)
    return sorted_ids, expert_ids, num_post


@triton.jit
def _grouped_pid(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """1-D program id → (row block, N tile), GROUP_M row blocks at a time sweeping every N tile: consecutive
    programs share a weight tile (an expert's row blocks are adjacent in the sorted order), so it is read from
    HBM once and then from L2. GROUP_M = 1 is plain row-major order."""
    pid = tl.program_id(0)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group, (pid % width) // group


@triton.jit
def _block_rows(sorted_ptr, expert_ptr, pid_m, num_pairs, top_k, BLOCK_M: tl.constexpr):
    """One BLOCK_M block of the sorted order: its sorted positions, pair ids, validity, token rows, expert."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    ok = pair < num_pairs
    return rows, pair, ok, pair // top_k, tl.load(expert_ptr + pid_m).to(tl.int64)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs, top_k, hidden, inter,
                    num_blocks, stride_x, stride_we, stride_wn, stride_h,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    DOT: tl.constexpr):
    """Grid ``(P // BLOCK_M * cdiv(I, BLOCK_N),)`` in grouped order: ``h[row] = silu(x[tok] @ Wg[e].T) *
    (x[tok] @ Wu[e].T)`` for the block's rows; ``w [E, 2I, H]`` (gate rows then up rows, last dim contiguous)."""
    pid_m, pid_n = _grouped_pid(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows, pair, ok, tok, e = _block_rows(sorted_ptr, expert_ptr, pid_m, num_pairs, top_k, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_gate = w_ptr + e * stride_we + n[None, :] * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        a = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_x + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate += tl.dot(a, tl.load(w_gate + kk[:, None], mask=w_mask, other=0.0), input_precision=DOT)
        up += tl.dot(a, tl.load(w_gate + inter * stride_wn + kk[:, None], mask=w_mask, other=0.0), input_precision=DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def combine_store(out_ptr, acc, pair, tok, n, mask, stride_out, PER_PAIR: tl.constexpr):
    """A down-GEMM tile ``acc [BLOCK_M, BLOCK_N]`` (fp32, weighted) into ``out``: ``PER_PAIR``: stored to row
    ``pair`` of ``out [N*k, H]`` (summed later by :func:`model.invariant.finish_pairs`), else atomically added to
    row ``tok`` of ``out [N, H]``."""
    if PER_PAIR:
        tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_out + n[None, :], acc, mask=mask)
    else:
        tl.atomic_add(out_ptr + tok[:, None].to(tl.int64) * stride_out + n[None, :], acc, mask=mask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs, top_k,
                 hidden, inter, num_blocks, stride_h, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 DOT: tl.constexpr, PER_PAIR: tl.constexpr = False):
    """Grid ``(P // BLOCK_M * cdiv(H, BLOCK_N),)`` in grouped order: ``out[tok] += weight[pair] * (h[row] @
    Wd[e].T)``; ``w [E, H, I]`` (last dim contiguous), ``out [N, H]`` fp32, ``weight [N*k]`` fp32. ``PER_PAIR``:
    ``out [N*k, H]`` fp32 and ``out[pair] = ...`` (stored, no atomics)."""
    pid_m, pid_n = _grouped_pid(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows, pair, ok, tok, e = _block_rows(sorted_ptr, expert_ptr, pid_m, num_pairs, top_k, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + e * stride_we + n[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc += tl.dot(a, w, input_precision=DOT)
    acc *= tl.load(weight_ptr + pair, mask=ok, other=0.0)[:, None]
    combine_store(out_ptr, acc, pair, tok, n, ok[:, None] & n_ok[None, :], stride_out, PER_PAIR)


@triton.jit
def _masked_rows(counts_ptr, rows_per_expert, BLOCK_M: tl.constexpr):
    """A masked-GEMM program's expert (grid dim 2), that expert's row count, and its BLOCK_M rows (grid dim 0)
    with their validity. Row blocks vary fastest, then N tiles: an expert's row blocks run back to back on
    each weight tile (read once from HBM, then from L2)."""
    e = tl.program_id(2).to(tl.int64)
    count = tl.load(counts_ptr + e)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, count, rows, rows < tl.minimum(count, rows_per_expert)


@triton.jit
def _masked_gate_up_kernel(x_ptr, w_ptr, h_ptr, counts_ptr, rows_per_expert, hidden, inter,
                           stride_xe, stride_x, stride_we, stride_wn, stride_he, stride_h,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_M), cdiv(I, BLOCK_N), E)``: ``h[e, r] = silu(x[e, r] @ Wg[e].T) * (x[e, r] @ Wu[e].T)``
    for ``r < counts[e]``; blocks past the count exit at once. ``x [E, R, H]``, ``w [E, 2I, H]``, ``h [E, R, I]``."""
    e, count, rows, ok = _masked_rows(counts_ptr, rows_per_expert, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    x_rows = x_ptr + e * stride_xe + rows[:, None].to(tl.int64) * stride_x
    w_gate = w_ptr + e * stride_we + n[None, :] * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        a = tl.load(x_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate += tl.dot(a, tl.load(w_gate + kk[:, None], mask=w_mask, other=0.0), input_precision=DOT)
        up += tl.dot(a, tl.load(w_gate + inter * stride_wn + kk[:, None], mask=w_mask, other=0.0), input_precision=DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + e * stride_he + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _masked_down_kernel(h_ptr, w_ptr, out_ptr, counts_ptr, rows_per_expert, hidden, inter,
                        stride_he, stride_h, stride_we, stride_wn, stride_oe, stride_o,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_M), cdiv(H, BLOCK_N), E)``: ``out[e, r] = h[e, r] @ Wd[e].T`` for ``r < counts[e]``
    (unweighted: DeepEP's combine applies the routing weights); ``w [E, H, I]``, ``out [E, R, H]``."""
    e, count, rows, ok = _masked_rows(counts_ptr, rows_per_expert, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    h_rows = h_ptr + e * stride_he + rows[:, None].to(tl.int64) * stride_h
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter
        a = tl.load(h_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + e * stride_we + n[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc += tl.dot(a, w, input_precision=DOT)
    tl.store(out_ptr + e * stride_oe + rows[:, None].to(tl.int64) * stride_o + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MoETiles:
    """Tile sizes of both GEMMs (every dim ≥ 16 for ``tl.dot``), the grouped launch order (GROUP_M row blocks
    per sweep over N; sorted path only) and the launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    group_m: int = 1
    num_stages: int = 3


def default_tiles(num_pairs: int, hidden: int, inter: int) -> MoETiles:
    """Small M blocks when few pairs per expert (decode), 64-row blocks for prefill; N/K capped by the dims;
    prefill sweeps 8 row blocks per group. Untuned (no GPU has timed it)."""
    cap = lambda dim, most: max(16, min(most, triton.next_power_of_2(dim)))
    block_m = 16 if num_pairs <= 1024 else 64
    return MoETiles(block_m, cap(min(hidden, inter), 64), cap(min(hidden, inter), 64), 4 if block_m == 16 else 8,
                    1 if block_m == 16 else 8)


def _device_name(device: torch.device) -> str:
    """vLLM's device part of a config file name (``NVIDIA_H200``); ``default`` off CUDA."""
    return torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "default"


def table_tiles(experts: int, inter: int, hidden: int, tokens: int, device: torch.device) -> MoETiles | None:
    """The tiles of the ``configs/moe`` file for (E, N = I, K = H, this device) at the bucket nearest ``tokens``
    (rows entering the experts), else of its ``device_name=default`` file; None without either."""
    cfg = moe_config(experts, inter, hidden, tokens, _device_name(device))
    if cfg is None:
        return None
    return MoETiles(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"], cfg["num_warps"],
                    cfg["GROUP_SIZE_M"], cfg["num_stages"])


PREFILL_TOKENS = 8192  # rows entering the experts from which fused_moe takes a prefill path (docs/gpu_path.md)
GROUPED_MM_CAPABILITY = (9, 0)  # CUTLASS grouped GEMM (TMA + wgmma) behind F.grouped_mm: sm_90 and newer
PATHS = ("sorted", "grouped_mm", "prefill_tiles")


def prefill_tiles(dtype: torch.dtype) -> MoETiles:
    """The sorted kernels' tiles on the prefill path: 128-row blocks read each weight tile once per 128 rows
    (the default's 64); BLOCK_K 32 for 4-byte operands keeps three stages of the gate_up kernel's three tiles
    within 164 KiB of shared memory (sm_80). Untuned: no GPU has timed them."""
    return MoETiles(128, 128, 64 if dtype.itemsize <= 2 else 32, num_warps=8, group_m=8, num_stages=3)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def moe_path(tokens: int, w_down: torch.Tensor, tiles: MoETiles | None = None, ordered_combine: bool = False,
             capability: tuple[int, int] | None = None) -> str:
    """Which path :func:`fused_moe` runs for ``tokens`` rows (one of :data:`PATHS`; the rule is in the module
    docstring). ``capability`` None: ``w_down``'s device's. Given ``tiles`` or ``ordered_combine`` (tuning,
    batch-invariant mode) always mean the sorted kernels as asked."""
    if tiles is not None or ordered_combine or tokens < PREFILL_TOKENS:
        return "sorted"
    cap = capability if capability is not None else _capability(w_down.device)
    grouped = (cap is not None and cap >= GROUPED_MM_CAPABILITY and w_down.dtype == torch.bfloat16
               and kernels.grouped_gemm_supported(w_down))
    return "grouped_mm" if grouped else "prefill_tiles"


def grouped_moe(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The grouped-GEMM prefill path, :func:`fused_moe`'s contract (``inp.slots`` ``[N, k]``, no packed rows).

    :func:`moe_align_block_size` with ``block_m = 1`` sorts the ``P = N * k`` pairs by expert (stable, no padding,
    not-local pairs last as the sentinel); :func:`model.kernels.grouped_expert_mlp` runs both projections over
    the sorted rows with the routing weight applied to the intermediate; ``index_add_`` sums each pair into its
    row in hidden's dtype, as :func:`model.kernels.local_experts` does, the not-local tail into a spare row that
    is dropped. No host synchronisation; buffers are sized by ``P`` (shapes only), so it is graph-safe."""
    x = inp.hidden.contiguous()
    (n, hidden), (experts, k) = x.shape, (w_gate_up.shape[0], inp.slots.shape[1])
    sorted_ids = moe_align_block_size(inp.slots, experts, 1)[0].long()  # [P] pair ids, sentinel n * k
    tok = sorted_ids // k  # [P] token row; the sentinel → n, the spare row
    weights = torch.cat([inp.weights.reshape(-1).float(), inp.weights.new_zeros(1, dtype=torch.float32)])
    counts = kernels.expert_counts(inp.slots, experts)
    y = kernels.grouped_expert_mlp(x[tok.clamp(max=n - 1)], counts, w_gate_up, w_down, weights[sorted_ids])
    return x.new_zeros(n + 1, hidden).index_add_(0, tok, y)[:n]


def fused_moe(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              tiles: MoETiles | None = None, ordered_combine: bool = False) -> torch.Tensor:
    """Weighted sum over each row's local experts, like ``LocalExperts.forward``.

    ``inp.hidden [N, H]``, ``inp.slots [N, k]`` int (−1 = not local), ``inp.weights [N, k]`` fp32;
    ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]`` in hidden's dtype. Returns ``[N, H]`` in hidden's dtype
    (accumulated in fp32; :func:`grouped_moe` sums a row's pairs in hidden's dtype). ``tiles`` None: from
    :data:`PREFILL_TOKENS` rows the prefill path of :func:`moe_path` (:func:`grouped_moe` or
    :func:`prefill_tiles`), below them :func:`table_tiles`, else :func:`default_tiles`. Reference:
    :func:`model.kernels.local_experts`. Rows in DeepEP's packed layout (``inp.packed_counts`` set)
    go to :func:`masked_moe`. ``ordered_combine``: each pair's output in its own fp32 row, summed per token in
    top-k order (no atomics: the sum order is fixed), or returned unsummed ``[N, k, H]`` fp32 when ``inp.unsummed``.
    """
    if inp.packed_counts is not None:
        e = inp.packed_counts.shape[0]
        return masked_moe(inp.hidden.view(e, -1, inp.hidden.shape[1]), inp.packed_counts, w_gate_up, w_down,
                          tiles).view(inp.hidden.shape)
    x = inp.hidden.contiguous()
    (n, hidden), (experts, two_inter, _) = x.shape, w_gate_up.shape
    inter, pairs = two_inter // 2, inp.slots.numel()
    if pairs == 0 or experts == 0:
        return x.new_zeros(n, inp.slots.shape[1], hidden) if inp.unsummed else torch.zeros_like(x)
    path = moe_path(n, w_down, tiles, ordered_combine)
    if path == "grouped_mm":
        return grouped_moe(inp, w_gate_up, w_down)
    t = prefill_tiles(x.dtype) if path == "prefill_tiles" else (
        tiles or table_tiles(experts, inter, hidden, n, x.device) or default_tiles(pairs, hidden, inter))
    sorted_ids, expert_ids, num_post = moe_align_block_size(inp.slots, experts, t.block_m)
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    h = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    blocks, top_k = expert_ids.numel(), inp.slots.shape[1]
    out = torch.zeros(n * top_k if ordered_combine else n, hidden, dtype=torch.float32, device=x.device)
    tile = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                DOT=dot_precision(x.dtype), num_warps=t.num_warps, num_stages=t.num_stages)
    _gate_up_kernel[(blocks * triton.cdiv(inter, t.block_n),)](
        x, w_gate_up, h, sorted_ids, expert_ids, num_post, pairs, top_k, hidden, inter, blocks,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), **tile)
    weights = inp.weights.reshape(-1).float().contiguous()
    _down_kernel[(blocks * triton.cdiv(hidden, t.block_n),)](
        h, w_down, out, weights, sorted_ids, expert_ids, num_post, pairs, top_k, hidden, inter, blocks,
        h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), PER_PAIR=ordered_combine, **tile)
    return invariant.finish_pairs(out.view(n, top_k, hidden), inp, x.dtype) if ordered_combine else out.to(x.dtype)


def masked_moe(packed: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               tiles: MoETiles | None = None) -> torch.Tensor:
    """Each local expert over its own rows of DeepEP's low-latency layout, unweighted.

    ``packed [E, R, H]`` (expert ``e``'s rows ``[0, counts[e])`` valid, the rest never read), ``counts [E]`` int
    (on the device: no host sync, the grid depends on shapes only, so it is graph-safe), ``w_gate_up [E, 2I, H]``,
    ``w_down [E, H, I]``. Returns ``[E, R, H]`` in packed's dtype: ``down(silu(gate) * up)`` of every valid row;
    rows past the count are left unwritten (unspecified; ``low_latency_combine`` reads valid rows only).
    ``tiles`` None: :func:`default_tiles` (the tables are for the sorted path). Reference:
    :func:`model.kernels.local_experts` on :func:`parallelism.deepep.packed_to_expert_input`.
    """
    (experts, rows_per_expert, hidden), inter = packed.shape, w_gate_up.shape[1] // 2
    out = torch.empty_like(packed)
    if experts == 0 or rows_per_expert == 0:
        return out
    t = tiles or default_tiles(rows_per_expert, hidden, inter)
    packed, w_gate_up, w_down = packed.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    counts = counts.to(torch.int32).contiguous()
    h = torch.empty(experts, rows_per_expert, inter, dtype=packed.dtype, device=packed.device)
    tile = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT=dot_precision(packed.dtype),
                num_warps=t.num_warps, num_stages=t.num_stages)
    m_blocks = triton.cdiv(rows_per_expert, t.block_m)
    _masked_gate_up_kernel[(m_blocks, triton.cdiv(inter, t.block_n), experts)](
        packed, w_gate_up, h, counts, rows_per_expert, hidden, inter, packed.stride(0), packed.stride(1),
        w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), h.stride(1), **tile)
    _masked_down_kernel[(m_blocks, triton.cdiv(hidden, t.block_n), experts)](
        h, w_down, out, counts, rows_per_expert, hidden, inter, h.stride(0), h.stride(1), w_down.stride(0),
        w_down.stride(1), out.stride(0), out.stride(1), **tile)
    return out
