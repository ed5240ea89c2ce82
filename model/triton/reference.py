"""Torch references for the Triton kernels, and the torch-side helpers those kernels share.

Paged cache layout (engine/kv_cache.py): one flat tensor per entry kind, ``[num_slots, ...]`` with
``num_slots = num_blocks * block_size``; key position ``p`` of sequence ``b`` lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size``. ``context_lens[b]`` counts every cached
key of sequence ``b`` including this step's tokens (the engine writes them before it attends), so a decode
query sits at position ``context_lens[b] - 1`` and the N nodes of a tree-verify step are the last N keys.

The attention references gather each sequence's keys and call :func:`model.kernels.attention`, the same
function the prefill path uses; they loop over the batch in Python and are meant for checks, not speed.
"""

from __future__ import annotations

import torch

from model.kernels import attention, rms_norm
from model.tree_mask import ancestor_mask
from parallelism.dispatch import ExpertInput


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: ``"ieee"`` for fp32 (Triton's default on NVIDIA is
    TF32, about 1e-3 off the fp32 references, and the interpreter ignores the setting, so CPU tests could not
    see it); Triton's default ``"tf32"`` otherwise (it only affects fp32 operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The first ``length`` entries of one sequence: ``cache [num_slots, ...]``, ``block_table [max_blocks]``
    → ``[length, ...]``."""
    pos = torch.arange(length, device=cache.device)
    slots = block_table.to(cache.device)[pos // block_size].long() * block_size + pos % block_size
    return cache.index_select(0, slots)


def resolve_tree_mask(tree_mask: torch.Tensor | None, parents: torch.Tensor | None) -> torch.Tensor:
    """Exactly one of ``tree_mask [B, N, N]`` bool or ``parents [B, N]`` → the ``[B, N, N]`` bool mask."""
    if (tree_mask is None) == (parents is None):
        raise ValueError("give exactly one of tree_mask [B, N, N] bool or parents [B, N] int")
    mask = ancestor_mask(parents) if tree_mask is None else tree_mask
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"tree_mask must be [B, N, N], got {tuple(mask.shape)}")
    return mask.bool()


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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [..., D]`` → ``(rms_norm(x + residual), x + residual)``; the sum is in x's dtype."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def local_experts(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``LocalExperts.forward`` as a function of its weights (:func:`model.moe.run_local_experts`):
    ``w_gate_up [E, 2I, H]`` (gate | up rows), ``w_down [E, H, I]``; ``inp.hidden [N, H]``, ``inp.slots [N, k]``
    (−1 = not local), ``inp.weights [N, k]``. Returns the weighted sum over each row's local experts ``[N, H]``."""
    from model.moe import run_local_experts  # here, not at the top: model.moe may come to import the kernel selector

    return run_local_experts(inp, w_gate_up, w_down)
