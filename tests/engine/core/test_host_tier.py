"""The host tier's index by hand (``engine/core/host_tier.py``) and the KV manager with it: evicted (or, write-through,
committed) blocks queue copies to host slots, LRU over unpinned slots with retained ones last, a prefix that
continues past the device pool in the host tier, the counters, flush."""

from __future__ import annotations

from engine.core.host_tier import HostTier
from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.requests import Request
from engine.params import SamplingParams


def request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(), 0, dp_rank=0)


def manager(num_blocks=4, host_slots=8, write="evict", retention_s=0.0):
    return KVManager(KVManagerConfig(num_blocks=num_blocks, kv_block_size=4, dp_size=1, retention_s=retention_s,
                                     namespace=b"test", host_slots=host_slots, host_write=write))


def test_slots_fill_then_evict_least_recent_unpinned_and_retained_last():
    tier = HostTier(3)
    for block, h in enumerate((10, 11, 12)):
        assert tier.put(block, h, now=0.0)
    assert tier.take_stores() == [(0, 0), (1, 1), (2, 2)] and len(tier) == 3
    assert tier.put(7, 11, now=0.0) and tier.take_stores() == []  # held already: made most recent, no copy
    assert tier.prefix([10, 99, 11]) == [0]  # the longest held prefix; slot 0 is now pinned and most recent
    assert tier.put(3, 13, now=0.0)  # evicts hash 12 (slot 2): 11 and 10 were used since
    assert 12 not in tier.index and tier.take_stores() == [(3, 2)] and tier.evictions == 1
    tier.put(4, 14, now=0.0, retain_until=100.0)  # evicts 11 (slot 1), held retained
    assert 11 not in tier.index and tier.retained == {1: 100.0}
    tier.unpin_all()
    assert tier.put(5, 15, now=0.0) and 10 not in tier.index  # slot 0 unpinned: the oldest plain one goes
    assert tier.put(6, 16, now=0.0) and 13 not in tier.index and 14 in tier.index  # plain before retained
    assert tier.put(8, 17, now=200.0) and 14 not in tier.index  # the deadline passed: retained goes in LRU order
    assert tier.consistent()


def test_every_slot_pinned_stores_nothing_and_a_retargeted_slot_keeps_only_its_last_copy():
    tier = HostTier(1)
    tier.put(0, 10, now=0.0)
    assert tier.prefix([10]) == [0]
    assert not tier.put(1, 11, now=0.0) and 11 not in tier.index  # the only slot is pinned by a load
    tier.unpin_all()
    assert tier.put(2, 12, now=0.0)  # slot 0 again, before the ranks ran the first copy into it
    assert tier.take_stores() == [(2, 0)]
    tier.clear()
    assert len(tier) == 0 and tier.free == [0] and tier.consistent()


def test_evicted_blocks_go_to_host_and_a_later_prompt_hits_them_there():
    kv = manager(num_blocks=4, host_slots=8)
    tokens = list(range(13))  # three full blocks before the last token's
    a = request("a", tokens)
    kv.admit(a, 0, 13)
    kv.commit(a, 12)
    table = list(kv.table(a))
    kv.free(a)
    assert kv.host.take_stores(0) == []  # nothing evicted yet
    b = request("b", [100 + t for t in range(13)])
    assert kv.admit(b, 0, 13) == 0  # all four blocks: the three cached ones of "a" are evicted to host
    stores = kv.host.take_stores(0)
    assert sorted(block for block, _ in stores) == sorted(table[:3]) and kv.host.stats().store_blocks == 3
    kv.free(b)
    c = request("c", tokens)
    hashes = kv.hashes(c)
    assert kv.cached_blocks(0, hashes) == 0 and kv.host.held(0, hashes) == 3
    slots = kv.host.prefix(0, hashes)
    assert [kv.host.tiers[0].hash_of[s] for s in slots] == hashes and set(slots) <= kv.host.tiers[0].pinned
    assert kv.admit(c, 0, 13, host_blocks=len(slots)) == 0
    host = kv.host.stats()
    # every admission asked the host tier for its tokens past the device hit: 13 each
    assert (host.hit_tokens, host.load_blocks, host.queried_tokens) == (12, 3, 39) and kv.cached_tokens == 0
    kv.host.take_stores(0)
    assert not kv.host.tiers[0].pinned  # the pass's pins end when its copies are taken
    kv.free(c)
    assert kv.clear() and kv.host.stats().blocks == 0 and kv.host.tiers[0].consistent()


def test_write_through_copies_committed_blocks_once_and_eviction_copies_nothing_more():
    kv = manager(num_blocks=4, host_slots=8, write="through")
    a = request("a", list(range(13)))
    kv.admit(a, 0, 13)
    kv.commit(a, 8)
    assert [b for b, _ in kv.host.take_stores(0)] == kv.table(a)[:2]
    kv.commit(a, 12)
    assert [b for b, _ in kv.host.take_stores(0)] == [kv.table(a)[2]]
    kv.free(a)
    kv.admit(request("b", [100 + t for t in range(13)]), 0, 13)  # evicts "a"'s blocks: already in host
    assert kv.host.take_stores(0) == [] and kv.host.stats().blocks == 3


def test_a_retained_turn_outlives_plain_blocks_in_the_host_tier():
    kv = manager(num_blocks=6, host_slots=3, retention_s=60.0)
    agent = request("agent", list(range(9)))  # two full blocks before the last token's
    agent.retain_kv = True
    kv.admit(agent, 0, 9)
    kv.commit(agent, 8)
    agent_hashes = list(kv.requests["agent"].hashes)
    kv.free(agent)
    for i in range(3):  # each prompt wants every device block: the agent's (retained) go last, then to host
        r = request(f"x{i}", [200 + 30 * i + t for t in range(24)])
        assert kv.admit(r, 0, 24) is not None
        kv.commit(r, 24)
        kv.free(r)
    assert kv.cached_blocks(0, agent_hashes) == 0 and kv.host.tiers[0].evictions > 0
    assert all(h in kv.host.tiers[0].index for h in agent_hashes) and kv.host.tiers[0].consistent()
