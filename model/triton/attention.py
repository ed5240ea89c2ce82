"""Paged attention for decode and tree verify, GQA and MLA in absorbed form, as Triton kernels.

Cache layout and ``context_lens`` as in :mod:`model.kernels` (flat ``[num_slots, ...]`` caches, block
tables, lengths that include this step's tokens). One kernel per attention kind serves both step kinds:
decode is N = 1 with no tree mask; tree verify has N nodes that see every earlier key and, among the last N
keys, the ones the ancestor mask allows.

Each program owns one sequence, a block of query rows (GQA: the rows of one KV head's group, node-major;
MLA: node × head rows, all heads sharing the single latent "KV head") and one split: the keys
``[s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS)``. A sequence of context c uses ``cdiv(c, SPLIT_KEYS)`` splits —
a function of its own length and a constant, never of the batch — and the grid's split dimension is
``cdiv(max_blocks * block_size, SPLIT_KEYS)`` (the block table's width, set by max_model_len), so shapes
are graph-safe; programs past a sequence's own splits write lse = −inf and exit. Key tiles of BLOCK_N keys
span whole KV blocks: one block-table lookup per KV block. Partials are merged by :func:`_merge_kernel`
over a row's splits in order. Reasoning and the SPLIT_KEYS arithmetic: docs/gpu_path.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.tree_mask import resolve_tree_mask
from model.triton.launch_tables import NO_ENTRY, attention_config
from model.triton.precision import dot_precision

# Keys per split. 131072 keys / 256 = 512 splits: at batch 1 an MLA rank with ≤ 32 heads (one row block)
# launches 512 programs = 3.9 per SM of an H200's 132 (≥ 2 needs ≤ 496 keys per split); GQA with 8 KV heads
# 4096. A multiple of every BLOCK_N and of the KV block sizes used (16, 64, 256).
SPLIT_KEYS = 256


@triton.jit
def _key_tile(bt_ptr, kb, kv_len, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tile ``kb`` of one sequence (``bt_ptr`` at its block-table row): positions, validity, int64 slots.
    One block-table load per KV block the tile spans (BLOCK_N and BLOCK_SIZE are powers of two)."""
    NB: tl.constexpr = BLOCK_N // BLOCK_SIZE if BLOCK_N > BLOCK_SIZE else 1  # KV blocks per tile
    KPB: tl.constexpr = BLOCK_N // NB  # keys per KV block in the tile
    first = kb * BLOCK_N
    entry = first // BLOCK_SIZE + tl.arange(0, NB)
    block = tl.load(bt_ptr + entry, mask=entry * BLOCK_SIZE < kv_len, other=0).to(tl.int64)
    slot = tl.reshape(block[:, None] * BLOCK_SIZE + (first % BLOCK_SIZE + tl.arange(0, KPB))[None, :], [BLOCK_N])
    pos = first + tl.arange(0, BLOCK_N)
    return pos, pos < kv_len, slot


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
def _split_tiles(split, kv_len, SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles ``[first, last)`` of split ``split`` of a ``kv_len``-key sequence (empty past its end)."""
    first = split * (SPLIT_KEYS // BLOCK_N)
    return first, tl.minimum(tl.cdiv(kv_len, BLOCK_N), first + SPLIT_KEYS // BLOCK_N)


@triton.jit
def _store_rows(o_ptr, lse_ptr, out_row, col, ncol, row_ok, acc, m_i, l_i, SPLIT_OUT: tl.constexpr):
    """Normalised rows into ``o [..., ncol]`` (row index ``out_row``); with SPLIT_OUT also their log-sum-exp."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + out_row[:, None].to(tl.int64) * ncol + col[None, :], out,
             mask=row_ok[:, None] & (col < ncol)[None, :])
    if SPLIT_OUT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        tl.store(lse_ptr + out_row, lse, mask=row_ok)


@triton.jit
def _gqa_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, lens_ptr, mask_ptr,
                scale, num_heads, stride_qb, stride_qn, stride_qh,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                N: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                SPLIT_OUT: tl.constexpr, HAS_TREE: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(B, KVH * cdiv(N*G, BLOCK_R), splits)``; row r of a KV head = node ``r // G``, head
    ``kvh*G + r % G``. Output row ``((split*B + b)*N + node)*num_heads + head`` of ``o [S, B, N, H, D]``."""
    b, split = tl.program_id(0), tl.program_id(2)
    row_blocks = tl.cdiv(N * G, BLOCK_R)
    kvh, rb = tl.program_id(1) // row_blocks, tl.program_id(1) % row_blocks
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < N * G
    node, head = r // G, kvh * G + r % G
    out_row = ((split * tl.num_programs(0) + b) * N + node) * num_heads + head
    kv_len = tl.load(lens_ptr + b)
    if split * SPLIT_KEYS >= kv_len:  # past this sequence's splits: no keys, weight 0 in the merge
        tl.store(lse_ptr + out_row, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=row_ok)
        return
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + node[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    first, last = _split_tiles(split, kv_len, SPLIT_KEYS, BLOCK_N)
    for kb in range(first, last):
        pos, key_ok, slot = _key_tile(bt_ptr + b * stride_bt, kb, kv_len, BLOCK_SIZE, BLOCK_N)
        kv_ok = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
        vis = _visible(node, row_ok, pos, key_ok, kv_len, mask_ptr + b * N * N, N, HAS_TREE)
        p, m_i, l_i, alpha = _softmax_step(s, vis, m_i, l_i)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
    _store_rows(o_ptr, lse_ptr, out_row, d, D, row_ok, acc, m_i, l_i, SPLIT_OUT)


@triton.jit
def _mla_kernel(ql_ptr, qr_ptr, lat_ptr, rope_ptr, o_ptr, lse_ptr, bt_ptr, lens_ptr, mask_ptr,
                scale, stride_qlb, stride_qln, stride_qlh, stride_qrb, stride_qrn, stride_qrh,
                stride_lat, stride_rope, stride_bt,
                N: tl.constexpr, H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_L: tl.constexpr, BLOCK_RD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                SPLIT_KEYS: tl.constexpr, SPLIT_OUT: tl.constexpr, HAS_TREE: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(B, cdiv(N*H, BLOCK_R), splits)``; row r = node ``r // H``, head ``r % H``. The latent tile
    is loaded once and serves as key (with the rope key) and as value. Output ``o [S, B, N, H, L]``."""
    b, rb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < N * H
    node, head = r // H, r % H
    out_row = ((split * tl.num_programs(0) + b) * N + node) * H + head
    kv_len = tl.load(lens_ptr + b)
    if split * SPLIT_KEYS >= kv_len:
        tl.store(lse_ptr + out_row, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=row_ok)
        return
    c, e = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_RD)
    c_ok, e_ok = c < L, e < R
    q_lat = tl.load(ql_ptr + b * stride_qlb + node[:, None] * stride_qln + head[:, None] * stride_qlh + c[None, :],
                    mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_pe = tl.load(qr_ptr + b * stride_qrb + node[:, None] * stride_qrn + head[:, None] * stride_qrh + e[None, :],
                   mask=row_ok[:, None] & e_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_L], tl.float32)
    first, last = _split_tiles(split, kv_len, SPLIT_KEYS, BLOCK_N)
    for kb in range(first, last):
        pos, key_ok, slot = _key_tile(bt_ptr + b * stride_bt, kb, kv_len, BLOCK_SIZE, BLOCK_N)
        lat = tl.load(lat_ptr + slot[:, None] * stride_lat + c[None, :], mask=key_ok[:, None] & c_ok[None, :],
                      other=0.0)
        rope = tl.load(rope_ptr + slot[:, None] * stride_rope + e[None, :], mask=key_ok[:, None] & e_ok[None, :],
                       other=0.0)
        s = (tl.dot(q_lat, tl.trans(lat), input_precision=DOT)
             + tl.dot(q_pe, tl.trans(rope), input_precision=DOT)) * scale
        vis = _visible(node, row_ok, pos, key_ok, kv_len, mask_ptr + b * N * N, N, HAS_TREE)
        p, m_i, l_i, alpha = _softmax_step(s, vis, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT)
    _store_rows(o_ptr, lse_ptr, out_row, c, L, row_ok, acc, m_i, l_i, SPLIT_OUT)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, lens_ptr, rows, ncol,
                  SPLIT_KEYS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid ``(B, cdiv(rows, BLOCK_R))``: ``out [B, rows, ncol]`` = the lse-weighted mean of the partials
    ``o [S, B, rows, ncol]`` (fp32, normalised) over the sequence's own ``cdiv(len, SPLIT_KEYS)`` splits,
    summed in split order (fixed, so a row's result does not depend on the batch)."""
    b, batch = tl.program_id(0), tl.num_programs(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < rows
    ok = r_ok[:, None] & (d < ncol)[None, :]
    splits = tl.cdiv(tl.load(lens_ptr + b), SPLIT_KEYS)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(lse_ptr + (s * batch + b) * rows + r, mask=r_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, splits):
        row = (s * batch + b) * rows + r
        w = tl.exp(tl.load(lse_ptr + row, mask=r_ok, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(o_ptr + row[:, None].to(tl.int64) * ncol + d[None, :], mask=ok, other=0.0)
        den += w
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + (b * rows + r)[:, None].to(tl.int64) * ncol + d[None, :],
             (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


def _pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two ≥ n and ≥ floor (``tl.dot`` wants every dim ≥ 16)."""
    return max(floor, triton.next_power_of_2(n))


def launch_config(kernel: str, q_heads_per_kv: int, head_dim: int) -> dict:
    """``BLOCK_N, BLOCK_R, num_warps, num_stages, source`` of one attention kernel at one shape: the entry of
    ``configs/attention.json``, else the rule below (BLOCK_N 64 for GQA D ≤ 128 else 32; MLA 32 for a
    latent ≤ 512 else 16; BLOCK_R 64 GQA / 32 MLA; 4 warps, 2 stages). Shapes only: never the batch."""
    entry = attention_config(kernel, q_heads_per_kv, head_dim)
    if entry is not None:
        return {k: entry[k] for k in ("BLOCK_N", "BLOCK_R", "num_warps", "num_stages", "source")}
    if kernel.startswith("gqa"):
        return dict(BLOCK_N=64 if head_dim <= 128 else 32, BLOCK_R=64, num_warps=4, num_stages=2, source=NO_ENTRY)
    return dict(BLOCK_N=32 if head_dim <= 512 + 64 else 16, BLOCK_R=32, num_warps=4, num_stages=2, source=NO_ENTRY)


def gqa_meta(n: int, groups: int, head_dim: int, has_tree: bool, dtype: torch.dtype, block_size: int,
             config: dict | None = None) -> dict:
    """Constexprs of :func:`_gqa_kernel` but SPLIT_OUT, plus ``num_warps``/``num_stages`` (shared with
    :mod:`model.triton.aot`); ``config`` (``BLOCK_N, BLOCK_R, num_warps, num_stages``) overrides the table
    (``scripts/tune_attention.py``)."""
    cfg = config or launch_config("gqa_tree" if has_tree else "gqa_decode", groups, head_dim)
    return dict(N=n, G=groups, D=head_dim, BLOCK_R=min(cfg["BLOCK_R"], _pow2(n * groups)), BLOCK_D=_pow2(head_dim),
                BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=block_size, SPLIT_KEYS=SPLIT_KEYS, HAS_TREE=has_tree,
                DOT=dot_precision(dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def mla_meta(n: int, heads: int, latent: int, rope: int, has_tree: bool, dtype: torch.dtype, block_size: int,
             config: dict | None = None) -> dict:
    """Constexprs of :func:`_mla_kernel` but SPLIT_OUT, plus ``num_warps``/``num_stages`` (as :func:`gqa_meta`)."""
    cfg = config or launch_config("mla_tree" if has_tree else "mla_decode", heads, latent + rope)
    return dict(N=n, H=heads, L=latent, R=rope, BLOCK_R=min(cfg["BLOCK_R"], _pow2(n * heads)), BLOCK_L=_pow2(latent),
                BLOCK_RD=_pow2(rope), BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=block_size, SPLIT_KEYS=SPLIT_KEYS,
                HAS_TREE=has_tree, DOT=dot_precision(dtype), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])


def merge_meta(rows: int, ncol: int) -> dict:
    """Constexprs and launch options of :func:`_merge_kernel` for ``rows`` query rows of ``ncol`` values."""
    block_d = _pow2(ncol)
    return dict(SPLIT_KEYS=SPLIT_KEYS, BLOCK_R=max(1, min(16, 4096 // block_d, triton.next_power_of_2(rows))),
                BLOCK_D=block_d, num_warps=4, num_stages=2)


def split_grid(block_tables: torch.Tensor, block_size: int, split_keys: int = SPLIT_KEYS) -> int:
    """The grid's split dimension: enough splits for the longest context the block table can hold (its width
    comes from max_model_len), so it is fixed per configuration and never depends on the batch."""
    return triton.cdiv(block_tables.shape[1] * block_size, split_keys)


def splits_per_sequence(context_lens: torch.Tensor, split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """``[B]`` splits each sequence uses: ``cdiv(context_lens[b], SPLIT_KEYS)`` (what the kernels compute)."""
    return (context_lens.long() + split_keys - 1) // split_keys


def _check_block_size(block_size: int, split_keys: int) -> None:
    """Tiles span whole KV blocks (power-of-two sizes); a split covers whole tiles."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two (whole-block key tiles), got {block_size}")
    if split_keys < 64 or split_keys & (split_keys - 1):
        raise ValueError(f"split_keys must be a power of two ≥ 64 (a multiple of every BLOCK_N), got {split_keys}")


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1; other strides are passed through."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(kernel, meta: dict, grid_rows: int, shape: tuple[int, ...], dtype: torch.dtype, context_lens: torch.Tensor,
            splits: int, inputs: tuple, rest: tuple) -> torch.Tensor:
    """``kernel(*inputs, o, lse, *rest)`` over ``(B, grid_rows, splits)``, then the merge: ``shape = (B, N, H, Dv)``
    → that, in ``dtype``. One split in the grid (short max_model_len): the kernel writes the output itself."""
    meta = dict(meta)
    if meta["SPLIT_KEYS"] % meta["BLOCK_N"]:
        raise ValueError(f"SPLIT_KEYS {meta['SPLIT_KEYS']} is not a multiple of BLOCK_N {meta['BLOCK_N']}")
    launch = dict(num_warps=meta.pop("num_warps"), num_stages=meta.pop("num_stages"))
    b, rows, ncol = shape[0], shape[1] * shape[2], shape[3]
    device = context_lens.device
    out = torch.empty(shape, dtype=dtype, device=device)
    lse = torch.empty(splits, *shape[:-1], dtype=torch.float32, device=device)
    if splits == 1:
        kernel[(b, grid_rows, 1)](*inputs, out, lse, *rest, **meta, SPLIT_OUT=False, **launch)
        return out
    part = torch.empty(splits, *shape, dtype=torch.float32, device=device)
    kernel[(b, grid_rows, splits)](*inputs, part, lse, *rest, **meta, SPLIT_OUT=True, **launch)
    mm = dict(merge_meta(rows, ncol), SPLIT_KEYS=meta["SPLIT_KEYS"])
    _merge_kernel[(b, triton.cdiv(rows, mm["BLOCK_R"]))](part, lse, out, context_lens, rows, ncol, **mm)
    return out


def _mask_arg(tree_mask, parents, q: torch.Tensor) -> torch.Tensor:
    """The kernel's int8 ``[B, N, N]`` mask, or a 1-element dummy for decode."""
    if tree_mask is None and parents is None:
        return torch.zeros(1, dtype=torch.int8, device=q.device)
    return resolve_tree_mask(tree_mask, parents).to(device=q.device, dtype=torch.int8).contiguous()


def _gqa(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, mask, split_keys, config=None):
    """``q [B, N, H, D]`` → ``[B, N, H, D]``; ``mask`` int8 ``[B, N, N]`` or a dummy (decode); ``config`` as
    :func:`gqa_meta`."""
    _check_block_size(block_size, split_keys)
    b, n, h, d = q.shape
    kvh = k_cache.shape[1]
    q, k_cache, v_cache = (_rows_last_contiguous(t) for t in (q, k_cache, v_cache))
    meta = dict(gqa_meta(n, h // kvh, d, mask.dim() == 3, q.dtype, block_size, config), SPLIT_KEYS=split_keys)
    grid_rows = kvh * triton.cdiv(n * (h // kvh), meta["BLOCK_R"])
    rest = (block_tables, context_lens, mask, scale, h, q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_tables.stride(0))
    return _launch(_gqa_kernel, meta, grid_rows, (b, n, h, d), q.dtype, context_lens,
                   split_grid(block_tables, block_size, split_keys), (q, k_cache, v_cache), rest)


def _mla(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale, mask, split_keys,
         config=None):
    """``q_lat [B, N, H, L]``, ``q_pe [B, N, H, R]`` → ``[B, N, H, L]``; ``mask`` and ``config`` as :func:`_gqa`."""
    _check_block_size(block_size, split_keys)
    b, n, h, lat = q_lat.shape
    q_lat, q_pe, latent_cache, rope_cache = (_rows_last_contiguous(t)
                                             for t in (q_lat, q_pe, latent_cache, rope_cache))
    meta = dict(mla_meta(n, h, lat, q_pe.shape[-1], mask.dim() == 3, q_lat.dtype, block_size, config),
                SPLIT_KEYS=split_keys)
    rest = (block_tables, context_lens, mask, scale, q_lat.stride(0), q_lat.stride(1), q_lat.stride(2),
            q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), latent_cache.stride(0), rope_cache.stride(0),
            block_tables.stride(0))
    return _launch(_mla_kernel, meta, triton.cdiv(n * h, meta["BLOCK_R"]), (b, n, h, lat), q_lat.dtype, context_lens,
                   split_grid(block_tables, block_size, split_keys), (q_lat, q_pe, latent_cache, rope_cache), rest)


def paged_decode_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float,
                     split_keys: int = SPLIT_KEYS, config: dict | None = None) -> torch.Tensor:
    """Decode GQA. ``q [B, H, D]``; ``k_cache, v_cache [num_slots, KVH, D]`` (same dtype as q, H % KVH == 0);
    ``block_tables [B, max_blocks]`` int32/int64; ``context_lens [B]`` int32/int64, ≥ 1; ``block_size`` a power
    of two. Returns ``[B, H, D]`` in q's dtype. ``split_keys``: keys per split, a deployment constant (tests
    lower it); never derive it from the batch. ``config``: a launch config overriding the table (tuning only:
    :func:`gqa_meta`). Reference: :func:`model.kernels.paged_decode_gqa`."""
    mask = _mask_arg(None, None, q)
    return _gqa(q[:, None], k_cache, v_cache, block_tables, context_lens, block_size, scale, mask, split_keys,
                config)[:, 0]


def paged_decode_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                     split_keys: int = SPLIT_KEYS, config: dict | None = None) -> torch.Tensor:
    """Decode MLA, absorbed. ``q_lat [B, H, L]``, ``q_pe [B, H, R]``; ``latent_cache [num_slots, L]``,
    ``rope_cache [num_slots, R]``; tables, lengths, ``split_keys`` and ``config`` as :func:`paged_decode_gqa`. Returns
    ``[B, H, L]`` (latent space: the caller applies ``W_uv``). Reference:
    :func:`model.kernels.paged_decode_mla`."""
    mask = _mask_arg(None, None, q_lat)
    return _mla(q_lat[:, None], q_pe[:, None], latent_cache, rope_cache, block_tables, context_lens, block_size,
                scale, mask, split_keys, config)[:, 0]


def tree_verify_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, scale: float, tree_mask: torch.Tensor | None = None,
                    parents: torch.Tensor | None = None, split_keys: int = SPLIT_KEYS,
                    config: dict | None = None) -> torch.Tensor:
    """Tree verify GQA. ``q [B, N, H, D]``: the N nodes are the last N of the ``context_lens[b]`` cached keys;
    give ``tree_mask [B, N, N]`` bool (True = node i sees tree node j) or ``parents [B, N]`` (−1 = root;
    ancestors and self). Returns ``[B, N, H, D]``. Reference: :func:`model.kernels.tree_verify_gqa`."""
    mask = _mask_arg(tree_mask, parents, q)
    return _gqa(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, mask, split_keys, config)


def tree_verify_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                    tree_mask: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                    split_keys: int = SPLIT_KEYS, config: dict | None = None) -> torch.Tensor:
    """Tree verify MLA, absorbed. ``q_lat [B, N, H, L]``, ``q_pe [B, N, H, R]``; caches as
    :func:`paged_decode_mla`, mask as :func:`tree_verify_gqa`. Returns ``[B, N, H, L]``. Reference:
    :func:`model.kernels.tree_verify_mla`."""
    mask = _mask_arg(tree_mask, parents, q_lat)
    return _mla(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale, mask,
                split_keys, config)
