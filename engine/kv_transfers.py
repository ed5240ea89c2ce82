"""Rank 0's side of KV that moves: sources of requests waiting for admission, the loads admission started (sent to
the ranks as :class:`~engine.worker.control.LoadKV`, each rank's share written on its loader thread), blocks
read out of the ranks' caches (:class:`~engine.worker.control.ReadKV`), and the prefill/decode hand-off: a prefill
worker's finished request leaves its KV leased and its output says where it is (:meth:`KVTransfers.hand_off`); a
decode worker loads it like any source (``engine.worker.kv_peer.PeerKV``), counted (:meth:`KVTransfers.hand_offs`).

A request whose KV arrives from elsewhere is placed with its blocks reserved and is not fed while its load runs; the
others' steps go on. Rank 0 sees its own share done (:meth:`KVTransfers.finish_loads`), the request joins the next
step, and every rank waits for its share before that step (``StepPlan.loads``)."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, replace

import torch

from engine.config import RequestError
from engine.core.scheduler import Scheduler
from engine.messages import HandOffs, KVTier
from engine.step import RequestOutput
from engine.worker.control import ControlPlane, LeaseKV, LoadKV, LoadOutcomes, PutKV, RankState, ReadKV, StoreKV
from engine.worker.kv_cache import PagedKVCache
from engine.worker.kv_loads import HostKV, KVSource, TierKV
from engine.worker.kv_peer import PeerKV

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # an engine with only loads to wait for blocks this long on rank 0's share instead of spinning


@dataclass(frozen=True)
class PeerLease:
    """A prefill worker's lease of a request's KV: kept ``seconds`` for a decode worker to read, through the ranks'
    transfer endpoints on ``host`` over ``protocol``."""

    seconds: float
    host: str = "127.0.0.1"
    protocol: str = "tcp"


def transfer_fingerprint(shape: bytes, cache: PagedKVCache, attn_tp: int) -> str:
    """The digest two engines' KV must share to be copied from one cache into the other (``kv_engine_id``):
    ``shape`` (``engine.worker.kv_budget.kv_shape``), the cache's block bytes and size, and the attention-TP size —
    unless every byte of a block is the same on each attention-TP rank (MLA's latent, the drafter's context), when
    any TP size reads any other's."""
    split = "" if bool(cache.replicated_bytes().all()) else f"|attn_tp={attn_tp}"
    space = shape + f"{split}|{cache.block_bytes()} bytes|{cache.kv_block_size} tokens".encode()
    return hashlib.blake2b(space, digest_size=8).hexdigest()


class KVTransfers:
    def __init__(self, control: ControlPlane, rank: RankState, scheduler: Scheduler, shape: bytes):
        """``shape``: what this engine's KV bytes hold (``engine.worker.kv_budget.kv_shape``)."""
        self.control, self.rank, self.scheduler = control, rank, scheduler
        self.sources: dict[str, KVSource] = {}  # requests whose KV arrives from elsewhere, until their load starts
        self.loading: set[int] = set()  # loads started whose rank-0 share is not done
        self.failed_loads = 0  # loads whose source failed on some rank (their requests computed the tokens)
        self.leases: dict[str, PeerLease] = {}  # requests whose KV a decode worker will read, until they finish
        self.missing: set[str] = set()  # requests a decode worker got without a hand-off, until their first output ends
        self.peer_loads: dict[int, tuple[int, int, str, bool]] = {}  # hand-offs running: id → (blocks, tokens,
        # request, recompute on failure)
        self.refused: list[tuple[str, str]] = []  # requests whose hand-off failed without recompute: (id, why)
        self.received = [0, 0]  # hand-off blocks and bytes read
        self.recomputed = 0  # prompt tokens computed beyond the last of requests handed off to this worker
        self.hand_off_failures: Counter[str] = Counter()
        self.fingerprint = transfer_fingerprint(shape, rank.runner.cache, rank.runner.model.groups.attn_tp.size)
        self.namespace = hashlib.blake2b(scheduler.kv.cfg.namespace, digest_size=8).hexdigest()  # and is cached
        # by a receiver with the prefix cache where this is equal too (same numerics and attention-DP size)

    def check(self, kv: KVSource) -> None:
        """Refuses a source whose rank-0 blocks do not fit this cache (another model, dtype or layout)."""
        me = self.control.comm.rank
        if isinstance(kv, HostKV) and me in kv.per_rank:
            mine, want = kv.per_rank[me], self.rank.runner.cache.block_bytes()
            if mine.dtype != torch.uint8 or mine.dim() != 2 or mine.shape[1] != want:
                raise RequestError(f"kv: blocks of {mine.dtype} {list(mine.shape)} do not fit this engine's KV cache "
                                   f"({want} bytes per block on rank {me})")

    def start_stores(self) -> None:
        """Sends the host tier's copies the last admission pass and plan queued (blocks they evicted, or committed
        blocks with ``host_kv_write=through``), before that pass's loads and step: each rank runs them first."""
        kv = self.scheduler.kv
        for dp in range(self.scheduler.dp_size if kv.host is not None else 0):
            stores = kv.host.take_stores(dp)
            if stores:
                blocks, slots = zip(*stores, strict=True)
                self.control.send(StoreKV(dp, blocks, slots), self.rank)
        for dp, writes in enumerate(kv.store_writes or ()):
            if writes:
                blocks, hashes = zip(*writes, strict=True)
                writes.clear()
                self.control.send(PutKV(dp, blocks, hashes), self.rank)

    def start_loads(self) -> None:
        """Sends the loads admission started to the ranks (each starts its share on its copy thread)."""
        bs = self.scheduler.cfg.cache.block_size
        for load in self.scheduler.take_loads():
            source = (TierKV(len(load.source_blocks) * bs, load.host_slots, load.store_hashes) if load.from_tiers
                      else self.sources.pop(load.request_id))
            if isinstance(source, PeerKV):
                req = self.scheduler.table.requests[load.request_id]
                self.recomputed += len(req.prompt) - 1 - req.kv_tokens  # what the hand-off did not cover
                self.peer_loads[load.load_id] = (len(load.blocks), req.kv_tokens - load.source_blocks[0] * bs,
                                                 load.request_id, source.recompute)
            self.control.send(LoadKV(load.load_id, load.dp_rank, load.blocks, load.source_blocks, source), self.rank)
            self.loading.add(load.load_id)

    def finish_loads(self) -> None:
        """Loads whose rank-0 share is written (or that are not its own): every rank's share is waited for and
        whether its source failed there gathered (``LoadOutcomes``); their requests join the next step, those whose
        load failed somewhere to compute the tokens themselves. Leases past their time end here too (every step)."""
        if self.scheduler.leases.held:
            self.scheduler.leases.expire()
        loads = self.rank.runner.loads
        done = tuple(sorted(i for i in self.loading if loads.done(i)))
        if not done:
            return
        failed: dict[int, str] = {}
        for reply in self.control.send(LoadOutcomes(done), self.rank):
            failed.update(reply)
        for load_id in done:
            self.loading.discard(load_id)
            refused = self._count_hand_off(load_id, failed.get(load_id))
            if load_id in failed:
                self.failed_loads += 1
                log.warning("KV load %d failed (%s): %s", load_id, failed[load_id],
                            "its request ends" if refused else "its request computes those tokens")
            self.scheduler.loaded(load_id, failed=load_id in failed)

    def _count_hand_off(self, load_id: int, failure: str | None) -> bool:
        """Counts a finished load of a hand-off (if it was one); True when its request is to end (failed, recompute
        off)."""
        blocks, tokens, request_id, recompute = self.peer_loads.pop(load_id, (0, 0, "", True))
        if not blocks:
            return False
        if failure is not None:  # "KV hand-off <reason>: …"
            self.hand_off_failures[failure.split(":")[0].split()[-1]] += 1
            if recompute:
                self.recomputed += tokens
            else:
                self.refused.append((request_id, failure))
            return not recompute
        runner = self.rank.runner
        self.received[0] += blocks
        self.received[1] += blocks * runner.cache.block_bytes() * runner.model.groups.attn_tp.size
        return False

    def origin(self, kv: KVSource) -> str:
        """Where ``kv`` was made when its blocks must be indexed apart from this engine's own: a hand-off from an
        engine of another cache namespace (its digest); ``""`` otherwise."""
        return kv.namespace if isinstance(kv, PeerKV) and kv.namespace != self.namespace else ""

    def take_refused(self) -> list[tuple[str, str]]:
        """Requests whose hand-off failed with recompute off, and why: the engine ends them (their KV freed)."""
        refused, self.refused = self.refused, []
        return refused

    def hand_off(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs``, where a finished request with a lease (a prefill worker's) gets ``kv_transfer_params``: where
        its leased blocks are on each rank of its DP group (:class:`~engine.worker.control.LeaseKV`) and how to
        check them. A finished request a decode worker got without a hand-off counts its computed prompt tokens."""
        for out in outputs:
            if out.finished and out.request_id in self.missing:  # its prompt was computed here (once for n > 1)
                self.missing.discard(out.request_id)
                self.recomputed += max(out.num_prompt_tokens - 1 - out.num_cached_tokens, 0)
        return [self._hand_off(out) if out.finished else out for out in outputs]

    def _hand_off(self, out: RequestOutput) -> RequestOutput:
        policy = self.leases.pop(out.request_id, None)
        lease = self.scheduler.leases.fresh.pop(out.request_id, None)
        if policy is None or lease is None:
            return out
        replies = self.control.send(LeaseKV(lease.dp_rank, lease.blocks, policy.host, policy.protocol), self.rank)
        return replace(out, kv_transfer_params={
            "switchyard_hand_off": 1, "lease": lease.key, "num_tokens": lease.num_tokens,
            "fingerprint": self.fingerprint, "namespace": self.namespace,
            "layout": self.rank.runner.model.groups.layout.describe(),
            "protocol": policy.protocol, "lease_s": policy.seconds,
            "shards": [{"session": s.session, "tensors": [list(t) for t in s.tensors], "blocks": list(s.blocks),
                        "digests": list(s.digests)} for s in replies if s is not None]})

    def hand_offs(self) -> HandOffs:
        """The hand-offs since start (:class:`~engine.messages.HandOffs`)."""
        leases = self.scheduler.leases
        return HandOffs(received_blocks=self.received[0], received_bytes=self.received[1],
                        seconds=self.rank.runner.loads.seconds.get("hand_off", 0.0), recomputed_tokens=self.recomputed,
                        failures=dict(self.hand_off_failures), leased_blocks=leases.num_blocks,
                        leases_released=leases.released, leases_expired=leases.expired,
                        leases_reclaimed=leases.reclaimed)

    def idle(self) -> None:
        """A step with nothing to launch: wait briefly for a load's rank-0 share (if any) rather than spin."""
        if self.loading:
            self.rank.runner.loads.wait_any(tuple(self.loading), timeout_s=IDLE_WAIT_S)

    def tiers(self) -> tuple[KVTier, ...]:
        """The device pool, and (when on) the host tier and the shared store, since start. The store's ``blocks`` is
        not known here (None); its ``store_bytes`` are what rank 0's attention-TP group wrote, from rank 0's puts."""
        kv = self.scheduler.kv  # its counters, not kv.stats(): this runs after every step (no index digests)
        tiers = [KVTier(tier="device", hit_tokens=kv.cached_tokens, queried_tokens=kv.prompt_tokens,
                        blocks=sum(p.num_cached for p in kv.pools))]
        runner = self.rank.runner
        group = runner.model.groups.attn_tp.size
        block = runner.cache.block_bytes() * group
        seconds = runner.loads.seconds
        if kv.host is not None:
            host = kv.host.stats()
            tiers.append(KVTier(tier="host", hit_tokens=host.hit_tokens, queried_tokens=host.queried_tokens,
                                blocks=host.blocks, load_bytes=host.load_blocks * block,
                                store_bytes=host.store_blocks * block, load_s=seconds["load"],
                                store_s=seconds["store"]))
        store = runner.loads.store
        if store is not None:
            counts = kv.store_counts
            tiers.append(KVTier(tier="store", hit_tokens=counts.hit_tokens, queried_tokens=counts.queried_tokens,
                                blocks=None, load_bytes=counts.hit_blocks * block, store_bytes=store.group_put_bytes,
                                errors=dict(store.errors) | {"load_failed": self.failed_loads}))
        return tuple(tiers)

    def read_prefix(self, tokens: list[int], dp_rank: int = 0) -> HostKV:
        """The KV of the leading full blocks of ``tokens`` that attention-DP rank ``dp_rank``'s prefix cache holds,
        read out of every layer group on each of its ranks into host memory: ``HostKV.per_rank[r]`` is rank ``r``'s
        ``[blocks, block_bytes]`` uint8."""
        blocks = self.scheduler.kv.prefix_blocks(dp_rank, tokens)
        replies = self.control.send(ReadKV(dp_rank, tuple(blocks)), self.rank)
        per_rank = {r: data for r, data in enumerate(replies) if data is not None}
        return HostKV(per_rank, len(blocks) * self.scheduler.cfg.cache.block_size)
