"""The one owner of KV blocks between the scheduler and the pools: ref-counted blocks per attention-DP rank, the
prefix index, LRU eviction and retention, and the events that describe the index (``docs/kv_cache.md``).

- A block is *empty* (free, holding nothing reusable), *referenced* (in some request's block table), or *cached and
  evictable* (unreferenced, its KV still valid, findable by its hash). Allocation takes empty blocks first, then
  evicts cached ones least recently used first (a request's tail blocks first: they are freed last-block-first).
- Only full blocks of *committed* tokens are hashed — tokens whose target and drafter KV are written — keyed by a
  chained 128-bit hash of (parent hash, the block's token ids, the namespace). A hit never covers the block that
  holds the prompt's last token (its logits are computed), so a request writes only into blocks of its own: shared
  blocks are never written.
- Retention: a block freed by a request that asked to be retained (an agent waiting on a tool) is evicted only after
  every plain-LRU block, until its deadline passes.
- The host tier (``engine.host_kv_cache_gb`` > 0, ``engine/core/host_tier.py``): evicted blocks (or, with
  ``engine.host_kv_write=through``, committed ones) are copied to host slots by hash; an admission whose prefix
  continues past the device pool in the host tier loads those blocks back through the loading state.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from engine.blocks import blocks_for
from engine.core.host_tier import HostStats, HostTiers, TierCounts

NO_PARENT = 0


def chain_hash(parent: int, tokens: tuple[int, ...], namespace: bytes) -> int:
    """The 128-bit hash of one full block: ``parent`` (the previous block's hash, :data:`NO_PARENT` for the first),
    the block's token ids and the namespace (model, drafter, KV dtype, numerics, layout)."""
    h = hashlib.blake2b(namespace, digest_size=16)
    h.update(parent.to_bytes(16, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest(), "little")


def index_digest(wire_hashes: Iterable[int]) -> str:
    """A digest of a set of block hashes (the engine's index, or what a subscriber rebuilt from the events)."""
    return hashlib.sha1(",".join(map(str, sorted(wire_hashes))).encode()).hexdigest()[:16]


def wire_hash(block_hash: int) -> int:
    """The int64 a ``KvBlock.block_hash`` carries: the low 64 bits of the 128-bit hash, two's complement."""
    low = block_hash & (2**64 - 1)
    return low - 2**64 if low >= 2**63 else low


@dataclass(frozen=True)
class KvEvent:
    """One change of a pool's index: ``kind`` "stored" (``hashes`` with their ``parent`` and ``tokens``), "removed"
    (``hashes``) or "cleared". ``tier`` "device" (this worker's pool) or "store" (blocks written to the shared store,
    announced when their writes are sent to the ranks; the store drops blocks without telling, so none is removed)."""

    kind: str
    dp_rank: int
    hashes: tuple[int, ...] = ()
    parent: int = NO_PARENT
    tokens: tuple[tuple[int, ...], ...] = ()
    tier: str = "device"


@dataclass
class RequestBlocks:
    """A request's share of a pool: its block table, and the hashes of its leading committed full blocks."""

    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    retain: bool = False  # its blocks are retained past plain LRU when freed


class BlockPool:
    """One attention-DP rank's blocks. Pure bookkeeping (rank 0 keeps one per attention-DP rank)."""

    def __init__(self, num_blocks: int, kv_block_size: int, dp_rank: int, emit: Callable[[KvEvent], None],
                 spill: Callable[[int, int, float | None], None] | None = None):
        """``spill(block, hash, retained until or None)``: called for every cached block evicted, before its id is
        handed out again (the host tier keeps its bytes)."""
        self.num_blocks, self.kv_block_size, self.dp_rank, self.emit = num_blocks, kv_block_size, dp_rank, emit
        self.spill = spill
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # block → its hash, for cached blocks (referenced or not)
        self.index: dict[int, int] = {}  # hash → block
        self.empty = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest id first
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, next to evict first
        self.retained: OrderedDict[int, float] = OrderedDict()  # unreferenced cached blocks kept until a deadline
        self.evictions = 0

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty plus cached-unreferenced."""
        return len(self.empty) + len(self.lru) + len(self.retained)

    @property
    def num_empty(self) -> int:
        """Blocks that hold no cached KV."""
        return len(self.empty)

    @property
    def num_used(self) -> int:
        """Referenced blocks (the non-evictable usage)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.index)

    # ---- prefix index ------------------------------------------------------------------------------------
    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` in the index."""
        blocks = []
        for h in hashes:
            b = self.index.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def take(self, blocks: list[int]) -> None:
        """References cached ``blocks`` (a prefix hit)."""
        for b in blocks:
            if self.refs[b] == 0:
                self.lru.pop(b, None)
                self.retained.pop(b, None)
            self.refs[b] += 1

    def store(self, block: int, block_hash: int, parent: int, tokens: tuple[int, ...]) -> bool:
        """Indexes a referenced full block under ``block_hash``; False when that hash is already cached (in another
        block: this one stays private)."""
        if block_hash in self.index:
            return False
        self.index[block_hash], self.hash_of[block] = block, block_hash
        self.emit(KvEvent("stored", self.dp_rank, (block_hash,), parent, (tokens,)))
        return True

    # ---- allocation --------------------------------------------------------------------------------------
    def allocate(self, n: int, now: float) -> list[int] | None:
        """``n`` blocks, referenced once each (empty ones first, then evicting); None when fewer are free."""
        if n > self.num_free:
            return None
        self._expire(now)
        out = []
        while len(out) < n:
            b = self.empty.pop() if self.empty else self._evict()
            self.refs[b] = 1
            out.append(b)
        return out

    def _evict(self) -> int:
        b, until = (self.lru.popitem(last=False)[0], None) if self.lru else self.retained.popitem(last=False)
        h = self.hash_of.pop(b)
        del self.index[h]
        self.evictions += 1
        self.emit(KvEvent("removed", self.dp_rank, (h,)))
        if self.spill is not None:
            self.spill(b, h, until)
        return b

    def _expire(self, now: float) -> None:
        """Retained blocks past their deadline join the LRU (the oldest first)."""
        while self.retained and next(iter(self.retained.values())) <= now:
            self.lru[self.retained.popitem(last=False)[0]] = None

    def release(self, blocks: list[int], retain_until: float | None) -> None:
        """Drops one reference of each of ``blocks`` (a request's table, freed last block first: its tail is then
        evicted first). Unreferenced cached blocks become evictable, the rest empty."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b]:
                continue
            if b not in self.hash_of:
                self.empty.append(b)
            elif retain_until is not None:
                self.retained[b] = retain_until
            else:
                self.lru[b] = None

    def consistent(self) -> bool:
        """Every block in exactly one state — empty, cached-evictable or referenced — and the index matching the
        cached blocks (the tests' leak and double-free check)."""
        free = self.empty + list(self.lru) + list(self.retained)
        referenced = [b for b in range(self.num_blocks) if self.refs[b] > 0]
        evictable = (*self.lru, *self.retained)
        return (len(set(free)) == len(free) and len(free) + len(referenced) == self.num_blocks
                and all(self.refs[b] == 0 for b in free) and all(self.index[h] == b for b, h in self.hash_of.items())
                and len(self.index) == len(self.hash_of) and all(b in self.hash_of for b in evictable))

    def clear(self) -> bool:
        """Forgets every cached block (``FlushCache``); False, changing nothing, while any block is referenced."""
        if self.num_used:
            return False
        self.empty = list(range(self.num_blocks - 1, -1, -1))
        self.index.clear()
        self.hash_of.clear()
        self.lru.clear()
        self.retained.clear()
        self.emit(KvEvent("cleared", self.dp_rank))
        return True


@dataclass(frozen=True, kw_only=True)
class PoolStats:
    """One attention-DP rank's pool: referenced, cached (indexed) and free (empty or evictable) blocks."""

    blocks_used: int
    blocks_cached: int
    blocks_free: int
    blocks_total: int
    index_digest: str  # of its index's wire hashes


@dataclass(frozen=True, kw_only=True)
class KVStats:
    """The KV manager at one moment (:meth:`KVManager.stats`); token counts since start."""

    prompt_tokens: int
    cached_tokens: int  # from the device pool
    hit_rate: float
    evictions: int
    index_digest: str  # of every pool's index
    per_dp: tuple[PoolStats, ...]
    host: HostStats | None = None  # the host tier (None: off)


@dataclass(frozen=True, kw_only=True)
class KVManagerConfig:
    num_blocks: int
    kv_block_size: int
    dp_size: int
    prefix_caching: bool = True
    retention_s: float = 0.0  # how long a retained request's blocks outlive plain LRU
    namespace: bytes = b""
    host_slots: int = 0  # per attention-DP rank: the host tier's blocks (0: no host tier)
    host_write: str = "evict"  # when a block enters the host tier: "evict" (leaving the device) or "through"
    store: bool = False  # a shared KV store: every committed full block is written to it


class KVRequest(Protocol):
    """What the KV manager reads of a request (``engine.core.requests.Request``)."""

    request_id: str
    dp_rank: int | None
    retain_kv: bool
    hashes: list[int] | None
    kv_origin: str  # "" or where its prompt's KV was made, when not here (its blocks are indexed apart)

    @property
    def tokens(self) -> list[int]: ...

    @property
    def feed_tokens(self) -> list[int]: ...


class PrefixIndex:
    """Prefix caching on: full blocks of committed tokens are keyed by chained hashes under a namespace."""

    def __init__(self, block_size: int, namespace: bytes):
        self.block_size, self.namespace = block_size, namespace

    def space(self, origin: str) -> bytes:
        """The namespace of blocks whose prompt KV was made under ``origin`` (another engine's cache namespace, a
        prefill worker of another layout): apart from this engine's own (``""``), so they never serve its requests."""
        return self.namespace + f"|prompt KV made under {origin}".encode() if origin else self.namespace

    def hashes(self, tokens: list[int], origin: str = "") -> list[int]:
        """Chained hashes of the full blocks of ``tokens`` that a hit may cover: never the block holding the last
        token, whose logits must be computed."""
        bs, out, parent, space = self.block_size, [], NO_PARENT, self.space(origin)
        for i in range((len(tokens) - 1) // bs):
            parent = chain_hash(parent, tuple(tokens[i * bs:(i + 1) * bs]), space)
            out.append(parent)
        return out

    def index(self, pool: BlockPool, blocks: RequestBlocks, tokens: list[int], committed: int,
              origin: str = "") -> None:
        """Hashes every full block the first ``committed`` of ``tokens`` complete and stores it in ``pool``."""
        bs, space = self.block_size, self.space(origin)
        for i in range(len(blocks.hashes), min(committed // bs, len(blocks.table))):
            parent = blocks.hashes[-1] if blocks.hashes else NO_PARENT
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, block_tokens, space)
            blocks.hashes.append(h)
            if blocks.table[i] not in pool.hash_of:
                pool.store(blocks.table[i], h, parent, block_tokens)


class NoPrefixIndex(PrefixIndex):
    """Prefix caching off (``engine.prefix_caching=false``): no request has a hash, so none hits, and nothing is
    indexed."""

    def hashes(self, tokens: list[int], origin: str = "") -> list[int]:
        return []

    def index(self, pool: BlockPool, blocks: RequestBlocks, tokens: list[int], committed: int,
              origin: str = "") -> None:
        return None


class KVManager:
    """Per attention-DP rank pools and every request's blocks. The scheduler asks it for blocks (:meth:`admit`,
    :meth:`allocate`, :meth:`free`) and tells it which tokens are committed (:meth:`commit`); each takes the request
    (a :class:`KVRequest`), whose prefix hashes live on it (:meth:`hashes`)."""

    def __init__(self, cfg: KVManagerConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.index = (PrefixIndex if cfg.prefix_caching else NoPrefixIndex)(cfg.kv_block_size, cfg.namespace)
        self.recording = False  # keep events for a publisher (the server's SubscribeKvEvents) to drain
        self.events: list[KvEvent] = []
        on = cfg.host_slots > 0 and cfg.prefix_caching
        self.host = HostTiers(cfg.host_slots, cfg.dp_size, cfg.host_write, clock) if on else None
        spill = on and cfg.host_write == "evict"
        self.pools = [BlockPool(cfg.num_blocks, cfg.kv_block_size, dp, self._record,
                                self.host.spiller(dp) if spill else None) for dp in range(cfg.dp_size)]
        self.requests: dict[str, RequestBlocks] = {}
        self.prompt_tokens = self.cached_tokens = 0  # admissions' prompt tokens, and those served from the cache
        self.prompt_by_dp, self.cached_by_dp = [0] * cfg.dp_size, [0] * cfg.dp_size  # the same per pool
        # the shared store: per DP rank, committed (block, hash) to write; and its admissions' figures
        self.store_writes = [[] for _ in range(cfg.dp_size)] if cfg.store and cfg.prefix_caching else None
        self.store_counts = TierCounts()

    def _record(self, event: KvEvent) -> None:
        if self.recording:
            self.events.append(event)

    # ---- lookups -----------------------------------------------------------------------------------------
    def hashes(self, req: KVRequest) -> list[int]:
        """``req``'s prefix-block hashes, computed once from its feed tokens (none with prefix caching off), under
        its KV's origin (:meth:`PrefixIndex.space`)."""
        if req.hashes is None:
            req.hashes = self.index.hashes(req.feed_tokens, req.kv_origin)
        return req.hashes

    def cached_blocks(self, dp: int, hashes: list[int]) -> int:
        """Blocks of ``hashes`` that ``dp``'s pool holds, from the first."""
        return len(self.pools[dp].cached_prefix(hashes))

    def prefix_blocks(self, dp: int, tokens: list[int]) -> list[int]:
        """The blocks of ``dp``'s pool that hold the leading full blocks of ``tokens``, from the first (none with
        prefix caching off)."""
        return self.pools[dp].cached_prefix(self.index.hashes(tokens))

    def num_free(self, dp: int) -> int:
        """Blocks ``dp``'s pool can hand out now (empty or cached unreferenced)."""
        return self.pools[dp].num_free

    # ---- admission and growth ------------------------------------------------------------------------------
    def admit(self, req: KVRequest, dp: int, reserve: int, host_blocks: int = 0, store_blocks: int = 0) -> int | None:
        """Starts ``req`` on ``dp``: takes its cached prefix and allocates what makes ``reserve`` token slots
        (``host_blocks`` of them past the device hit to be loaded from the host tier, then ``store_blocks`` from the
        shared store). Returns the tokens served from the device pool, or None (nothing taken) when the blocks are not
        free."""
        pool, hashes, tokens = self.pools[dp], self.hashes(req), req.feed_tokens
        hit = pool.cached_prefix(hashes)
        need = max(blocks_for(reserve, self.cfg.kv_block_size) - len(hit), 0)
        pool.take(hit)
        fresh = pool.allocate(need, self.clock())
        if fresh is None:
            pool.release(hit, None)
            return None
        self.requests[req.request_id] = RequestBlocks(hit + fresh, list(hashes[:len(hit)]), req.retain_kv)
        cached = len(hit) * self.cfg.kv_block_size
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        self.prompt_by_dp[dp] += len(tokens)
        self.cached_by_dp[dp] += cached
        bs = self.cfg.kv_block_size
        if self.host is not None:
            self.host.admitted(len(tokens) - cached, host_blocks * bs, host_blocks)
        if self.store_writes is not None:
            self.store_counts.add(len(tokens) - cached - host_blocks * bs, store_blocks * bs, store_blocks)
        return cached

    def allocate(self, req: KVRequest, slots: int) -> bool:
        """Grows ``req``'s table to ``slots`` token slots; False (nothing taken) when the blocks are not free."""
        table = self.requests[req.request_id].table
        need = blocks_for(slots, self.cfg.kv_block_size) - len(table)
        if need <= 0:
            return True
        fresh = self.pools[req.dp_rank].allocate(need, self.clock())
        if fresh is None:
            return False
        table += fresh
        return True

    def fork(self, parent: KVRequest, child: KVRequest, tokens: int) -> tuple[int, tuple[int, int] | None]:
        """``child`` starts from ``parent``'s first ``tokens`` computed tokens (``n > 1``: one prompt, n samples) on
        the parent's rank: it references the parent's full blocks (ref-counted, shared, never written again) and gets
        a fresh block for the partial last one, whose entries the ranks copy. Returns ``(tokens the child has
        computed, (src, dst) block copy or None)``; with no free block for the copy the child has only the full blocks
        (it recomputes the rest)."""
        src, pool, bs = self.requests[parent.request_id], self.pools[parent.dp_rank], self.cfg.kv_block_size
        full = tokens // bs
        shared = src.table[:full]
        pool.take(shared)
        table, copy = list(shared), None
        if tokens % bs:
            fresh = pool.allocate(1, self.clock())
            if fresh is not None:
                table.append(fresh[0])
                copy = (src.table[full], fresh[0])
        self.requests[child.request_id] = RequestBlocks(table, list(src.hashes[:full]), src.retain)
        return (tokens if copy is not None else full * bs), copy

    def commit(self, req: KVRequest, committed: int) -> None:
        """The first ``committed`` of ``req``'s tokens have their target and drafter KV written: index every full
        block they complete."""
        blocks = self.requests.get(req.request_id)
        if blocks is None:
            return
        done = len(blocks.hashes)
        self.index.index(self.pools[req.dp_rank], blocks, req.tokens, committed, req.kv_origin)
        if self.host is not None:
            self.host.committed(req.dp_rank, blocks.table[done:len(blocks.hashes)], blocks.hashes[done:])
        if self.store_writes is not None and len(blocks.hashes) > done:
            new = blocks.hashes[done:]
            self.store_writes[req.dp_rank] += zip(blocks.table[done:len(blocks.hashes)], new, strict=True)
            bs = self.cfg.kv_block_size
            self._record(KvEvent("stored", req.dp_rank, tuple(new), blocks.hashes[done - 1] if done else NO_PARENT,
                                 tuple(tuple(req.tokens[i * bs:(i + 1) * bs]) for i in range(done, done + len(new))),
                                 tier="store"))

    def free(self, req: KVRequest) -> None:
        """Drops ``req``'s blocks (end, abort, preemption): committed full blocks stay cached."""
        blocks = self.requests.pop(req.request_id, None)
        if blocks is not None:
            retain = self.clock() + self.cfg.retention_s if blocks.retain and self.cfg.retention_s > 0 else None
            self.pools[req.dp_rank].release(blocks.table, retain)

    def table(self, req: KVRequest) -> list[int]:
        return self.requests[req.request_id].table

    def committed_blocks(self, req: KVRequest) -> int:
        """``req``'s leading full blocks whose KV is written and indexed (:meth:`commit`)."""
        return len(self.requests[req.request_id].hashes)

    def retain(self, req: KVRequest) -> None:
        """Keep ``req``'s blocks past plain LRU when it is freed (an agent turn that ended in a tool call)."""
        if req.request_id in self.requests:
            self.requests[req.request_id].retain = True

    # ---- admin and accounting -------------------------------------------------------------------------------
    def clear(self) -> bool:
        """Empties every pool's index (``FlushCache``); False, changing nothing, while a request holds blocks."""
        if any(p.num_used for p in self.pools):
            return False
        for pool in self.pools:
            pool.clear()
        if self.host is not None:
            self.host.clear()
        return True

    def drain_events(self) -> list[KvEvent]:
        out, self.events[:] = list(self.events), []
        return out

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens admitted."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def hit_rate_of(self, dp: int) -> float:
        """:attr:`hit_rate` of attention-DP rank ``dp``'s pool."""
        return self.cached_by_dp[dp] / self.prompt_by_dp[dp] if self.prompt_by_dp[dp] else 0.0

    def stats(self) -> KVStats:
        pools = self.pools
        per_dp = tuple(PoolStats(blocks_used=p.num_used, blocks_cached=p.num_cached, blocks_free=p.num_free,
                                 blocks_total=p.num_blocks, index_digest=index_digest(wire_hash(h) for h in p.index))
                       for p in pools)
        return KVStats(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, hit_rate=self.hit_rate,
                       evictions=sum(p.evictions for p in pools),
                       index_digest=index_digest(wire_hash(h) for p in pools for h in p.index), per_dp=per_dp,
                       host=self.host.stats() if self.host is not None else None)

    def blocks_in_use(self) -> int:
        """Referenced blocks over every pool (cached unreferenced ones count as free)."""
        return sum(p.num_used for p in self.pools)
