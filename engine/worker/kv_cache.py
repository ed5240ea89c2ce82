"""Paged KV cache: fixed-size blocks, per-sequence block tables, exact block accounting, layer groups over one set
of blocks, and blocks as byte regions.

A cache holds one or more *layer groups* (:class:`KVCacheSpec`): the target model's layers (``"target"``) and, with
speculative decoding, the drafter's context layers (``"drafter"``). Every group has every block: a request's block
table addresses its KV in all groups at once, so a fork's block copy, a block read out or written in, and the
cache's size per token are each done once, over all groups. Per layer a group holds one flat tensor per KV entry
kind, ``[num_blocks * kv_block_size, *entry_shape]``: MLA stores the normed latent ``[kv_lora]`` and the roped key
``[rope_dim]`` once per token (replicated over attention-TP ranks); GQA (and the drafter) store K and V
``[local_kv_heads, head_dim]``. Token ``p`` of a sequence lives in slot ``block_table[p // kv_block_size] *
kv_block_size + p % kv_block_size`` (``engine.blocks``).

The layout stays layer-major (one tensor per layer and entry kind, as the paged-attention kernels index it): block
``b`` is one contiguous byte region per group, layer and entry kind (:meth:`PagedKVCache.regions`), fixed for the
life of the process — what a host tier copies and a transfer engine registers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.blocks import token_slot_tensor, token_slots
from engine.staging import to_device
from model.batch import PaddedContext
from model.transformer import CausalLM

TARGET, DRAFTER = "target", "drafter"


@dataclass(frozen=True)
class KVSpec:
    """Per-token entry shapes of every layer of one layer group, for one rank. ``replicated``: the group's entries
    are the same on every attention-TP rank (MLA's latent, the unsharded drafter), so one rank's copy serves all."""

    entry_shapes: tuple[tuple[int, ...], ...]
    num_layers: int
    dtype: torch.dtype = torch.float32
    replicated: bool = False

    @staticmethod
    def for_model(model: CausalLM) -> KVSpec:
        cfg = model.cfg
        dtype = model.dtype
        if cfg.mla is not None:
            return KVSpec(((cfg.mla.kv_lora_rank,), (cfg.mla.qk_rope_head_dim,)), cfg.num_layers, dtype, True)
        kv_heads = model.model.layers[0].self_attn.kv_heads  # this rank's (sharded, or some heads repeated)
        return KVSpec(((kv_heads, cfg.head_dim), (kv_heads, cfg.head_dim)), cfg.num_layers, dtype)

    def bytes_per_token(self) -> int:
        per_layer = sum(int(torch.tensor(s).prod()) for s in self.entry_shapes)
        return per_layer * self.num_layers * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    """The layer groups of one rank's cache, in order: ``(name, KVSpec)`` pairs over the same blocks."""

    groups: tuple[tuple[str, KVSpec], ...]

    @staticmethod
    def of(target: KVSpec, drafter: KVSpec | None = None) -> KVCacheSpec:
        """The target's group, then the drafter context's when there is one."""
        return KVCacheSpec(((TARGET, target),) + (((DRAFTER, drafter),) if drafter is not None else ()))

    def bytes_per_token(self) -> int:
        """This rank's KV bytes per token over every group (the KV budget's unit)."""
        return sum(spec.bytes_per_token() for _, spec in self.groups)


@dataclass(frozen=True)
class ByteRegion:
    """``length`` bytes at ``address`` on the cache's device: one block's share of one layer's entry tensor."""

    address: int
    length: int


class KVGroup:
    """One layer group's tensors in a :class:`PagedKVCache`: ``layers[l]`` is layer ``l``'s entry tensors
    ``[num_blocks * kv_block_size, *entry_shape]``, addressed by the cache's block tables."""

    def __init__(self, spec: KVSpec, num_blocks: int, kv_block_size: int, device: torch.device):
        self.spec, self.num_blocks, self.kv_block_size, self.device = spec, num_blocks, kv_block_size, device
        slots = num_blocks * kv_block_size
        self.layers = [tuple(torch.zeros(slots, *shape, dtype=spec.dtype, device=device)
                             for shape in spec.entry_shapes) for _ in range(spec.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Stores ``entries`` (tokens in dim 0) at ``slots [T]`` of ``layer``; returns that layer's tensors."""
        stores = self.layers[layer]
        for store, new in zip(stores, entries, strict=True):
            store.index_copy_(0, slots, new.to(store.dtype))
        return stores

    def stores(self) -> list[torch.Tensor]:
        """Every entry tensor of the group, layer by layer."""
        return [store for stores in self.layers for store in stores]


class PagedKVCache:
    """The cache tensors of one rank: every layer group of ``spec`` (a bare :class:`KVSpec` is the target's only)
    over ``num_blocks`` blocks of ``kv_block_size`` tokens. :attr:`layers` and :meth:`write` are the target's."""

    def __init__(self, spec: KVCacheSpec | KVSpec, num_blocks: int, kv_block_size: int,
                 device: torch.device | str = "cpu"):
        spec = spec if isinstance(spec, KVCacheSpec) else KVCacheSpec.of(spec)
        self.num_blocks, self.kv_block_size = num_blocks, kv_block_size
        self.device = torch.device(device)
        self.groups = {name: KVGroup(s, num_blocks, kv_block_size, self.device) for name, s in spec.groups}
        self.layers = self.groups[TARGET].layers

    @property
    def cache_spec(self) -> KVCacheSpec:
        """The groups this cache holds now, in order."""
        return KVCacheSpec(tuple((name, g.spec) for name, g in self.groups.items()))

    def group(self, name: str, spec: KVSpec) -> KVGroup:
        """Layer group ``name`` with entries ``spec``: the one the cache was built with (its spec must match), or
        a new group over the same blocks for a cache built without it (callers that build a speculative decoder
        over a target-only cache)."""
        found = self.groups.get(name)
        if found is None:
            found = self.groups[name] = KVGroup(spec, self.num_blocks, self.kv_block_size, self.device)
        elif found.spec != spec:
            raise ValueError(f"KV layer group {name!r} was built as {found.spec}, asked for {spec}")
        return found

    def write(self, layer: int, slots: torch.Tensor, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Stores the target's ``entries`` (tokens in dim 0) at ``slots [T]`` of ``layer``; returns its tensors."""
        return self.groups[TARGET].write(layer, slots, entries)

    def _stores(self) -> list[torch.Tensor]:
        """Every entry tensor of every group: groups in order, then layers, then entry kinds."""
        return [store for g in self.groups.values() for store in g.stores()]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the entries of block ``src`` into block ``dst`` for each ``(src, dst)`` (a forked request's partial
        last block, ``engine.core.kv_manager.KVManager.fork``), every layer of every group."""
        if not pairs:
            return
        bs = self.kv_block_size
        offsets = torch.arange(bs, device=self.device)
        src = (torch.tensor([a for a, _ in pairs], device=self.device)[:, None] * bs + offsets).reshape(-1)
        dst = (torch.tensor([b for _, b in pairs], device=self.device)[:, None] * bs + offsets).reshape(-1)
        for store in self._stores():
            store.index_copy_(0, dst, store.index_select(0, src))

    # ---- blocks as byte regions ------------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Bytes of one block over every group (the row width of :meth:`read_blocks`' buffer)."""
        return sum(self._block_view(store).shape[1] for store in self._stores())

    def block_views(self) -> list[torch.Tensor]:
        """Every entry tensor as raw bytes, one row per block (:meth:`read_blocks`' order): what a transfer engine
        registers."""
        return [self._block_view(store) for store in self._stores()]

    def _block_view(self, store: torch.Tensor) -> torch.Tensor:
        """``store`` as raw bytes, one row per block: ``[num_blocks, kv_block_size * entry bytes]`` uint8 (a view)."""
        return store.view(torch.uint8).view(self.num_blocks, -1)

    def replicated_bytes(self) -> torch.Tensor:
        """``[block_bytes()]`` bool: which bytes of a :meth:`read_blocks` row belong to a replicated group
        (:attr:`KVSpec.replicated`), the same on every attention-TP rank."""
        return torch.cat([torch.full((self._block_view(store).shape[1],), g.spec.replicated)
                          for g in self.groups.values() for store in g.stores()])

    def regions(self, block_ids: list[int]) -> list[list[ByteRegion]]:
        """Per block of ``block_ids``, its byte regions on the cache's device in :meth:`read_blocks`' order (groups,
        layers, entry kinds): each a contiguous ``kv_block_size`` tokens of one entry tensor."""
        self._check(block_ids)
        views = [self._block_view(store) for store in self._stores()]
        return [[ByteRegion(v.data_ptr() + b * v.stride(0), v.shape[1]) for v in views] for b in block_ids]

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The bytes of ``block_ids`` over every group, into ``out`` ``[len(block_ids), block_bytes()]`` uint8 (host
        memory; a new CPU tensor when None). Returns ``out``."""
        self._check(block_ids)
        if out is None:
            out = torch.empty(len(block_ids), self.block_bytes(), dtype=torch.uint8)
        if out.shape != (len(block_ids), self.block_bytes()) or out.dtype != torch.uint8:
            raise ValueError(f"read_blocks needs a uint8 buffer [{len(block_ids)}, {self.block_bytes()}], got "
                             f"{out.dtype} {list(out.shape)}")
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        at = 0
        for store in self._stores():
            view = self._block_view(store)
            out[:, at:at + view.shape[1]].copy_(view.index_select(0, index))
            at += view.shape[1]
        return out

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Writes ``data [len(block_ids), block_bytes()]`` uint8 (:meth:`read_blocks`' layout, any device) into
        ``block_ids``, every group."""
        self._check(block_ids)
        if data.shape != (len(block_ids), self.block_bytes()) or data.dtype != torch.uint8:
            raise ValueError(f"write_blocks needs uint8 [{len(block_ids)}, {self.block_bytes()}] (the layout of "
                             f"read_blocks), got {data.dtype} {list(data.shape)}")
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        at = 0
        for store in self._stores():
            view = self._block_view(store)
            view.index_copy_(0, index, data[:, at:at + view.shape[1]].to(self.device))
            at += view.shape[1]

    def checksum(self, block_id: int) -> str:
        """A digest (BLAKE2b, hex) of block ``block_id``'s bytes over every group: equal iff the bytes are."""
        return hashlib.blake2b(self.read_blocks([block_id]).numpy().tobytes(), digest_size=16).hexdigest()

    def _check(self, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"KV blocks {bad} are outside this cache's {self.num_blocks} blocks")

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
