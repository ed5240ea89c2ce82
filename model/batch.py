"""What one model forward needs: packed tokens of several sequences, and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class KVContext(Protocol):
    """Stores this step's per-token KV entries and hands back each sequence's full (past + new) entries.

    ``entries`` are tensors with tokens in dim 0 (MLA: latent ``[T, L]`` and rope key ``[T, R]``;
    GQA: ``[T, kv_heads, D]`` K and V). ``mask(i)`` is sequence i's ``[n_i, m_i]`` bool mask, or None
    for plain causal attention.
    """

    decode_only: bool  # every sequence feeds one token with causal attention: the padded path applies

    def store_and_gather(self, layer: int, entries: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]: ...

    def store_and_gather_padded(self, layer: int, entries: tuple[torch.Tensor, ...]
                                ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Decode only: each entry kind as ``[B, M, ...]`` (M = longest context), and ``valid [B, M]`` bool."""
        ...

    def mask(self, seq: int) -> torch.Tensor | None: ...


@dataclass
class NoCache:
    """Every sequence is complete in this batch (one causal forward, e.g. ``scripts/logits.py``)."""

    query_lens: list[int]
    decode_only: bool = False

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
