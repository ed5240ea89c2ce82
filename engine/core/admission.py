"""Admission: which waiting requests start, on which attention-DP rank, with what KV reserve (a policy object).

- First come first served. A request is placed on the rank holding its longest cached prefix, then the one with
  most free blocks (``GenerateRequest.data_parallel_rank``, when set, pins it); when that rank cannot take it, the
  next one that can (its prefix computed there), and only then are unread PD leases ended; a request pinned to a full
  rank waits without holding up the others, one that no rank can take stops admission.
- The reserve: the blocks of its first chunk (``on_demand``) or of its whole request (``reserve``: prompt +
  max_tokens capped at max_model_len, plus the speculative scratch); the cached prefix needs none.
- KV from elsewhere (``Request.kv_tokens``): the reserve covers it; the blocks the prefix cache does not hold are
  loaded (:meth:`take_loads`) and the request is placed but not fed until the load is done (``Request.loading``).
- The host tier and the shared store: a prefix that continues past the device pool's hit in the rank's host tier,
  then in the shared store, is KV from elsewhere too (``KVLoad.host_slots``, ``KVLoad.store_hashes``); placement
  counts the device's and host's blocks (the store is every rank's).
- ``share_inflight_prefix``: a request whose next uncached block a running request is computing now waits (without
  holding up the others) and hits that block once it is committed, rather than computing the shared prefix again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.journal import RankJournal
from engine.core.kv_manager import KVManager
from engine.core.requests import Request, RequestTable


@dataclass(frozen=True, kw_only=True)
class KVLoad:
    """A load admission started: source blocks ``source_blocks`` of request ``request_id``'s KV source into its
    ``blocks`` on attention-DP rank ``dp_rank``."""

    load_id: int
    request_id: str
    dp_rank: int
    blocks: tuple[int, ...]
    source_blocks: tuple[int, ...]  # the source's blocks (with tier blocks: their index in host then store order)
    host_slots: tuple[int, ...] = ()  # from the rank's host tier
    store_hashes: tuple[int, ...] = ()  # from the shared store

    @property
    def from_tiers(self) -> bool:
        return bool(self.host_slots or self.store_hashes)


class Admission:
    def __init__(self, cfg: EngineConfig, table: RequestTable, kv: KVManager, journal: RankJournal,
                 store_lookup: Callable[[list[int]], int] | None = None,
                 reclaim: Callable[[int], bool] = lambda dp: False):
        """``store_lookup(hashes)``: leading blocks of ``hashes`` the shared store holds (None: no store);
        ``reclaim(dp)``: frees blocks held for others on rank ``dp`` (an unread PD lease), False when none are."""
        self.cfg, self.table, self.kv, self.journal = cfg, table, kv, journal
        self.store_lookup, self.reclaim = store_lookup, reclaim
        self._order = itertools.count()
        self.prefix_waits = 0  # admission passes that put a request off for a block another is prefilling
        self._load_ids = itertools.count()
        self._loads: list[KVLoad] = []  # loads admission started since the engine last took them

    def admit(self, last_fed: set[str]) -> str:
        """Admits in queue order while a rank has room and the blocks a request's first step needs. ``last_fed``:
        the requests the last plan fed (only their blocks are waited for: one stalled for want of blocks may not move
        until older requests end). Returns why a request stayed: "max_num_seqs" (no running slot), "kv" (no free
        blocks) or "" (none did for either)."""
        blocked, prefilling, table = "", None, self.table
        for req in table.waiting:
            req.deferred = False
        for req in list(table.waiting):
            ranks = [r for r in ([req.pinned_dp] if req.pinned_dp is not None else range(table.dp_size))
                     if table.seats(r) + max(req.fork_n, 1) <= self.cfg.scheduler.max_num_seqs]
            if not ranks:
                blocked = blocked or "max_num_seqs"
                if req.pinned_dp is None:
                    return blocked
                continue
            hashes = self.kv.hashes(req)
            if self.cfg.scheduler.share_inflight_prefix and hashes:
                prefilling = prefilling if prefilling is not None else self._prefilling(last_fed)
                if self._waits_for_prefill(hashes, ranks, prefilling):
                    req.deferred = True
                    self.prefix_waits += 1
                    continue
            placed = self._place(req, ranks, hashes)
            if placed is None:
                return "kv"
            dp, cached, slots, stored = placed
            table.waiting.remove(req)
            req.dp_rank, req.num_computed = dp, cached
            if req.kv_tokens > cached:
                self._start_load(req, cached, tuple(slots), tuple(stored))
            if prefilling is not None:  # admitted now: those behind it wait for what it will compute
                prefilling[dp].update(hashes[cached // self.cfg.cache.block_size:])
            self.journal.joined(req)
            if req.admitted < 0:
                req.admitted = next(self._order)
                req.num_cached = cached + (len(slots) + len(stored)) * self.cfg.cache.block_size
            table.place(req, dp)
        return blocked

    def _place(self, req: Request, ranks: list[int], hashes: list[int]
               ) -> tuple[int, int, list[int], list[int]] | None:
        """The rank that admits ``req`` and what it found there: ``(dp, cached tokens, host slots, store hashes)``, or
        None. Ranks are tried by reusable blocks, then free blocks, then lowest id — each as it is, then each after
        ending its unread leases (``reclaim``), so a request whose prefix sits on a full rank goes to one with room
        rather than wait, and no lease ends while another rank has room."""
        order = sorted(ranks, key=lambda r: (-self._reusable_blocks(r, hashes), -self.kv.num_free(r), r))
        tiers: dict[int, tuple[list[int], list[int]]] = {}
        for reclaiming in (False, True):
            for dp in order:
                device = self.kv.cached_blocks(dp, hashes)
                if dp not in tiers:
                    tiers[dp] = self._tier_prefix(req, dp, hashes, device)
                slots, stored = tiers[dp]
                if slots or stored:  # the tiers' blocks arrive like KV from elsewhere
                    req.kv_tokens = (device + len(slots) + len(stored)) * self.cfg.cache.block_size
                cached = self.kv.admit(req, dp, self._reserve(req, dp, hashes), len(slots), len(stored))
                while cached is None and reclaiming and self.reclaim(dp):
                    cached = self.kv.admit(req, dp, self._reserve(req, dp, hashes), len(slots), len(stored))
                if cached is not None:
                    return dp, cached, slots, stored
                if slots or stored:
                    req.kv_tokens = 0
        return None

    def _tier_prefix(self, req: Request, dp: int, hashes: list[int], device: int) -> tuple[list[int], list[int]]:
        """The host slots, then the store's block hashes, that continue ``req``'s device hit of ``device`` blocks on
        ``dp`` (none for a request with its own KV source)."""
        if req.kv_tokens:
            return [], []
        host = self.kv.host
        slots = host.prefix(dp, hashes[device:]) if host is not None else []
        rest = hashes[device + len(slots):]
        held = self.store_lookup(rest) if self.store_lookup is not None and rest else 0
        return slots, rest[:held]

    def _reusable_blocks(self, dp: int, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that ``dp`` holds in its device pool or, past them, in its host tier."""
        device = self.kv.cached_blocks(dp, hashes)
        return device + (self.kv.host.held(dp, hashes[device:]) if self.kv.host is not None else 0)

    def _reserve(self, req: Request, dp: int, hashes: list[int]) -> int:
        """Token slots ``req`` takes at admission on ``dp`` (cached prefix and KV to load included)."""
        if self.cfg.scheduler.kv_allocation == "reserve":
            return self.table.request_slots(len(req.prompt), req.params.max_tokens)
        hit = max(self.kv.cached_blocks(dp, hashes) * self.cfg.cache.block_size, req.kv_tokens)
        return hit + min(len(req.feed_tokens) - hit, self.cfg.scheduler.max_num_batched_tokens)

    def _start_load(self, req: Request, cached: int, host_slots: tuple[int, ...],
                    store_hashes: tuple[int, ...]) -> None:
        """``req``'s blocks past its ``cached`` prefix up to ``kv_tokens`` come from its source, or from the tiers
        (``host_slots``, then ``store_hashes``)."""
        bs = self.cfg.cache.block_size
        first, end = cached // bs, -(-req.kv_tokens // bs)  # a source's partial last block too
        tiers = len(host_slots) + len(store_hashes)
        req.loading = next(self._load_ids)
        self._loads.append(KVLoad(load_id=req.loading, request_id=req.request_id, dp_rank=req.dp_rank,
                                  blocks=tuple(self.kv.table(req)[first:end]),
                                  source_blocks=tuple(range(tiers)) if tiers else tuple(range(first, end)),
                                  host_slots=host_slots, store_hashes=store_hashes))

    def take_loads(self) -> list[KVLoad]:
        """The loads admission started since the last call, for the engine to send to the ranks."""
        loads, self._loads = self._loads, []
        return loads

    def _prefilling(self, last_fed: set[str]) -> list[set[int]]:
        """Per DP rank, the hashes of the full blocks not yet committed of the running requests the last plan fed."""
        kv = self.kv
        return [{h for r in running if r.hashes and r.request_id in last_fed for h in r.hashes[kv.committed_blocks(r):]}
                for running in self.table.running]

    def _waits_for_prefill(self, hashes: list[int], ranks: list[int], prefilling: list[set[int]]) -> bool:
        """Whether the first block of ``hashes`` that none of ``ranks`` caches is one a request running there is
        computing now: waiting, the request hits it once it is committed."""
        first = max(self.kv.cached_blocks(r, hashes) for r in ranks)
        return first < len(hashes) and any(hashes[first] in prefilling[r] for r in ranks)

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens of waiting requests not in the prefix cache (their best rank's hit)."""
        return sum(len(req.tokens) - max(self.kv.cached_blocks(dp, self.kv.hashes(req))
                                         for dp in range(self.table.dp_size)) * self.cfg.cache.block_size
                   for req in self.table.waiting)
