"""What one model forward needs: packed tokens of several sequences, and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class PaddedContext:
    """Few-query steps (decode, tree verify): every sequence's cached + new entries padded to the longest.

    ``entries``: each entry kind as ``[B, M, ...]`` (M = longest context incl. this step's tokens);
    ``mask [B, N, M]`` bool, which cached entries each query sees (N = longest query; a padding query sees
    entry 0 only, so its softmax stays finite); ``to_padded [T]``: packed query row t is padded row
    ``to_padded[t]`` of ``B*N`` (None when the packed rows already are the padded rows, e.g. plain decode).
    """

    entries: tuple[torch.Tensor, ...]
    mask: torch.Tensor
    to_padded: torch.Tensor | None

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` packed queries → ``[B, N, ...]``."""
        b, n = self.mask.shape[:2]
        if self.to_padded is None:
            return q.view(b, n, *q.shape[1:])
        out = q.new_zeros(b * n, *q.shape[1:])
        out[self.to_padded] = q
        return out.view(b, n, *q.shape[1:])

    def unpad(self, o: torch.Tensor) -> torch.Tensor:
        """``[B, N, ...]`` → ``[T, ...]`` packed rows."""
        flat = o.reshape(-1, *o.shape[2:])
        return flat if self.to_padded is None else flat[self.to_padded]


def paged_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The paged layout in one line: token position ``p`` of a sequence lives in slot
    ``block_table[p // block_size] * block_size + p % block_size`` of the flat cache. ``block_tables [..., M]``
    (one table ``[M]`` or a batch ``[B, M]``), ``positions [L]`` int64 → int64 slots ``[..., L]``."""
    return block_tables[..., positions // block_size].long() * block_size + positions % block_size


@dataclass
class PagedTables:
    """What the paged-attention kernels read besides the layer's flat cache tensors (``KVContext.store``
    returns those): ``block_tables [B, max_blocks]`` int32, ``context_lens [B]`` int32 (cached keys incl. this step's
    tokens, which are the last N of each sequence), ``tree_mask [B, N, N]`` bool (None: decode, N = 1).
    Fixed shapes, device tensors: a step built on these is CUDA-graph safe."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    tree_mask: torch.Tensor | None
    block_size: int

    @property
    def num_queries(self) -> int:
        return 1 if self.tree_mask is None else self.tree_mask.shape[1]


class KVContext(Protocol):
    """Stores this step's per-token KV entries and hands back each sequence's full (past + new) entries.

    ``entries`` are tensors with tokens in dim 0 (MLA: latent ``[T, L]`` and rope key ``[T, R]``;
    GQA: ``[T, kv_heads, D]`` K and V). ``mask(i)`` is sequence i's ``[n_i, m_i]`` bool mask, or None
    for plain causal attention.
    """

    padded: bool  # every sequence feeds one causal token or a masked tree: the padded few-query path applies
    tables: PagedTables | None  # set: attention runs the paged kernels on the cache (``store`` + tables)

    def store_and_gather(self, layer: int, entries: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]: ...

    def store_and_gather_padded(self, layer: int, entries: tuple[torch.Tensor, ...]) -> PaddedContext:
        """Only when ``padded``: the whole batch's entries in one padded gather."""
        ...

    def mask(self, seq: int) -> torch.Tensor | None: ...

    def store(self, layer: int, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Writes this step's entries and returns the layer's flat cache tensors (``tables`` path)."""
        ...


@dataclass
class NoCache:
    """Every sequence is complete in this batch (one causal forward, e.g. ``scripts/logits.py``)."""

    query_lens: list[int]
    padded: bool = False
    tables: PagedTables | None = None

    def store_and_gather(self, layer, entries):
        parts = [e.split(self.query_lens) for e in entries]
        return list(zip(*parts, strict=True)) if self.query_lens else []

    def mask(self, seq):
        return None


@dataclass
class ForwardBatch:
    """Packed tokens: ``input_ids [T]`` int64, ``positions [T]`` int64, sequence i owns
    ``query_lens[i]`` consecutive tokens."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    kv: KVContext = field(default=None)

    def __post_init__(self) -> None:
        if self.kv is None:
            self.kv = NoCache(self.query_lens)

    @staticmethod
    def from_sequences(seqs: list[list[int]]) -> ForwardBatch:
        """Full causal forward over token lists (positions from 0)."""
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
        pos = torch.tensor([p for s in seqs for p in range(len(s))], dtype=torch.int64)
        return ForwardBatch(ids, pos, [len(s) for s in seqs])
