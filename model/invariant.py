"""Batch-invariant torch kernels (``engine.batch_invariant``): each row's result is computed with a reduction
order that depends on nothing but that row and its own visible keys — not on how many rows share the call,
where the row sits in it, or how long the longest context of the launch is. Why and how, per kernel, with the
measurements on the CPU they were chosen on: docs/batch_invariance.md.

- :func:`linear` / :func:`head_matmul`: rows in fixed tiles of :data:`TILE_ROWS` (the last one zero-padded), one
  GEMM of the same shape per tile: no M-dependent kernel choice (fp32 ``F.linear`` on this CPU picks its kernel
  by M and is not row-invariant). The quantized linears dequantize, then call it (:data:`QUANT`).
- :func:`masked_attention` (and the paged decode / tree-verify ops built on it): every query row attends over its
  *visible* keys compacted in logical order (past keys, then its tree ancestors by depth), so a tree node at depth
  d computes exactly what a decode at that position computes. Scores are sums over the head dim; the softmax
  denominator and the value sums run over fixed chunks of :data:`SPLIT_KEYS` keys, merged chunk by chunk in
  order: a chunk past a row's last key adds exact zeros. fp32 throughout, output in q's dtype.
- :func:`moe_experts` (and the quantized MoE, on dequantized experts: :func:`pair_experts`): each (token, expert)
  pair's output written to its own row, summed per token in top-k order (no ``index_add``/atomics).
- :func:`silu_and_mul`, :func:`sigmoid` (the router) and the attention's softmax take ``exp`` from
  :mod:`model.fixed_math` on the CPU: a torch transcendental rounds the scalar tail of a tensor with another routine
  than its vectorised body, so a row's value depended on the launch's size (CUDA runs one routine per element).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from model import fixed_math
from model.batch import paged_slots
from model.quant import reference as qref
from model.tree_mask import resolve_tree_mask
from parallelism.comm import ordered_sum
from parallelism.dispatch_base import ExpertInput

TILE_ROWS = 16  # rows per GEMM: measured fastest of 1/8/16 for 8–65 rows on this CPU (docs/batch_invariance.md)
SPLIT_KEYS = 32  # keys per softmax chunk


def _tiles(x: torch.Tensor):
    """``x [T, ...]`` zero-padded to a multiple of TILE_ROWS rows, as ``TILE_ROWS``-row views."""
    pad = -x.shape[0] % TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return [x[i:i + TILE_ROWS] for i in range(0, x.shape[0], TILE_ROWS)]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` row-invariantly: ``x [..., K]``, ``weight [N, K]`` → ``[..., N]``."""
    lead, t = x.shape[:-1], x[..., 0].numel()
    flat = x.reshape(t, x.shape[-1]).contiguous()  # one operand layout whatever view x is
    out = torch.cat([F.linear(tile, weight, bias) for tile in _tiles(flat)])[:t] if t else F.linear(flat, weight, bias)
    return out.view(*lead, weight.shape[0])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul ``x [T, h, K]``, ``w [h, K, N]`` → ``[T, h, N]`` (``einsum("thk,hkn->thn")``),
    row-invariantly."""
    t = x.shape[0]
    if t == 0:
        return x.new_zeros(0, w.shape[0], w.shape[2])
    w = w.contiguous()
    parts = [torch.bmm(tile.transpose(0, 1).contiguous(), w).transpose(0, 1) for tile in _tiles(x)]
    return torch.cat(parts)[:t]


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` in fp32 whose bits depend on the element alone: :func:`model.fixed_math.exp` on the CPU, ``torch.exp``
    on CUDA (one routine for every element there)."""
    return torch.exp(x.float()) if x.is_cuda else fixed_math.exp(x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate | up) → ``silu(gate) * up``, silu as ``g / (1 + exp(-g))`` in fp32."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    return (g / (1.0 + exp(-g))).to(gate_up.dtype) * up


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32 (DeepSeek's router scores), from :func:`exp`."""
    return 1.0 / (exp(-x) + 1.0)


# ----------------------------------------------------------------------------------------------- attention


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """The row-local core. ``q [R, H, Dk]``; ``k [R, L, G, Dk]``, ``v [R, L, G, Dv]``: row r's visible keys in
    logical order, the first ``counts[r]`` valid, the rest finite (H = G × heads per group). Returns ``[R, H, Dv]``
    in q's dtype."""
    r, h, dk = q.shape
    length, g, dv = k.shape[1], k.shape[2], v.shape[-1]
    pad = -length % SPLIT_KEYS
    if pad:
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
        length += pad
    c, hg = length // SPLIT_KEYS, h // g
    # one (row, key group) per bmm batch entry, one bmm per chunk: every GEMM has one shape ([hg, Dk] x [Dk, S] or
    # [hg, S] x [S, Dv]) and contiguous operands: ``reshape`` may return a transposed view (one row, one chunk),
    # and fp32 bmm on a transposed operand gives other bits (measured)
    qf = q.float().reshape(r * g, hg, dk).contiguous()
    kc = k.float().view(r, c, SPLIT_KEYS, g, dk).permute(1, 0, 3, 4, 2).contiguous().view(c, r * g, dk, SPLIT_KEYS)
    vc = v.float().view(r, c, SPLIT_KEYS, g, dv).permute(1, 0, 3, 2, 4).contiguous().view(c, r * g, SPLIT_KEYS, dv)
    scores = torch.stack([torch.bmm(qf, kc[i]) for i in range(c)]).view(c, r, g, hg, SPLIT_KEYS)
    valid = (torch.arange(length, device=q.device)[None, :] < counts[:, None]).view(r, c, SPLIT_KEYS)
    scores = (scores * scale).masked_fill(~valid.transpose(0, 1)[:, :, None, None, :], float("-inf"))
    p = exp(scores - scores.amax(dim=(0, 4), keepdim=True)).view(c, r * g, hg, SPLIT_KEYS)
    denom, acc = p[0].sum(-1), torch.bmm(p[0], vc[0])
    for i in range(1, c):  # chunk by chunk, in key order; a chunk past the row's keys adds exact zeros
        denom, acc = denom + p[i].sum(-1), acc + torch.bmm(p[i], vc[i])
    return (acc / denom[..., None]).reshape(r, h, dv).to(q.dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``q [B, N, H, Dk]``, ``k [B, M, G, Dk]``, ``v [B, M, G, Dv]``, ``mask [B, N, M]`` bool (True = visible).
    Each query row attends over its visible keys, compacted in index order. Returns ``[B, N, H, Dv]``."""
    b, n, m = mask.shape
    counts = mask.sum(-1).reshape(-1)  # [R]
    longest = -(-max(int(counts.max()) if counts.numel() else 1, 1) // SPLIT_KEYS) * SPLIT_KEYS
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # visible keys first, in order
    order = order[..., :longest] if longest <= m else F.pad(order, (0, longest - m))  # tail: masked, finite
    seq = torch.arange(b, device=q.device)[:, None, None].expand(b, n, longest)
    k, v = k.float(), v.float()  # once per sequence, before the per-row copies
    rows_k = k[seq, order].reshape(b * n, longest, *k.shape[2:])
    rows_v = v[seq, order].reshape(b * n, longest, *v.shape[2:])
    out = attend_rows(q.reshape(b * n, *q.shape[2:]), rows_k, rows_v, counts, scale)
    return out.view(b, n, *out.shape[1:]).to(q.dtype)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """One sequence (the dynamic path): ``q [n, H, Dk]``, ``k [m, G, Dk]``, ``v [m, G, Dv]``, ``mask [n, m]`` or
    None (causal, queries at the last n positions). Returns ``[n, H, Dv]``."""
    n, m = q.shape[0], k.shape[0]
    if mask is None:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
    return masked_attention(q[None], k[None], v[None], mask[None], scale)[0]


def _paged_mask(context_lens: torch.Tensor, tree_mask: torch.Tensor | None, length: int) -> torch.Tensor:
    """``[B, N, length]``: every key before a sequence's N step tokens, then the tree's own mask (decode: N = 1)."""
    ctx = context_lens.long()[:, None, None]
    pos = torch.arange(length, device=context_lens.device)[None, None, :]
    if tree_mask is None:
        return pos < ctx
    n = tree_mask.shape[1]
    j = pos - (ctx - n)  # [B, 1, M]: index into the tree, valid for 0 <= j < n
    in_tree = (j >= 0) & (j < n)
    tree = torch.gather(tree_mask.to(torch.bool), 2, j.clamp(0, n - 1).expand(-1, n, -1))
    return (j < 0) | (in_tree & tree)


def _gather_paged(caches: tuple[torch.Tensor, ...], block_tables: torch.Tensor, length: int, block_size: int):
    """Positions ``0..length-1`` of every sequence: each cache ``[num_slots, ...]`` → ``[B, length, ...]``."""
    pos = torch.arange(length, device=block_tables.device)
    slots = paged_slots(block_tables, pos, block_size)  # [B, length]
    return tuple(c[slots] for c in caches)


def _paged(q, caches, kv, block_tables, context_lens, block_size, scale, tree_mask):
    length = int(context_lens.max())
    mask = _paged_mask(context_lens, tree_mask, length)
    k, v = kv(*_gather_paged(caches, block_tables, length, block_size))
    return masked_attention(q, k, v, mask, scale)


def _gqa(k, v):
    return k, v


def _mla(latent, rope):
    return torch.cat([latent, rope], dim=-1)[:, :, None], latent[:, :, None]


def paged_decode_gqa(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    """:func:`model.kernels.paged_decode_gqa`, row-invariantly."""
    return _paged(q[:, None], (k_cache, v_cache), _gqa, block_tables, context_lens, block_size, scale, None)[:, 0]


def paged_decode_mla(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale):
    """:func:`model.kernels.paged_decode_mla`, row-invariantly."""
    q = torch.cat([q_lat, q_pe], dim=-1)[:, None]
    return _paged(q, (latent_cache, rope_cache), _mla, block_tables, context_lens, block_size, scale, None)[:, 0]


def tree_verify_gqa(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, tree_mask=None, parents=None):
    """:func:`model.kernels.tree_verify_gqa`, row-invariantly (a node at depth d = a decode at its position)."""
    return _paged(q, (k_cache, v_cache), _gqa, block_tables, context_lens, block_size, scale,
                  resolve_tree_mask(tree_mask, parents))


def tree_verify_mla(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale,
                    tree_mask=None, parents=None):
    """:func:`model.kernels.tree_verify_mla`, row-invariantly."""
    return _paged(torch.cat([q_lat, q_pe], dim=-1), (latent_cache, rope_cache), _mla, block_tables, context_lens,
                  block_size, scale, resolve_tree_mask(tree_mask, parents))


# ----------------------------------------------------------------------------------------------- experts


def finish_pairs(pairs: torch.Tensor, inp: ExpertInput, dtype: torch.dtype) -> torch.Tensor:
    """Per-pair outputs ``[N, k, H]`` → what the dispatcher asked for: the pairs as they are when ``inp.unsummed``
    (the placement-invariant combine adds them after its collective), else each row's sum in top-k order ``[N, H]``
    in ``dtype``."""
    return pairs if inp.unsummed else ordered_sum(pairs, dim=1).to(dtype)


def pair_experts(inp: ExpertInput, expert: qref.Expert) -> torch.Tensor:
    """Each (row, choice) pair's weighted ``expert(e, rows [n, H]) → [n, H]`` in its own row ``[N*k, H]``, summed
    per row over its k choices in top-k order (no ``index_add``/atomics; :func:`finish_pairs`). Returns ``[N, H]``,
    or ``[N, k, H]`` when ``inp.unsummed``."""
    x, k = inp.hidden, inp.slots.shape[1]
    flat = inp.slots.reshape(-1)
    weights = inp.weights.reshape(-1).to(x.dtype)
    pairs = x.new_zeros(flat.shape[0], x.shape[1])
    for e in torch.unique(flat[flat >= 0]).tolist():
        idx = (flat == e).nonzero()[:, 0]
        pairs[idx] = expert(e, x[idx // k]) * weights[idx, None]
    return finish_pairs(pairs.view(x.shape[0], k, x.shape[1]), inp, x.dtype) if x.shape[0] or inp.unsummed else pairs


def moe_experts(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """:func:`model.kernels.local_experts`, row-invariantly (:func:`pair_experts`, experts in tiles: :func:`linear`)."""
    return pair_experts(inp, lambda e, xr: linear(silu_and_mul(linear(xr, w_gate_up[e])), w_down[e]))


# ----------------------------------------------------------------------------------------------- quantized


def w4a16_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """:func:`model.quant.reference.w4a16_moe`, row-invariantly (:func:`pair_experts` over the dequantized experts)."""
    return pair_experts(inp, qref.int4_mlp(w13, s13, w2, s2, group_size, inp.hidden.dtype, linear, silu_and_mul))


def w8a16_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              block: tuple[int, int]) -> torch.Tensor:
    """:func:`model.quant.reference.w8a16_moe`, row-invariantly."""
    return pair_experts(inp, qref.fp8_mlp(w13, s13, w2, s2, block, inp.hidden.dtype, False, linear, silu_and_mul))


def w8a8_moe(inp: ExpertInput, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
             block: tuple[int, int]) -> torch.Tensor:
    """:func:`model.quant.reference.w8a8_moe`, row-invariantly (the per-token activation quantization is row-local)."""
    return pair_experts(inp, qref.fp8_mlp(w13, s13, w2, s2, block, inp.hidden.dtype, True, linear, silu_and_mul))


# the batch-invariant version of each quantized reference (model.kernel_select keeps the base set's W8A8/W8A16)
QUANT = {qref.w4a16_linear: functools.partial(qref.w4a16_linear, linear=linear),
         qref.w8a16_linear: functools.partial(qref.w8a16_linear, linear=linear),
         qref.w8a8_linear: functools.partial(qref.w8a8_linear, linear=linear),
         qref.w4a16_moe: w4a16_moe, qref.w8a16_moe: w8a16_moe, qref.w8a8_moe: w8a8_moe}
