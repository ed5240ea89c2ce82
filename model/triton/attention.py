"""Paged attention for decode and tree verify, GQA and MLA in absorbed form, as Triton kernels.

Cache layout and ``context_lens`` as in :mod:`model.kernels` (flat ``[num_slots, ...]`` caches, block
tables, lengths that include this step's tokens). One kernel per attention kind serves both step kinds:
decode is N = 1 with no tree mask; tree verify has N nodes that see every earlier key and, among the last N
keys, the ones the ancestor mask allows.

Each program owns one sequence and a block of query rows (GQA: the rows of one KV head's group, node-major;
MLA: node × head rows, all heads sharing the single latent "KV head"), streams BLOCK_N-key tiles through an
online softmax, and reads K/V through the block table one key at a time, so any block size works. With
``num_splits > 1`` (flash-decoding) split s takes key tiles s, s + S, s + 2S, …; the partial outputs and
their log-sum-exps are merged in torch. Everything has fixed shapes: no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.tree_mask import resolve_tree_mask
from model.triton.precision import dot_precision


@triton.jit
def _key_tile(bt_ptr, kb, kv_len, block_size, BLOCK_N: tl.constexpr):
    """Key tile ``kb`` of one sequence (``bt_ptr`` at its block-table row): positions, validity, int64 slots."""
    pos = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = pos < kv_len
    block = tl.load(bt_ptr + pos // block_size, mask=ok, other=0)
    return pos, ok, block.to(tl.int64) * block_size + pos % block_size


@triton.jit
def _visible(node, row_ok, pos, key_ok, kv_len, mask_ptr, N: tl.constexpr, HAS_TREE: tl.constexpr):
    """``[BLOCK_R, BLOCK_N]`` bool: earlier keys always; tree key j = pos - (kv_len - N) where
    ``mask_ptr[node, j]`` (the sequence's ``[N, N]`` int8 mask) is set."""
    vis = row_ok[:, None] & key_ok[None, :]
    if HAS_TREE:
        j = pos - (kv_len - N)
        in_tree = j >= 0
        anc = tl.load(mask_ptr + node[:, None] * N + j[None, :], mask=vis & in_tree[None, :], other=0)
        vis = vis & ((j < 0)[None, :] | (anc != 0))
    return vis


@triton.jit
def _softmax_step(s, vis, m_i, l_i):
    """Online softmax over scaled scores ``s [R, BLOCK_N]``: (probabilities, new max, new sum, rescale)."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), alpha


@triton.jit
def _store_rows(o_ptr, lse_ptr, out_row, col, ncol, row_ok, acc, m_i, l_i, NUM_SPLITS: tl.constexpr):
    """Normalised rows into ``o [..., ncol]`` (row index ``out_row``); with splits also their log-sum-exp."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + out_row[:, None].to(tl.int64) * ncol + col[None, :], out,
             mask=row_ok[:, None] & (col < ncol)[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        tl.store(lse_ptr + out_row, lse, mask=row_ok)


@triton.jit
def _gqa_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, lens_ptr, mask_ptr,
                scale, block_size, num_heads, stride_qb, stride_qn, stride_qh,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                N: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_TREE: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(B, KVH * cdiv(N*G, BLOCK_R), NUM_SPLITS)``; row r of a KV head = node ``r // G``, head
    ``kvh*G + r % G``. Output row ``((split*B + b)*N + node)*num_heads + head`` of ``o [S, B, N, H, D]``."""
    b, split = tl.program_id(0), tl.program_id(2)
    row_blocks = tl.cdiv(N * G, BLOCK_R)
    kvh, rb = tl.program_id(1) // row_blocks, tl.program_id(1) % row_blocks
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < N * G
    node, head = r // G, kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + node[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kv_len = tl.load(lens_ptr + b)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for kb in range(split, tl.cdiv(kv_len, BLOCK_N), NUM_SPLITS):
        pos, key_ok, slot = _key_tile(bt_ptr + b * stride_bt, kb, kv_len, block_size, BLOCK_N)
        kv_ok = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
        vis = _visible(node, row_ok, pos, key_ok, kv_len, mask_ptr + b * N * N, N, HAS_TREE)
        p, m_i, l_i, alpha = _softmax_step(s, vis, m_i, l_i)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
    out_row = ((split * tl.num_programs(0) + b) * N + node) * num_heads + head
    _store_rows(o_ptr, lse_ptr, out_row, d, D, row_ok, acc, m_i, l_i, NUM_SPLITS)


@triton.jit
def _mla_kernel(ql_ptr, qr_ptr, lat_ptr, rope_ptr, o_ptr, lse_ptr, bt_ptr, lens_ptr, mask_ptr,
                scale, block_size, stride_qlb, stride_qln, stride_qlh, stride_qrb, stride_qrn, stride_qrh,
                stride_lat, stride_rope, stride_bt,
                N: tl.constexpr, H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_L: tl.constexpr, BLOCK_RD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                HAS_TREE: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(B, cdiv(N*H, BLOCK_R), NUM_SPLITS)``; row r = node ``r // H``, head ``r % H``. The latent tile
    is loaded once and serves as key (with the rope key) and as value. Output ``o [S, B, N, H, L]``."""
    b, rb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < N * H
    node, head = r // H, r % H
    c, e = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_RD)
    c_ok, e_ok = c < L, e < R
    q_lat = tl.load(ql_ptr + b * stride_qlb + node[:, None] * stride_qln + head[:, None] * stride_qlh + c[None, :],
                    mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_pe = tl.load(qr_ptr + b * stride_qrb + node[:, None] * stride_qrn + head[:, None] * stride_qrh + e[None, :],
                   mask=row_ok[:, None] & e_ok[None, :], other=0.0)
    kv_len = tl.load(lens_ptr + b)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_L], tl.float32)
    for kb in range(split, tl.cdiv(kv_len, BLOCK_N), NUM_SPLITS):
        pos, key_ok, slot = _key_tile(bt_ptr + b * stride_bt, kb, kv_len, block_size, BLOCK_N)
        lat = tl.load(lat_ptr + slot[:, None] * stride_lat + c[None, :], mask=key_ok[:, None] & c_ok[None, :],
                      other=0.0)
        rope = tl.load(rope_ptr + slot[:, None] * stride_rope + e[None, :], mask=key_ok[:, None] & e_ok[None, :],
                       other=0.0)
        s = (tl.dot(q_lat, tl.trans(lat), input_precision=DOT)
             + tl.dot(q_pe, tl.trans(rope), input_precision=DOT)) * scale
        vis = _visible(node, row_ok, pos, key_ok, kv_len, mask_ptr + b * N * N, N, HAS_TREE)
        p, m_i, l_i, alpha = _softmax_step(s, vis, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT)
    out_row = ((split * tl.num_programs(0) + b) * N + node) * H + head
    _store_rows(o_ptr, lse_ptr, out_row, c, L, row_ok, acc, m_i, l_i, NUM_SPLITS)


def _pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two ≥ n and ≥ floor (``tl.dot`` wants every dim ≥ 16)."""
    return max(floor, triton.next_power_of_2(n))


def gqa_meta(n: int, groups: int, head_dim: int, has_tree: bool, dtype: torch.dtype) -> dict:
    """Compile-time parameters of :func:`_gqa_kernel` but NUM_SPLITS (shared with :mod:`model.triton.aot`)."""
    return dict(N=n, G=groups, D=head_dim, BLOCK_R=min(64, _pow2(n * groups)), BLOCK_D=_pow2(head_dim),
                BLOCK_N=64 if head_dim <= 128 else 32, HAS_TREE=has_tree, DOT=dot_precision(dtype))


def mla_meta(n: int, heads: int, latent: int, rope: int, has_tree: bool, dtype: torch.dtype) -> dict:
    """Compile-time parameters of :func:`_mla_kernel` but NUM_SPLITS (shared with :mod:`model.triton.aot`)."""
    return dict(N=n, H=heads, L=latent, R=rope, BLOCK_R=min(32, _pow2(n * heads)), BLOCK_L=_pow2(latent),
                BLOCK_RD=_pow2(rope), BLOCK_N=32 if latent <= 512 else 16, HAS_TREE=has_tree,
                DOT=dot_precision(dtype))


def default_num_splits(programs: int, block_tables: torch.Tensor, block_size: int, block_n: int) -> int:
    """Split the keys only when the batch alone leaves SMs idle: about two programs per SM, at most 16 splits
    and never more splits than key tiles a sequence can have. 1 off CUDA."""
    if block_tables.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(block_tables.device).multi_processor_count
    max_tiles = triton.cdiv(block_tables.shape[1] * block_size, block_n)
    return max(1, min(16, triton.cdiv(2 * sms, max(programs, 1)), max_tiles))


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1; other strides are passed through."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _outputs(q: torch.Tensor, num_splits: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``o [S, *shape]`` (q's dtype when S = 1, else fp32 partials) and ``lse [S, *shape[:-1]]`` fp32."""
    dtype = q.dtype if num_splits == 1 else torch.float32
    o = torch.empty(num_splits, *shape, dtype=dtype, device=q.device)
    return o, torch.empty(num_splits, *shape[:-1], dtype=torch.float32, device=q.device)


def _merge_splits(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``o [S, ..., Dv]`` normalised partials, ``lse [S, ...]`` → ``[..., Dv]`` (S = 1: the output itself)."""
    if o.shape[0] == 1:
        return o[0]
    w = torch.softmax(lse, dim=0)  # splits that saw no key have lse = -inf and weight 0
    return (w[..., None] * o).sum(dim=0).to(dtype)


def _mask_arg(tree_mask, parents, q: torch.Tensor) -> torch.Tensor:
    """The kernel's int8 ``[B, N, N]`` mask, or a 1-element dummy for decode."""
    if tree_mask is None and parents is None:
        return torch.zeros(1, dtype=torch.int8, device=q.device)
    return resolve_tree_mask(tree_mask, parents).to(device=q.device, dtype=torch.int8).contiguous()


def _gqa(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, mask, num_splits):
    """``q [B, N, H, D]`` → ``[B, N, H, D]``; ``mask`` int8 ``[B, N, N]`` or a dummy (decode)."""
    b, n, h, d = q.shape
    kvh = k_cache.shape[1]
    q, k_cache, v_cache = (_rows_last_contiguous(t) for t in (q, k_cache, v_cache))
    meta = gqa_meta(n, h // kvh, d, mask.dim() == 3, q.dtype)
    grid_rows = kvh * triton.cdiv(n * (h // kvh), meta["BLOCK_R"])
    splits = num_splits or default_num_splits(b * grid_rows, block_tables, block_size, meta["BLOCK_N"])
    o, lse = _outputs(q, splits, (b, n, h, d))
    _gqa_kernel[(b, grid_rows, splits)](
        q, k_cache, v_cache, o, lse, block_tables, context_lens, mask, scale, block_size, h,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), **meta, NUM_SPLITS=splits, num_warps=4)
    return _merge_splits(o, lse, q.dtype)


def _mla(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale, mask, num_splits):
    """``q_lat [B, N, H, L]``, ``q_pe [B, N, H, R]`` → ``[B, N, H, L]``; ``mask`` as :func:`_gqa`."""
    b, n, h, lat = q_lat.shape
    q_lat, q_pe, latent_cache, rope_cache = (_rows_last_contiguous(t)
                                             for t in (q_lat, q_pe, latent_cache, rope_cache))
    meta = mla_meta(n, h, lat, q_pe.shape[-1], mask.dim() == 3, q_lat.dtype)
    grid_rows = triton.cdiv(n * h, meta["BLOCK_R"])
    splits = num_splits or default_num_splits(b * grid_rows, block_tables, block_size, meta["BLOCK_N"])
    o, lse = _outputs(q_lat, splits, (b, n, h, lat))
    _mla_kernel[(b, grid_rows, splits)](
        q_lat, q_pe, latent_cache, rope_cache, o, lse, block_tables, context_lens, mask, scale, block_size,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        latent_cache.stride(0), rope_cache.stride(0), block_tables.stride(0), **meta, NUM_SPLITS=splits,
        num_warps=4)
    return _merge_splits(o, lse, q_lat.dtype)


def paged_decode_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """Decode GQA. ``q [B, H, D]``; ``k_cache, v_cache [num_slots, KVH, D]`` (same dtype as q, H % KVH == 0);
    ``block_tables [B, max_blocks]`` int32/int64; ``context_lens [B]`` int32/int64, ≥ 1. Returns ``[B, H, D]``
    in q's dtype. ``num_splits`` None = :func:`default_num_splits`. Reference:
    :func:`model.kernels.paged_decode_gqa`."""
    mask = _mask_arg(None, None, q)
    return _gqa(q[:, None], k_cache, v_cache, block_tables, context_lens, block_size, scale, mask, num_splits)[:, 0]


def paged_decode_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """Decode MLA, absorbed. ``q_lat [B, H, L]``, ``q_pe [B, H, R]``; ``latent_cache [num_slots, L]``,
    ``rope_cache [num_slots, R]``; tables and lengths as :func:`paged_decode_gqa`. Returns ``[B, H, L]``
    (latent space: the caller applies ``W_uv``). Reference: :func:`model.kernels.paged_decode_mla`."""
    mask = _mask_arg(None, None, q_lat)
    return _mla(q_lat[:, None], q_pe[:, None], latent_cache, rope_cache, block_tables, context_lens, block_size,
                scale, mask, num_splits)[:, 0]


def tree_verify_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, scale: float, tree_mask: torch.Tensor | None = None,
                    parents: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Tree verify GQA. ``q [B, N, H, D]``: the N nodes are the last N of the ``context_lens[b]`` cached keys;
    give ``tree_mask [B, N, N]`` bool (True = node i sees tree node j) or ``parents [B, N]`` (−1 = root;
    ancestors and self). Returns ``[B, N, H, D]``. Reference: :func:`model.kernels.tree_verify_gqa`."""
    mask = _mask_arg(tree_mask, parents, q)
    return _gqa(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, mask, num_splits)


def tree_verify_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                    tree_mask: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Tree verify MLA, absorbed. ``q_lat [B, N, H, L]``, ``q_pe [B, N, H, R]``; caches as
    :func:`paged_decode_mla`, mask as :func:`tree_verify_gqa`. Returns ``[B, N, H, L]``. Reference:
    :func:`model.kernels.tree_verify_mla`."""
    mask = _mask_arg(tree_mask, parents, q_lat)
    return _mla(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale, mask,
                num_splits)
