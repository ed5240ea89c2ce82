"""KV that moves in and out of a rank's cache: where a request's blocks come from (:class:`KVSource`,
:class:`HostKV`, :class:`HostTierKV`), the rank's host-tier slots (:class:`HostPool`), and the rank's copies in flight
(:class:`RankLoads`), each run on one copy thread off the step path.

A load writes a source's blocks into blocks the scheduler reserved (``engine.core.admission``); the request joins a
step only after rank 0 saw its own share done, and every rank waits for the loads a plan names before that step
touches its cache (``StepPlan.loads``), so a block is never read, or handed to another request, while a load still
writes it. A host-tier store (device block → host slot) is queued before the loads and the step of the same
admission pass and every step waits for the stores queued before it: one thread runs them in the order they came,
so a store reads its block before a load or a forward writes it again, and a load reads its slot before a later store
writes it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.worker.kv_cache import PagedKVCache
from engine.worker.kv_peer import PeerEndpoint, PeerKV
from engine.worker.kv_store import KVStore, StoreError


class KVSource(Protocol):
    """Blocks of KV bytes, per rank, in :meth:`PagedKVCache.read_blocks`' layout; picklable (it travels to every
    rank in the load message). ``num_tokens``: the tokens they hold (full blocks, from position 0)."""

    num_tokens: int

    def read(self, at: RankLoads, blocks: list[int]) -> torch.Tensor:
        """The share of source blocks ``blocks`` of the rank loading them (``at.rank``, its host tier ``at.host``):
        ``[len(blocks), block_bytes]`` uint8 (host memory)."""
        ...


@dataclass(frozen=True)
class HostKV:
    """A request's leading blocks read out of the ranks' caches into host memory (``Engine.read_prefix_kv``):
    ``per_rank[r]`` is rank ``r``'s ``[num_blocks, block_bytes]`` uint8 (the ranks of the DP group that held them)."""

    per_rank: dict[int, torch.Tensor]
    num_tokens: int

    def read(self, at: RankLoads, blocks: list[int]) -> torch.Tensor:
        return self.per_rank[at.rank][blocks]


@dataclass(frozen=True)
class TierKV:
    """Blocks in the loading rank's own tiers: host slots ``host_slots``, then blocks of the shared store by hash
    (``store_hashes``); source block ``i`` is the ``i``-th of them in that order."""

    num_tokens: int
    host_slots: tuple[int, ...] = ()
    store_hashes: tuple[int, ...] = ()

    def read(self, at: RankLoads, blocks: list[int]) -> torch.Tensor:
        n = len(self.host_slots)
        slots = [self.host_slots[b] for b in blocks if b < n]
        hashes = [self.store_hashes[b - n] for b in blocks if b >= n]
        if (slots and at.host is None) or (hashes and at.store is None):
            raise RuntimeError(f"rank {at.rank} has no {'host KV tier' if slots else 'KV store'} to load from")
        parts = ([at.host.slots[slots]] if slots else []) + ([at.store.get(hashes)] if hashes else [])
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class HostPool:
    """One rank's host-tier slots: ``slots [num_slots, block_bytes]`` uint8, each one block's bytes over every layer
    group in :meth:`PagedKVCache.read_blocks`' layout (pinned memory on CUDA, so copies run by DMA)."""

    def __init__(self, num_slots: int, block_bytes: int, pin: bool):
        self.slots = torch.empty(num_slots, block_bytes, dtype=torch.uint8, pin_memory=pin)


def host_slots(host_kv_cache_gb: float, block_bytes: int, group_ranks: int) -> int:
    """Slots of a host tier of ``host_kv_cache_gb`` GiB per attention-DP group, whose ``group_ranks`` ranks each keep
    their ``block_bytes`` share of every slot (an MLA latent is kept once per attention-TP rank)."""
    return int(host_kv_cache_gb * 2**30) // (block_bytes * group_ranks)


class RankLoads:
    """One rank's KV copies: loads started by the load message and host-tier stores, each on the copy thread;
    :meth:`wait` before a step that names a load (a load that failed raises there, naming it), :meth:`wait_stores`
    before every step. ``seconds[direction]``: time the thread spent copying (``load``, ``store``)."""

    def __init__(self, cache: PagedKVCache, rank: int, host: HostPool | None = None, store: KVStore | None = None,
                 tp_rank: int = 0):
        self.cache, self.rank, self.host, self.store, self.tp_rank = cache, rank, host, store, tp_rank
        self._peer: PeerEndpoint | None = None
        self.failed: dict[int, str] = {}  # loads whose source failed softly (a store error): id → why
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-copy-{rank}")
        self._pending: dict[int, Future] = {}
        self._stores: list[Future] = []
        self.seconds = {"load": 0.0, "store": 0.0, "hand_off": 0.0}
        # on CUDA the copies run on a side stream of their own (not the step's), synchronized before a job ends
        self._stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None

    @contextlib.contextmanager
    def _copying(self, direction: str):
        """One copy job's body: on the side stream (CUDA), waited for before the job ends; its seconds counted."""
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            yield
        if self._stream is not None:
            self._stream.synchronize()
        self.seconds[direction] += time.perf_counter() - t0

    def start(self, load_id: int, blocks: list[int], source_blocks: list[int], source: KVSource) -> None:
        """Reads ``source_blocks`` of this rank's share of ``source`` and writes them into ``blocks``, off the step
        thread."""
        self._pending[load_id] = self._pool.submit(self._load_or_fail, load_id, blocks, source_blocks, source)

    def _load(self, blocks: list[int], source_blocks: list[int], source: KVSource) -> None:
        with self._copying("hand_off" if isinstance(source, PeerKV) else "load"):
            self.cache.write_blocks(blocks, source.read(self, source_blocks))

    def _load_or_fail(self, load_id: int, blocks: list[int], source_blocks: list[int], source: KVSource) -> None:
        """:meth:`_load`; a store or hand-off error is kept (:attr:`failed`): the request recomputes those tokens."""
        try:
            self._load(blocks, source_blocks, source)
        except StoreError as e:
            self.failed[load_id] = str(e)

    def put(self, blocks: list[int], hashes: list[int]) -> None:
        """Writes device ``blocks`` to the shared store under ``hashes``: read into host memory on the copy thread
        (the next step waits for the read), put in the background by the store client."""
        if self.store is None:
            raise RuntimeError(f"rank {self.rank} has no KV store to put blocks {blocks[:4]} in")
        self._stores.append(self._pool.submit(lambda: self.store.put(hashes, self.cache.read_blocks(blocks))))

    def peer(self, host: str, protocol: str) -> PeerEndpoint:
        """This rank's transfer endpoint (``engine.worker.kv_peer``), started on first use."""
        if self._peer is None:
            self._peer = PeerEndpoint(self.cache, host, protocol)
        return self._peer

    def outcome(self, load_ids: tuple[int, ...]) -> dict[int, str]:
        """Waits for this rank's share of ``load_ids``; returns those whose source failed here, with why."""
        self.wait(load_ids)
        return {i: self.failed.pop(i) for i in load_ids if i in self.failed}

    def offload(self, blocks: list[int], slots: list[int]) -> None:
        """Copies device ``blocks`` into host-tier ``slots``, after every copy queued before it (the next step
        waits for it: :meth:`wait_stores`)."""
        if self.host is None:
            raise RuntimeError(f"rank {self.rank} has no host KV tier to store blocks {blocks[:4]} in")
        self._stores.append(self._pool.submit(self._store, blocks, slots))

    def _store(self, blocks: list[int], slots: list[int]) -> None:
        with self._copying("store"):
            self.host.slots[slots] = self.cache.read_blocks(blocks)

    def wait_stores(self) -> None:
        """Blocks until every store queued so far is done (a step may then write their blocks); raises the first
        that failed."""
        stores, self._stores = self._stores, []
        for f in stores:
            try:
                f.result()
            except Exception as e:
                raise RuntimeError(f"rank {self.rank}: host KV tier store failed: {e}") from e

    def close(self) -> None:
        """Leaves the shared store (this rank's share of its memory goes with it)."""
        if self.store is not None:
            self.store.close()

    def done(self, load_id: int) -> bool:
        """Whether load ``load_id`` finished here (or never ran here: this rank is not in its DP group)."""
        f = self._pending.get(load_id)
        return f is None or f.done()

    def wait_any(self, load_ids: tuple[int, ...], timeout_s: float) -> None:
        """Returns when one of ``load_ids`` started here is done, or after ``timeout_s``."""
        pending = [self._pending[i] for i in load_ids if i in self._pending]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def wait(self, load_ids: tuple[int, ...]) -> None:
        """Blocks until every load of ``load_ids`` started here is written; raises the first that failed."""
        for load_id in load_ids:
            f = self._pending.pop(load_id, None)
            if f is None:
                continue
            try:
                f.result()
            except Exception as e:
                raise RuntimeError(f"rank {self.rank}: KV load {load_id} failed: {e}") from e
