"""The host-memory KV tier's index on rank 0: which block hashes each attention-DP rank's host slots hold, which
slots to evict, and the copies (device block → host slot) the ranks must make (``docs/kv_cache.md``, "Host tier").

- A slot holds one device block's bytes over every layer group (target and drafter), on each rank of the DP group
  (``engine.worker.kv_loads.HostPool``). The index is pure bookkeeping, like the device pool's.
- A hash enters the tier when the device pool evicts its block (``engine.host_kv_write=evict``) or when its block is
  committed (``through``); a store is queued for the ranks, run before the next step's forward (they keep the order
  of store, load and step on one copy thread).
- Eviction is LRU over unpinned slots; a slot whose block was retained on the device (a turn waiting on a tool) is
  evicted only after every plain slot, until its deadline. A slot being read by a load admission just started is
  pinned until the load is sent to the ranks, so a store of the same admission pass never overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class HostTier:
    """One attention-DP rank's host slots: hash → slot, LRU with retention and pins."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest id first
        self.index: dict[int, int] = {}  # hash → slot
        self.hash_of: dict[int, int] = {}  # slot → hash
        self.lru: OrderedDict[int, None] = OrderedDict()  # next to evict first
        self.retained: OrderedDict[int, float] = OrderedDict()  # slot → deadline; after every plain slot
        self.pinned: set[int] = set()
        self.stores: dict[int, int] = {}  # slot → device block queued for the ranks, in order (a slot's last copy)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.index)

    def prefix(self, hashes: list[int]) -> list[int]:
        """The slots of the longest prefix of ``hashes`` held here, pinned and made most recent (:meth:`unpin_all`
        once their load is sent)."""
        slots = []
        for h in hashes:
            slot = self.index.get(h)
            if slot is None:
                break
            slots.append(slot)
        for slot in slots:
            self.pinned.add(slot)
            self._touch(slot, None)
        return slots

    def unpin_all(self) -> None:
        self.pinned.clear()

    def put(self, block: int, block_hash: int, now: float, retain_until: float | None = None) -> bool:
        """Keeps ``block``'s bytes under ``block_hash``: queues the copy into a slot (evicting the least recent
        unpinned one when none is free); a hash already held is only made most recent. False when every slot is
        pinned (nothing stored)."""
        slot = self.index.get(block_hash)
        if slot is not None:
            self._touch(slot, retain_until)
            return True
        slot = self.free.pop() if self.free else self._evict(now)
        if slot is None:
            return False
        self.index[block_hash], self.hash_of[slot] = slot, block_hash
        self._touch(slot, retain_until)
        self.stores.pop(slot, None)  # a slot taken again before the ranks copied into it keeps only its last copy
        self.stores[slot] = block
        return True

    def take_stores(self) -> list[tuple[int, int]]:
        """The copies queued since the last call, oldest first."""
        stores, self.stores = [(b, s) for s, b in self.stores.items()], {}
        return stores

    def _touch(self, slot: int, retain_until: float | None) -> None:
        if retain_until is not None or slot in self.retained:
            deadline = max(retain_until or 0.0, self.retained.pop(slot, 0.0))
            self.lru.pop(slot, None)
            self.retained[slot] = deadline
        else:
            self.lru.pop(slot, None)
            self.lru[slot] = None

    def _evict(self, now: float) -> int | None:
        """The least recent unpinned slot, emptied: plain ones first, then retained ones (expired first)."""
        for slot, deadline in list(self.retained.items()):
            if deadline <= now:
                del self.retained[slot]
                self.lru[slot] = None
                self.lru.move_to_end(slot, last=False)
        victim = next((s for s in (*self.lru, *self.retained) if s not in self.pinned), None)
        if victim is None:
            return None
        self.lru.pop(victim, None)
        self.retained.pop(victim, None)
        h = self.hash_of.pop(victim)
        del self.index[h]
        self.evictions += 1
        return victim

    def clear(self) -> None:
        """Forgets every slot (``FlushCache``); queued stores go too."""
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.index.clear()
        self.hash_of.clear()
        self.lru.clear()
        self.retained.clear()
        self.pinned.clear()
        self.stores.clear()

    def consistent(self) -> bool:
        """Every slot free or holding exactly one hash, in exactly one of LRU and retained (the tests' check)."""
        held = [*self.lru, *self.retained]
        return (len(set(held)) == len(held) == len(self.index) == len(self.hash_of)
                and len(self.free) + len(held) == self.num_slots and not set(self.free) & set(held)
                and all(self.index[h] == s for s, h in self.hash_of.items()))


@dataclass
class TierCounts:
    """A lower tier's admissions since start: prompt tokens asked for (past the tiers above it), tokens and blocks it
    served."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0

    def add(self, queried_tokens: int, hit_tokens: int, hit_blocks: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens
        self.hit_blocks += hit_blocks


@dataclass(frozen=True, kw_only=True)
class HostStats:
    """The host tier over every attention-DP rank: slots held and total, tokens asked for (prompt tokens past the
    device pool's hit) and served, blocks copied into the device pool (``load``) and out of it (``store``)."""

    blocks: int
    slots: int
    queried_tokens: int
    hit_tokens: int
    load_blocks: int
    store_blocks: int
    evictions: int


class HostTiers:
    """Every attention-DP rank's host tier (the KV manager's ``host``) and its counters since start."""

    def __init__(self, num_slots: int, dp_size: int, write: str, clock: Callable[[], float]):
        """``write``: "evict" (a block enters as the device pool evicts it) or "through" (once committed)."""
        self.tiers = [HostTier(num_slots) for _ in range(dp_size)]
        self.write, self.clock = write, clock
        self.queried = self.hits = self.loads = self.stores = 0  # tokens, tokens, blocks, blocks

    def spiller(self, dp: int) -> Callable[[int, int, float | None], None]:
        """The device pool's eviction hook on ``dp`` (``BlockPool.spill``): the evicted block goes to host."""
        return lambda block, block_hash, until: self.tiers[dp].put(block, block_hash, self.clock(), until)

    def committed(self, dp: int, blocks: list[int], hashes: list[int]) -> None:
        """Full blocks ``dp`` just indexed (``write=through``: each goes to host now)."""
        if self.write == "through":
            now = self.clock()
            for block, block_hash in zip(blocks, hashes, strict=True):
                self.tiers[dp].put(block, block_hash, now)

    def prefix(self, dp: int, hashes: list[int]) -> list[int]:
        """The slots of ``dp`` holding the longest prefix of ``hashes`` (those past the device pool's hit), pinned
        until :meth:`take_stores`."""
        return self.tiers[dp].prefix(hashes)

    def held(self, dp: int, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that ``dp``'s tier holds (a peek: nothing pinned or touched)."""
        index = self.tiers[dp].index
        return next((i for i, h in enumerate(hashes) if h not in index), len(hashes))

    def admitted(self, queried_tokens: int, hit_tokens: int, hit_blocks: int) -> None:
        """An admission asked for ``queried_tokens`` past the device hit and loads ``hit_blocks`` from host."""
        self.queried += queried_tokens
        self.hits += hit_tokens
        self.loads += hit_blocks

    def take_stores(self, dp: int) -> list[tuple[int, int]]:
        """The copies ``(device block, host slot)`` queued on ``dp`` since the last call, for the ranks to run before
        the next step; the admission pass's pins end here."""
        tier = self.tiers[dp]
        tier.unpin_all()
        stores = tier.take_stores()
        self.stores += len(stores)
        return stores

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def stats(self) -> HostStats:
        return HostStats(blocks=sum(len(t) for t in self.tiers), slots=sum(t.num_slots for t in self.tiers),
                         queried_tokens=self.queried, hit_tokens=self.hits, load_blocks=self.loads,
                         store_blocks=self.stores, evictions=sum(t.evictions for t in self.tiers))
