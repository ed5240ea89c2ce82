"""Row-invariant paged attention (``engine.batch_invariant`` on the GPU; docs/batch_invariance.md).

One kernel serves every attention step kind — decode, tree verify, the drafter's block, and through
:func:`masked_attention` prefill, mixed and graphs-off steps — so a token's bits do not depend on the kind of step
it is computed in, nor on what shares its launch. A query row (one token of one sequence: GQA the heads of one KV
head, MLA every head) attends over its *visible keys compacted in logical order*, described by :class:`RowKeys`:
logical key ``j < prefix`` is position ``j`` of its sequence, key ``j ≥ prefix`` is position
``extras[j - prefix]`` (the tree nodes it sees, in index order, which is depth order). A tree node at depth d thus
walks exactly the keys, tiles and splits of the decode of its token once the accepted path is compacted.

Each program owns one row, one block of its heads (``BLOCK_R`` from the head count only, never packed with other
rows) and one split of :data:`SPLIT_KEYS` logical keys, walked in tiles of ``BLOCK_N`` with one slot lookup per
key. Partials are always written and merged in split order by :func:`model.triton.attention._merge_kernel`, even
with one split. The per-row key lists are built by device ops of fixed shape (no host sync), so the paged
wrappers are CUDA-graph safe. Scores are ``q_a·k_a (+ q_b·k_b)``: MLA's latent and rope parts as two dots of the
same tile shapes in the paged MLA wrappers and in :func:`masked_attention` (keys ``[latent | rope]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model.tree_mask import resolve_tree_mask
from model.triton.attention import (
    SPLIT_KEYS,
    _merge_kernel,
    _pow2,
    _softmax_step,
    _split_tiles,
    _store_rows,
    merge_meta,
    split_grid,
)
from model.triton.precision import dot_precision

PARTIAL_BYTES = 1 << 28  # fp32 split partials per launch; more rows are launched in row chunks (rows are independent)


@triton.jit
def _key_slots(bt_ptr, extras_ptr, prefix, length, t, block_size, BLOCK_N: tl.constexpr):
    """Logical key tile ``t`` of one row (``bt_ptr`` at its sequence's block-table row, ``extras_ptr`` at its
    extras): validity and int64 cache slots of its ``BLOCK_N`` keys."""
    j = t * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = j < length
    extra = tl.load(extras_ptr + (j - prefix), mask=ok & (j >= prefix), other=0)
    pos = tl.where(j < prefix, j, extra)
    block = tl.load(bt_ptr + pos // block_size, mask=ok, other=0).to(tl.int64)
    return ok, block * block_size + pos % block_size


@triton.jit
def _load_keys(ptr, slot, stride_s, ok, D: tl.constexpr, BLOCK: tl.constexpr):
    """``[BLOCK_N, BLOCK]`` rows ``slot`` of a cache (``ptr`` at its KV group), zeros where not ``ok`` or past D."""
    d = tl.arange(0, BLOCK)
    return tl.load(ptr + slot[:, None] * stride_s + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _load_queries(ptr, head, stride_h, row_ok, D: tl.constexpr, BLOCK: tl.constexpr):
    """``[BLOCK_R, BLOCK]`` query heads ``head`` of one row (``ptr`` at the row), zeros past the row block or D."""
    d = tl.arange(0, BLOCK)
    return tl.load(ptr + head[:, None] * stride_h + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)


@triton.jit(do_not_specialize=["block_size", "stride_bt", "stride_x"])
def _row_kernel(qa_ptr, qb_ptr, ka_ptr, kb_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, seq_ptr, prefix_ptr, len_ptr,
                extras_ptr, scale, block_size, stride_bt, stride_x, stride_qar, stride_qah, stride_qbr, stride_qbh,
                stride_kas, stride_kag, stride_kbs, stride_kbg, stride_vs, stride_vg,
                G: tl.constexpr, HPG: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr, DOT: tl.constexpr):
    """Grid ``(R, G * cdiv(HPG, BLOCK_R), splits)``: row ``r``, heads ``g*HPG + i`` of KV group ``g``, one split.
    Writes normalised fp32 partials ``o [S, R, G*HPG, DV]`` and their log-sum-exp ``lse [S, R, G*HPG]``."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    blocks = tl.cdiv(HPG, BLOCK_R)
    g, i = tl.program_id(1) // blocks, (tl.program_id(1) % blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = i < HPG
    head = g * HPG + i
    out_row = (split * tl.num_programs(0) + row) * (G * HPG) + head
    length = tl.load(len_ptr + row)
    if split * SPLIT_KEYS >= length:  # past this row's splits: weight 0 in the merge
        tl.store(lse_ptr + out_row, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=row_ok)
        return
    prefix, bt_row = tl.load(prefix_ptr + row), bt_ptr + tl.load(seq_ptr + row).to(tl.int64) * stride_bt
    qa = _load_queries(qa_ptr + row * stride_qar, head, stride_qah, row_ok, DA, BLOCK_A)
    qb = _load_queries(qb_ptr + row * stride_qbr, head, stride_qbh, row_ok, DB, BLOCK_B)  # zeros when DB = 0
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    first, last = _split_tiles(split, length, SPLIT_KEYS, BLOCK_N)
    for t in range(first, last):
        ok, slot = _key_slots(bt_row, extras_ptr + row * stride_x, prefix, length, t, block_size, BLOCK_N)
        s = tl.dot(qa, tl.trans(_load_keys(ka_ptr + g * stride_kag, slot, stride_kas, ok, DA, BLOCK_A)),
                   input_precision=DOT)
        if DB > 0:  # MLA's rope part: a second dot of fixed shape, added before scaling
            kb = _load_keys(kb_ptr + g * stride_kbg, slot, stride_kbs, ok, DB, BLOCK_B)
            s = s + tl.dot(qb, tl.trans(kb), input_precision=DOT)
        p, m_i, l_i, alpha = _softmax_step(s * scale, row_ok[:, None] & ok[None, :], m_i, l_i)
        v = _load_keys(v_ptr + g * stride_vg, slot, stride_vs, ok, DV, BLOCK_V)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
    _store_rows(o_ptr, lse_ptr, out_row, tl.arange(0, BLOCK_V), DV, row_ok, acc, m_i, l_i, True)


# ------------------------------------------------------------------------------------------ per-row key lists


@dataclass(frozen=True)
class RowKeys:
    """Each query row's visible keys, int32 device tensors: ``seq [R]`` (its block-table row), ``prefix [R]``,
    ``length [R]`` (prefix + extras used) and ``extras [R, E]`` (positions of its keys past the prefix, in order;
    entries past ``length - prefix`` unused)."""

    seq: torch.Tensor
    prefix: torch.Tensor
    length: torch.Tensor
    extras: torch.Tensor

    def rows(self, lo: int, hi: int) -> RowKeys:
        """Rows ``lo..hi-1``."""
        return RowKeys(self.seq[lo:hi], self.prefix[lo:hi], self.length[lo:hi], self.extras[lo:hi])


def _int32(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(torch.int32).contiguous() for t in ts)


def compact(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask [R, W]`` bool → the indices of each row's first ``width`` True entries, in order, ``[R, width]`` int64
    (0 past them), and how many ``[R]``. A cumsum and a scatter (overflow to a dropped column): no host sync."""
    r, w = mask.shape
    rank = mask.long().cumsum(-1) - 1
    keep = mask & (rank < width)
    index = torch.arange(w, device=mask.device).expand(r, w)
    out = torch.zeros(r, width + 1, dtype=torch.long, device=mask.device)
    out.scatter_(1, torch.where(keep, rank, width), index)
    return out[:, :width], keep.sum(-1)


def decode_rows(context_lens: torch.Tensor) -> RowKeys:
    """One row per sequence: every cached key, ``prefix = length = context_lens [B]``, no extras."""
    b = context_lens.shape[0]
    seq = torch.arange(b, device=context_lens.device)
    return RowKeys(*_int32(seq, context_lens, context_lens, seq.new_zeros(b, 1)))


def tree_rows(context_lens: torch.Tensor, tree_mask: torch.Tensor) -> RowKeys:
    """Node ``i`` of sequence ``b`` (row ``b*N + i``): the ``context_lens[b] - N`` past keys, then the tree nodes
    ``tree_mask [B, N, N]`` lets it see, at positions ``past + j`` in index order."""
    b, n = tree_mask.shape[:2]
    seq = torch.arange(b * n, device=tree_mask.device) // n
    past = (context_lens.long() - n)[seq]
    extras, count = compact(tree_mask.reshape(b * n, n), n)
    return RowKeys(*_int32(seq, past, past + count, past[:, None] + extras))


def mask_rows(mask: torch.Tensor) -> RowKeys:
    """``mask [B, N, M]`` bool (row ``b*N + i`` of sequence ``b``): its all-visible prefix, then its later visible
    keys (at most N: causal rows have none, tree rows see ancestors among the last N keys)."""
    b, n, m = mask.shape
    flat = mask.reshape(b * n, m)
    seen = flat.long().cumsum(-1)
    prefix = (seen == torch.arange(1, m + 1, device=mask.device)).sum(-1)  # cumsum = position + 1 up to the first gap
    later = flat & (torch.arange(m, device=mask.device) >= prefix[:, None])
    extras, count = compact(later, n)
    seq = torch.arange(b * n, device=mask.device) // n
    return RowKeys(*_int32(seq, prefix, prefix + count, extras))


# ----------------------------------------------------------------------------------------------- launches


def row_meta(heads_per_group: int, key_dims: tuple[int, int], value_dim: int, dtype: torch.dtype,
             split_keys: int = SPLIT_KEYS) -> dict:
    """Constexprs of :func:`_row_kernel` but ``G``, plus ``num_warps``/``num_stages``: from the head count, dims,
    dtype and ``split_keys`` only (never the batch or the step kind). BLOCK_N 64 for keys ≤ 128 wide, 32 to 576,
    else 16; BLOCK_R the heads per group rounded up to a power of two, 16 to 32."""
    da, db = key_dims
    dk = da + db
    block_n = 64 if dk <= 128 else 32 if dk <= 576 else 16
    if split_keys % block_n:
        raise ValueError(f"split_keys {split_keys} is not a multiple of BLOCK_N {block_n}")
    return dict(HPG=heads_per_group, DA=da, DB=db, DV=value_dim, BLOCK_R=min(32, _pow2(heads_per_group)),
                BLOCK_A=_pow2(da), BLOCK_B=_pow2(db), BLOCK_V=_pow2(value_dim), BLOCK_N=block_n,
                SPLIT_KEYS=split_keys, DOT=dot_precision(dtype), num_warps=4, num_stages=2)


def _launch(q: tuple, k: tuple, v: torch.Tensor, keys: RowKeys, tables: torch.Tensor, block_size: int,
            scale: float, meta: dict, splits: int, out: torch.Tensor) -> None:
    """One launch over ``out``'s rows and ``splits`` splits, then the ordered merge into ``out [R, H, DV]``;
    arguments as :func:`attend`."""
    meta = dict(meta)
    launch = dict(num_warps=meta.pop("num_warps"), num_stages=meta.pop("num_stages"))
    (qa, qb), (ka, kb), (r, h, dv) = q, k, out.shape
    g = ka.shape[1]
    part = torch.empty(splits, r, h, dv, dtype=torch.float32, device=out.device)
    lse = torch.empty(splits, r, h, dtype=torch.float32, device=out.device)
    grid = (r, g * triton.cdiv(meta["HPG"], meta["BLOCK_R"]), splits)
    _row_kernel[grid](qa, qb, ka, kb, v, part, lse, tables, keys.seq, keys.prefix, keys.length, keys.extras, scale,
                      block_size, tables.stride(0), keys.extras.stride(0), qa.stride(0), qa.stride(1), qb.stride(0),
                      qb.stride(1), ka.stride(0), ka.stride(1), kb.stride(0), kb.stride(1), v.stride(0), v.stride(1),
                      G=g, **meta, **launch)
    mm = dict(merge_meta(h, dv), SPLIT_KEYS=meta["SPLIT_KEYS"])
    _merge_kernel[(r, triton.cdiv(h, mm["BLOCK_R"]))](part, lse, out, keys.length, h, dv, **mm)


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attend(q: tuple, k: tuple, v: torch.Tensor, keys: RowKeys, tables: torch.Tensor, block_size: int, scale: float,
           split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """``q = (qa [R, H, DA], qb [R, H, DB] or None)``; caches ``k = (ka [S, G, DA], kb [S, G, DB] or None)``,
    ``v [S, G, DV]`` (``S`` slots, query head h reads group ``h // (H / G)``); ``tables [B, W]`` block tables,
    ``keys`` the rows' key lists. Score = ``qa·ka + qb·kb``. Returns ``[R, H, DV]`` in qa's dtype."""
    qa, ka = _last_dim_unit(q[0]), _last_dim_unit(k[0])
    qb, kb = (qa, ka) if q[1] is None else (_last_dim_unit(q[1]), _last_dim_unit(k[1]))
    v = _last_dim_unit(v)
    (r, h, da), g, dv = qa.shape, ka.shape[1], v.shape[-1]
    meta = row_meta(h // g, (da, 0 if q[1] is None else qb.shape[-1]), dv, qa.dtype, split_keys)
    out = torch.empty(r, h, dv, dtype=qa.dtype, device=qa.device)
    splits = split_grid(tables, block_size, split_keys)
    chunk = max(1, PARTIAL_BYTES // (splits * h * dv * 4))
    for lo in range(0, r, chunk):  # each row's arithmetic is its own: chunking changes no bits
        hi = min(r, lo + chunk)
        _launch((qa[lo:hi], qb[lo:hi]), (ka, kb), v, keys.rows(lo, hi), tables, block_size, scale, meta, splits,
                out[lo:hi])
    return out


# ----------------------------------------------------------------------------------------------- the ops


def paged_decode_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float,
                     split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """:func:`model.kernels.paged_decode_gqa`, row-invariantly: ``q [B, H, D]``, caches ``[S, KVH, D]`` →
    ``[B, H, D]``. ``split_keys``: keys per split, a deployment constant (tests lower it)."""
    return attend((q, None), (k_cache, None), v_cache, decode_rows(context_lens), block_tables, block_size, scale,
                  split_keys)


def paged_decode_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                     split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """:func:`model.kernels.paged_decode_mla`, row-invariantly: ``q_lat [B, H, L]``, ``q_pe [B, H, R]``, caches
    ``[S, L]``, ``[S, R]`` → ``[B, H, L]``."""
    lat = latent_cache[:, None]
    return attend((q_lat, q_pe), (lat, rope_cache[:, None]), lat, decode_rows(context_lens), block_tables, block_size,
                  scale, split_keys)


def tree_verify_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, scale: float, tree_mask: torch.Tensor | None = None,
                    parents: torch.Tensor | None = None, split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """:func:`model.kernels.tree_verify_gqa`, row-invariantly (a node at depth d = the decode of its token after
    compaction): ``q [B, N, H, D]`` → ``[B, N, H, D]``."""
    b, n, h, d = q.shape
    keys = tree_rows(context_lens, resolve_tree_mask(tree_mask, parents))
    out = attend((q.reshape(b * n, h, d), None), (k_cache, None), v_cache, keys, block_tables, block_size, scale,
                 split_keys)
    return out.view(b, n, h, d)


def tree_verify_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                    tree_mask: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                    split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """:func:`model.kernels.tree_verify_mla`, row-invariantly: ``q_lat [B, N, H, L]``, ``q_pe [B, N, H, R]`` →
    ``[B, N, H, L]``."""
    b, n, h, lat_dim = q_lat.shape
    keys = tree_rows(context_lens, resolve_tree_mask(tree_mask, parents))
    lat = latent_cache[:, None]
    out = attend((q_lat.reshape(b * n, h, lat_dim), q_pe.reshape(b * n, h, -1)), (lat, rope_cache[:, None]), lat,
                 keys, block_tables, block_size, scale, split_keys)
    return out.view(b, n, h, lat_dim)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     split_keys: int = SPLIT_KEYS) -> torch.Tensor:
    """:func:`model.invariant.masked_attention` on the row kernel: ``q [B, N, H, Dk]``, ``k [B, M, G, Dk]``,
    ``v [B, M, G, Dv]``, ``mask [B, N, M]`` bool (each row: a visible prefix, then at most N more visible keys) →
    ``[B, N, H, Dv]``. The gathered K/V is a cache with one M-slot block per sequence. Keys wider than values
    (MLA's ``[latent | rope]``) score as two dots, first ``Dv`` then the rest, as the paged MLA wrappers do."""
    b, n, h, dk = q.shape
    m, g, dv = k.shape[1], k.shape[2], v.shape[-1]
    da = min(dk, dv)
    qf, kf, vf = q.reshape(b * n, h, dk), k.reshape(b * m, g, dk), v.reshape(b * m, g, dv)
    q_parts = (qf[..., :da], qf[..., da:] if dk > da else None)
    k_parts = (kf[..., :da], kf[..., da:] if dk > da else None)
    tables = torch.arange(b, dtype=torch.int32, device=q.device)[:, None]
    out = attend(q_parts, k_parts, vf, mask_rows(mask), tables, m, scale, split_keys)
    return out.view(b, n, h, dv)
