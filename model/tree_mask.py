"""The ancestor-only attention mask of a flattened draft tree, shared by the tree builders, the tree-verify kernels
and their references."""

from __future__ import annotations

import torch


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """``parents [..., N]`` (−1 for a root; children need not follow parents) → ``[..., N, N]`` bool, row i True at
    i and at every ancestor of i.

    ``max_depth`` steps up the tree (default ``N - 1``: any tree), each one scatter and one gather of fixed shape:
    no host synchronisation, so it runs inside a captured graph."""
    n = parents.shape[-1]
    steps = n - 1 if max_depth is None else max_depth
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(*parents.shape, n).clone()
    no_parent = torch.full_like(parents, n)
    hit = torch.zeros(*parents.shape, n + 1, dtype=torch.bool, device=parents.device)  # column n: "no ancestor"
    cur = parents.long()
    for _ in range(steps):
        hit.zero_().scatter_(-1, torch.where(cur >= 0, cur, no_parent)[..., None], True)
        mask |= hit[..., :n]
        cur = torch.where(cur >= 0, parents.long().gather(-1, cur.clamp(min=0)), -1)
    return mask


def resolve_tree_mask(tree_mask: torch.Tensor | None, parents: torch.Tensor | None) -> torch.Tensor:
    """Exactly one of ``tree_mask [B, N, N]`` bool or ``parents [B, N]`` → the ``[B, N, N]`` bool mask (the tree
    argument of the tree-verify kernels and their references)."""
    if (tree_mask is None) == (parents is None):
        raise ValueError("give exactly one of tree_mask [B, N, N] bool or parents [B, N] int")
    mask = ancestor_mask(parents) if tree_mask is None else tree_mask
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"tree_mask must be [B, N, N], got {tuple(mask.shape)}")
    return mask.bool()
