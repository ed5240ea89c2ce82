"""The torch reference kernels: one implementation per op, what the model runs on CPU and what each Triton kernel
is checked against (same call signatures; :mod:`model.kernel_select` chooses between the two sets).

Paged cache layout (engine/worker/kv_cache.py): one flat tensor per entry kind, ``[num_slots, ...]`` with
``num_slots = num_blocks * block_size``; key position ``p`` of sequence ``b`` lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size``. ``context_lens[b]`` counts every cached
key of sequence ``b`` including this step's tokens (the engine writes them before it attends), so a decode
query sits at position ``context_lens[b] - 1`` and the N nodes of a tree-verify step are the last N keys.
The paged references gather each sequence's keys and call :func:`attention`, the function the prefill path
uses; they loop over the batch in Python and are meant for checks, not speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.batch import paged_slots
from model.tree_mask import resolve_tree_mask
from parallelism.dispatch_base import ExpertInput

# ----------------------------------------------------------------------------------------------- dense


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` normalised in fp32, scaled by ``weight [D]`` (HF semantics: cast back, then scale)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [..., D]`` → ``(rms_norm(x + residual), x + residual)``; the sum is in x's dtype."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


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


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul (MLA's ``W_uk``/``W_uv`` absorption): ``x [T, h, K]``, ``w [h, K, N]`` → ``[T, h, N]``."""
    return torch.einsum("thk,hkn->thn", x, w)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``q [B, N, H, Dk]``, ``k [B, M, G, Dk]``, ``v [B, M, G, Dv]`` (query head h reads key group
    ``h // (H / G)``), ``mask [B, N, M]`` bool (True = attend). Returns ``[B, N, H, Dv]``."""
    groups = q.shape[2] // k.shape[2]
    return torch.stack([attention(q[b], k[b].repeat_interleave(groups, dim=1), v[b].repeat_interleave(groups, dim=1),
                                  scale, mask[b]) for b in range(q.shape[0])])


# ----------------------------------------------------------------------------------------------- experts


def local_experts(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The torch expert computation (``LocalExperts.forward`` as a function of its weights):
    ``w_gate_up [E, 2I, H]`` (gate | up rows), ``w_down [E, H, I]``; ``inp.hidden [N, H]``, ``inp.slots [N, k]``
    (local slot, −1 = not local), ``inp.weights [N, k]``. Returns the weighted sum over each row's local experts
    ``[N, H]``.

    Rows are sorted by expert and go through two grouped GEMMs (:func:`grouped_expert_mlp`): a fixed handful of
    ops whatever the number of experts hit, and an expert with no rows costs nothing. Where grouped GEMM does
    not apply (rows not 16-byte aligned, e.g. a tiny model's intermediate split 8 ways; CUDA in a dtype other
    than bf16) the hit experts run one at a time (:func:`per_expert_mlp`)."""
    mlp = grouped_expert_mlp if grouped_gemm_supported(w_down) else per_expert_mlp
    return routed_sum(inp, w_gate_up, w_down, mlp)


def routed_sum(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor, mlp) -> torch.Tensor:
    """:func:`local_experts` with the expert MLP given: the local ``(row, choice)`` pairs sorted by expert (stable),
    ``mlp(x_sorted [M, H], counts [E], w_gate_up, w_down) → [M, H]``, each output times its routing weight
    and summed into its row (``index_add_`` in hidden's dtype). Returns ``[N, H]``."""
    x, k = inp.hidden, inp.slots.shape[1]
    flat = inp.slots.reshape(-1)
    valid = flat >= 0
    rows = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[valid]
    slots, weights = flat[valid], inp.weights.reshape(-1)[valid]
    order = torch.argsort(slots, stable=True)
    rows, weights = rows[order], weights[order, None].to(x.dtype)
    y = mlp(x[rows], expert_counts(slots, w_gate_up.shape[0]), w_gate_up, w_down)
    return torch.zeros_like(x).index_add_(0, rows, y * weights)


def expert_counts(slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``slots`` int of any shape (local slot, −1 = not local) → pairs per local expert ``[E]`` int64, with no
    host synchronisation (``bincount`` reads its maximum back on CUDA)."""
    key = torch.where(slots >= 0, slots, num_experts).reshape(-1).long()
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=slots.device)
    return counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]


def grouped_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """``down(silu(gate) * up)`` of rows sorted by expert: expert ``e`` owns the next ``counts[e]`` rows of
    ``x [M, H]``; two ``F.grouped_mm`` launches over the offsets, no host synchronisation. Rows past
    ``counts.sum()`` come back unspecified (never computed). ``scale [M]`` multiplies each row's intermediate
    (a routing weight applied before the down projection). Returns ``[M, H]`` in x's dtype."""
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's group
    h = silu_and_mul(F.grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs))  # [M, I]
    if scale is not None:
        h.mul_(scale[:, None])
    return F.grouped_mm(h, w_down.transpose(1, 2), offs=offs)  # [M, H]


def per_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_expert_mlp` (without ``scale``) as a Python loop of ``F.linear`` per hit expert: what
    per-expert cuBLAS does. Reads ``counts`` back to the host. Returns ``[counts.sum(), H]``."""
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            parts.append(F.linear(silu_and_mul(F.linear(x[start:start + n], w_gate_up[e])), w_down[e]))
        start += n
    return torch.cat(parts) if parts else x.new_zeros(0, x.shape[1])


def grouped_gemm_supported(w_down: torch.Tensor) -> bool:
    """``F.grouped_mm`` wants 16-byte-aligned rows (hidden and intermediate dims) and, on CUDA, bf16."""
    aligned = all(d * w_down.element_size() % 16 == 0 for d in w_down.shape[1:])
    return aligned and (w_down.device.type == "cpu" or w_down.dtype == torch.bfloat16)


# ----------------------------------------------------------------------------------------------- paged attention


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The first ``length`` entries of one sequence: ``cache [num_slots, ...]``, ``block_table [max_blocks]``
    → ``[length, ...]``."""
    pos = torch.arange(length, device=cache.device)
    return cache.index_select(0, paged_slots(block_table.to(cache.device), pos, block_size))


def _visible(tree_mask: torch.Tensor, length: int) -> torch.Tensor:
    """``tree_mask [N, N]`` of one sequence → ``[N, length]``: every earlier key, then the tree's own mask."""
    n = tree_mask.shape[0]
    past = torch.ones(n, length - n, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([past, tree_mask.to(past.device)], dim=1)


def _paged_attention(q: torch.Tensor, kv, context_lens: torch.Tensor, scale: float,
                     tree_mask: torch.Tensor | None) -> torch.Tensor:
    """``q [B, N, H, Dk]``; ``kv(b, length)`` → keys ``[length, H, Dk]``, values ``[length, H, Dv]``;
    ``tree_mask [B, N, N]`` or None (N = 1, decode). Returns ``[B, N, H, Dv]``."""
    outs = []
    for b, length in enumerate(context_lens.tolist()):
        k, v = kv(b, length)
        mask = None if tree_mask is None else _visible(tree_mask[b], length)
        outs.append(attention(q[b], k, v, scale, mask))
    return torch.stack(outs)


def _gqa_kv(k_cache, v_cache, block_tables, block_size, heads):
    groups = heads // k_cache.shape[1]

    def kv(b, length):
        k = gather_paged(k_cache, block_tables[b], length, block_size)  # [M, KVH, D]
        v = gather_paged(v_cache, block_tables[b], length, block_size)
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return kv


def _mla_kv(latent_cache, rope_cache, block_tables, block_size, heads):
    def kv(b, length):
        lat = gather_paged(latent_cache, block_tables[b], length, block_size)  # [M, L]
        rope = gather_paged(rope_cache, block_tables[b], length, block_size)  # [M, R]
        k = torch.cat([lat, rope], dim=-1)[:, None].expand(-1, heads, -1)
        return k, lat[:, None].expand(-1, heads, -1)
    return kv


def paged_decode_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Decode GQA over a paged cache. ``q [B, H, D]``; ``k_cache, v_cache [num_slots, KVH, D]`` (H % KVH == 0,
    query head h reads KV head ``h // (H / KVH)``); ``block_tables [B, max_blocks]`` int; ``context_lens [B]``
    int. Returns ``[B, H, D]`` in q's dtype."""
    kv = _gqa_kv(k_cache, v_cache, block_tables, block_size, q.shape[1])
    return _paged_attention(q[:, None], kv, context_lens, scale, None)[:, 0]


def paged_decode_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     scale: float) -> torch.Tensor:
    """Decode MLA in absorbed form (``MLAAttention._decode_absorbed`` without the ``W_uk``/``W_uv`` products).
    ``q_lat [B, H, L]`` (q_nope·W_uk), ``q_pe [B, H, R]``; ``latent_cache [num_slots, L]``, ``rope_cache
    [num_slots, R]``. Score = q_lat·latent + q_pe·rope_key; value = latent. Returns ``[B, H, L]``."""
    kv = _mla_kv(latent_cache, rope_cache, block_tables, block_size, q_lat.shape[1])
    q = torch.cat([q_lat, q_pe], dim=-1)[:, None]
    return _paged_attention(q, kv, context_lens, scale, None)[:, 0]


def tree_verify_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, scale: float, tree_mask: torch.Tensor | None = None,
                    parents: torch.Tensor | None = None) -> torch.Tensor:
    """Tree verify GQA. ``q [B, N, H, D]``, the N tree nodes being the last N of ``context_lens[b]`` cached keys;
    node i sees every earlier key and the tree keys j with ``tree_mask[b, i, j]`` (``[B, N, N]`` bool), or
    its ancestors and itself given ``parents [B, N]`` (−1 = root). Returns ``[B, N, H, D]``."""
    kv = _gqa_kv(k_cache, v_cache, block_tables, block_size, q.shape[2])
    return _paged_attention(q, kv, context_lens, scale, resolve_tree_mask(tree_mask, parents))


def tree_verify_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                    tree_mask: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
    """Tree verify MLA, absorbed: ``q_lat [B, N, H, L]``, ``q_pe [B, N, H, R]``; mask as :func:`tree_verify_gqa`.
    Returns ``[B, N, H, L]`` in latent space."""
    kv = _mla_kv(latent_cache, rope_cache, block_tables, block_size, q_lat.shape[2])
    return _paged_attention(torch.cat([q_lat, q_pe], dim=-1), kv, context_lens, scale,
                            resolve_tree_mask(tree_mask, parents))
