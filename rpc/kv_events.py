"""``SubscribeKvEvents``: the prefix index's changes as numbered ``KvEventBatch`` es, so a gateway (smg's
cache-aware routing) follows what each worker really holds.

- One batch per attention-DP rank and engine step that changed the index (sequence numbers from 1, one counter),
  each with the engine's load (``EngineLoad``); while nothing changes, a load-only batch every ``heartbeat_s``.
- A new subscriber (``start_sequence_number`` 0) gets the index as it stands — one batch, numbered with the current
  sequence, that clears and re-stores every cached block, parents first — then live batches; with
  ``load_records_before_first_batch`` a load-only batch numbered 0 comes first. A reconnecting subscriber gets the
  batches after its cursor from a bounded log: ``OUT_OF_RANGE`` when its cursor is past the last batch (this worker
  restarted), ``DATA_LOSS`` when the log no longer reaches back to it (smg then resubscribes from 0).
- ``KvBlock.block_hash`` carries the low 64 bits of the engine's 128-bit chained hash; smg indexes blocks by their
  token ids and uses the hashes only to link parents and removals.
- Every stored and removed event names its tier: the device pool's blocks are ``KV_CACHE_TIER_DEVICE``, locality
  ``LOCAL``; blocks this worker wrote
  to the shared store (``engine.kv_store``) are ``KV_CACHE_TIER_EXTERNAL``, locality ``REMOTE``, medium the store's
  name, announced as the writes are sent and never removed (the store evicts without telling; any worker reads
  them). Only device blocks are in a new subscriber's first batch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from engine.api import NO_PARENT, KvEvent, Loads, wire_hash

LOG_BATCHES = 10_000


class KvEventHub:
    """Lives on the server's event loop: :meth:`publish` takes the engine's events, :meth:`subscribe` streams them."""

    def __init__(self, kv_block_size: int, loads: Callable[[], Loads], max_running: int, heartbeat_s: float = 2.0,
                 store_medium: str = "mooncake"):
        self.kv_block_size, self.loads, self.max_running = kv_block_size, loads, max_running
        self.store_medium = store_medium
        self.heartbeat_s = heartbeat_s
        self.seq = 0
        self.log: deque[cpb.KvEventBatch] = deque(maxlen=LOG_BATCHES)
        self.index: dict[int, tuple[int, tuple[int, ...]]] = {}  # wire hash → (parent wire hash, token ids)
        self.subscribers: set[asyncio.Queue] = set()
        self.samples = 0

    # ---- engine side -------------------------------------------------------------------------------------
    def publish(self, events: list[KvEvent]) -> None:
        """Numbers the events of one engine step into batches (one per DP rank) and hands them to subscribers."""
        per_rank: dict[int, list[cpb.KvCacheEvent]] = {}
        for e in events:
            per_rank.setdefault(e.dp_rank, []).append(self._event(e))
        for dp, batch_events in per_rank.items():
            self.seq += 1
            batch = cpb.KvEventBatch(sequence_number=self.seq, timestamp=time.time(), events=batch_events,
                                     dp_rank=dp, load=self.load())
            self.log.append(batch)
            for queue in self.subscribers:
                queue.put_nowait(batch)

    def _event(self, e: KvEvent) -> cpb.KvCacheEvent:
        if e.kind == "cleared":
            self.index.clear()
            return cpb.KvCacheEvent(event_id=self.seq + 1, cleared=cpb.KvCacheCleared())
        hashes = [wire_hash(h) for h in e.hashes]
        if e.kind == "removed":
            for h in hashes:
                self.index.pop(h, None)
            return cpb.KvCacheEvent(event_id=self.seq + 1,
                                    removed=cpb.KvBlocksRemoved(block_hashes=hashes, **self._where(e.tier)))
        parent = wire_hash(e.parent) if e.parent != NO_PARENT else None
        if e.tier == "device":
            for h, tokens in zip(hashes, e.tokens, strict=True):
                self.index[h] = (parent, tokens)
                parent = h
        return self._stored(hashes, e.tokens, wire_hash(e.parent) if e.parent != NO_PARENT else None, e.tier)

    def _where(self, tier: str) -> dict:
        """The tier, medium and locality fields of an event about ``tier``'s blocks."""
        if tier == "store":
            return dict(tier=cpb.KV_CACHE_TIER_EXTERNAL, medium=self.store_medium,
                        locality=cpb.KV_CACHE_LOCALITY_REMOTE)
        return dict(tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL)

    def _stored(self, hashes: list[int], tokens, parent: int | None, tier: str = "device") -> cpb.KvCacheEvent:
        blocks = [cpb.KvBlock(block_hash=h, token_ids=list(t), block_size=self.kv_block_size)
                  for h, t in zip(hashes, tokens, strict=True)]
        stored = cpb.KvBlocksStored(blocks=blocks, **({"parent_block_hash": parent} if parent is not None else {}),
                                    **self._where(tier))
        return cpb.KvCacheEvent(event_id=self.seq + 1, stored=stored)

    def load(self, load_only: bool = False) -> cpb.EngineLoad:
        """The engine's load now (cached unreferenced blocks count as free, so both usages are the referenced
        share: every cached block is evictable)."""
        loads = self.loads()
        self.samples += 1
        return cpb.EngineLoad(running_requests=loads.running, waiting_requests=loads.waiting,
                              waiting_uncached_tokens=sum(r.waiting_uncached_tokens for r in loads.per_dp),
                              token_usage=loads.kv_usage, active_token_usage=loads.kv_usage,
                              gen_throughput=sum(loads.gen_tokens_per_s), max_running_requests=self.max_running,
                              sample=self.samples, load_only=load_only)

    # ---- subscriber side ---------------------------------------------------------------------------------
    def snapshot(self) -> cpb.KvEventBatch | None:
        """The index as it stands: one batch that clears and re-stores every cached block, parents first."""
        if not self.seq:
            return None
        depth: dict[int, int] = {}

        def level(h: int) -> int:
            if h not in depth:
                parent = self.index[h][0]
                depth[h] = 0 if parent is None or parent not in self.index else level(parent) + 1
            return depth[h]
        events = [cpb.KvCacheEvent(event_id=self.seq, cleared=cpb.KvCacheCleared())]
        for h in sorted(self.index, key=level):
            parent, tokens = self.index[h]
            events.append(self._stored([h], [tokens], parent if parent in self.index else None))
        return cpb.KvEventBatch(sequence_number=self.seq, timestamp=time.time(), events=events, load=self.load())

    async def subscribe(self, request: cpb.SubscribeKvEventsRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.KvEventBatch]:
        """The stream (module docstring); ends when the client goes away."""
        start = request.start_sequence_number
        if start > self.seq:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"start_sequence_number {start} is past this "
                                f"worker's last batch {self.seq} (it restarted): resubscribe from 0")
        if start and self.log and start < self.log[0].sequence_number - 1:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"batches after {start} are no longer kept (the log "
                                f"starts at {self.log[0].sequence_number}): resubscribe from 0")
        await context.send_initial_metadata(())
        queue: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(queue)  # with what it gets first, taken at the same instant (no await in between)
        first = [self.snapshot()] if start == 0 else [b for b in self.log if b.sequence_number > start]
        if request.load_records_before_first_batch:
            first.insert(0, cpb.KvEventBatch(sequence_number=0, timestamp=time.time(), load=self.load(load_only=True)))
        try:
            for batch in first:
                if batch is not None:
                    yield batch
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), self.heartbeat_s)
                except asyncio.TimeoutError:
                    yield cpb.KvEventBatch(sequence_number=self.seq, timestamp=time.time(),
                                           load=self.load(load_only=True))
        finally:
            self.subscribers.discard(queue)
