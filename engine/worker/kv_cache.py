"""Paged KV cache: fixed-size blocks, per-sequence block tables, exact block accounting.

Per layer the cache holds one flat tensor per KV entry kind, ``[num_blocks * kv_block_size, *entry_shape]``:
MLA stores the normed latent ``[kv_lora]`` and the roped key ``[rope_dim]`` once per token (replicated
over attention-TP ranks); GQA stores K and V ``[local_kv_heads, head_dim]``. Token ``p`` of a sequence
lives in slot ``block_table[p // kv_block_size] * kv_block_size + p % kv_block_size`` (``engine.blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.blocks import token_slot_tensor, token_slots
from engine.staging import to_device
from model.batch import PaddedContext
from model.transformer import CausalLM


@dataclass(frozen=True)
class KVSpec:
    """Per-token entry shapes of every layer, for one rank."""

    entry_shapes: tuple[tuple[int, ...], ...]
    num_layers: int
    dtype: torch.dtype = torch.float32

    @staticmethod
    def for_model(model: CausalLM) -> KVSpec:
        cfg = model.cfg
        dtype = model.dtype
        if cfg.mla is not None:
            shapes = ((cfg.mla.kv_lora_rank,), (cfg.mla.qk_rope_head_dim,))
        else:
            kv_heads = model.model.layers[0].self_attn.kv_heads
            shapes = ((kv_heads, cfg.head_dim), (kv_heads, cfg.head_dim))
        return KVSpec(shapes, cfg.num_layers, dtype)

    def bytes_per_token(self) -> int:
        per_layer = sum(int(torch.tensor(s).prod()) for s in self.entry_shapes)
        return per_layer * self.num_layers * torch.tensor([], dtype=self.dtype).element_size()


class PagedKVCache:
    """The cache tensors of one rank."""

    def __init__(self, spec: KVSpec, num_blocks: int, kv_block_size: int, device: torch.device | str = "cpu"):
        self.spec, self.num_blocks, self.kv_block_size = spec, num_blocks, kv_block_size
        self.device = torch.device(device)
        slots = num_blocks * kv_block_size
        self.layers = [tuple(torch.zeros(slots, *shape, dtype=spec.dtype, device=device)
                             for shape in spec.entry_shapes) for _ in range(spec.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Stores ``entries`` (tokens in dim 0) at ``slots [T]`` of ``layer``; returns that layer's tensors."""
        stores = self.layers[layer]
        for store, new in zip(stores, entries, strict=True):
            store.index_copy_(0, slots, new.to(store.dtype))
        return stores

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the entries of block ``src`` into block ``dst`` for each ``(src, dst)`` (a forked request's partial
        last block, ``engine.core.kv_manager.KVManager.fork``), every layer."""
        if not pairs:
            return
        bs = self.kv_block_size
        offsets = torch.arange(bs, device=self.device)
        src = (torch.tensor([a for a, _ in pairs], device=self.device)[:, None] * bs + offsets).reshape(-1)
        dst = (torch.tensor([b for _, b in pairs], device=self.device)[:, None] * bs + offsets).reshape(-1)
        for stores in self.layers:
            for store in stores:
                store.index_copy_(0, dst, store.index_select(0, src))

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slot ids of token positions ``[start, end)`` of a sequence, host ints (:func:`engine.blocks.token_slots`)."""
        return token_slots(block_table, start, end, self.kv_block_size)

    def slot_tensor(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """:meth:`slots` as an int64 tensor ``[end - start]`` on the cache's device, computed there."""
        return token_slot_tensor(block_table, start, end, self.kv_block_size, self.device)


@dataclass
class SeqSlots:
    """One sequence in a step: its block table, tokens already cached, and tokens fed now."""

    block_table: list[int]
    start: int
    query_len: int
    mask: torch.Tensor | None = None  # [query_len, start + query_len] bool, None = causal


class PagedKV:
    """KVContext over a PagedKVCache for one forward: writes this step's entries, reads each sequence's
    cached prefix + new entries."""

    tables = None  # the dynamic path gathers entries itself; no paged-kernel tables

    def __init__(self, cache: PagedKVCache, seqs: list[SeqSlots]):
        self.cache, self.seqs = cache, seqs
        self.device = dev = cache.device
        self.padded = bool(seqs) and all(s.query_len == 1 or s.mask is not None for s in seqs)
        reads = [cache.slots(s.block_table, 0, s.start + s.query_len) for s in seqs]
        self.write = to_device([slot for s, r in zip(seqs, reads, strict=True) for slot in r[s.start:]],
                               torch.int64, dev)
        if self.padded:  # one padded gather for the whole batch
            self._pad_layout(reads)
        else:
            self.read = [to_device(r, torch.int64, dev) for r in reads]

    def _pad_layout(self, reads: list[list[int]]) -> None:
        longest, n = max(len(r) for r in reads), max(s.query_len for s in self.seqs)
        dev = self.device
        self.read_padded = to_device([r + [0] * (longest - len(r)) for r in reads], torch.int64, dev)
        lens = to_device([len(r) for r in reads], torch.int64, dev)
        query_lens = to_device([s.query_len for s in self.seqs], torch.int64, dev)
        mask = torch.zeros(len(reads), n, longest, dtype=torch.bool, device=dev)
        mask[:, 0] = torch.arange(longest, device=dev)[None, :] < lens[:, None]  # a causal token sees its context
        mask[:, :, 0] |= torch.arange(n, device=dev)[None, :] >= query_lens[:, None]  # padding queries: entry 0
        for b, (s, r) in enumerate(zip(self.seqs, reads, strict=True)):
            if s.mask is not None:  # a tree's own mask
                mask[b, :s.query_len, :len(r)] = s.mask
        self.padded_mask = mask
        self.to_padded = None if all(s.query_len == n for s in self.seqs) else to_device(
            [b * n + i for b, s in enumerate(self.seqs) for i in range(s.query_len)], torch.int64, dev)

    def store(self, layer, entries):
        return self.cache.write(layer, self.write, entries)

    def store_and_gather(self, layer, entries):
        stores = self.store(layer, entries)
        return [tuple(store.index_select(0, r) for store in stores) for r in self.read]

    def store_and_gather_padded(self, layer, entries):
        stores = self.store(layer, entries)
        b, m = self.read_padded.shape
        flat = self.read_padded.reshape(-1)
        gathered = tuple(s.index_select(0, flat).view(b, m, *s.shape[1:]) for s in stores)
        return PaddedContext(gathered, self.padded_mask, self.to_padded)

    def mask(self, seq):
        m = self.seqs[seq].mask
        return None if m is None else m.to(self.device)
