"""The KV manager by hand (``engine/core/kv_manager.py``): chained hashes, a hit never covering the prompt's last token,
LRU eviction tail-first, retention, flush refused while blocks are referenced, the events that describe the index,
forks sharing full blocks, KV made under another namespace indexed apart."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, RequestError
from engine.core.kv_manager import NO_PARENT, KVManager, KVManagerConfig, chain_hash
from engine.core.requests import Request
from engine.params import SamplingParams


def manager(num_blocks=8, block_size=4, retention_s=0.0, clock=None):
    kv = KVManager(KVManagerConfig(num_blocks=num_blocks, kv_block_size=block_size, dp_size=1, retention_s=retention_s,
                                   namespace=b"test"), **({"clock": clock} if clock else {}))
    kv.recording = True
    return kv


def request(rid, tokens):
    """A request as the KV manager reads it, placed on DP rank 0."""
    return Request(rid, list(tokens), SamplingParams(), 0, dp_rank=0)


def take(kv, n, now=0.0):
    return kv.pools[0].allocate(n, now)


def test_hashes_chain_and_a_hit_stops_before_the_last_prompt_tokens_block():
    kv = manager()
    tokens = list(range(10))  # blocks [0..3], [4..7], and 8, 9 in a third
    a, b = request("a", tokens), request("b", tokens)
    hashes = kv.hashes(a)
    assert hashes == [chain_hash(NO_PARENT, (0, 1, 2, 3), b"test"),
                      chain_hash(hashes[0], (4, 5, 6, 7), b"test")]
    assert len(kv.index.hashes(list(range(8)))) == 1  # 8 tokens: token 7 sits in block 1, whose logits we need
    assert chain_hash(NO_PARENT, (0, 1, 2, 3), b"other") != hashes[0]  # another namespace, another hash
    assert kv.admit(a, 0, 10) == 0
    kv.commit(a, 9)  # 9 committed: two full blocks
    assert [e.kind for e in kv.drain_events()] == ["stored", "stored"]
    assert kv.pools[0].num_cached == 2 and kv.cached_blocks(0, hashes) == 2
    kv.free(a)
    assert kv.blocks_in_use() == 0 and kv.pools[0].num_free == 8 and kv.pools[0].consistent()
    assert kv.admit(b, 0, 10) == 8  # the two cached blocks, then one fresh
    assert kv.table(b)[:2] == kv.pools[0].cached_prefix(hashes) and kv.hit_rate == 8 / 20


def test_kv_made_elsewhere_is_indexed_apart_and_serves_only_kv_of_the_same_origin():
    """A request whose prompt KV came from an engine of another namespace (a hand-off from another layout) commits
    its blocks under that origin: this engine's own requests never hit them, another from the same origin does."""
    kv = manager(num_blocks=12)
    tokens = list(range(10))
    handed = Request("h", tokens, SamplingParams(), 0, dp_rank=0, kv_origin="n1")
    assert kv.admit(handed, 0, 10) == 0
    kv.commit(handed, 9)
    kv.free(handed)
    assert kv.pools[0].num_cached == 2
    own, same, other = (Request(rid, tokens, SamplingParams(), 0, dp_rank=0, kv_origin=origin)
                        for rid, origin in (("own", ""), ("same", "n1"), ("other", "n2")))
    assert kv.admit(same, 0, 10) == 8 and kv.admit(own, 0, 10) == 0 and kv.admit(other, 0, 10) == 0
    assert kv.hashes(own)[0] == chain_hash(NO_PARENT, (0, 1, 2, 3), b"test") != kv.hashes(same)[0]


def test_eviction_takes_empty_blocks_first_then_lru_tail_first():
    kv = manager(num_blocks=4)
    tokens = list(range(13))
    a = request("a", tokens)
    kv.admit(a, 0, 13)  # all 4 blocks
    kv.commit(a, 12)  # 3 full blocks cached
    table = list(kv.table(a))
    kv.free(a)
    kv.drain_events()
    assert take(kv, 1) == [table[3]]  # the uncached block first
    got = take(kv, 2)  # then evictions: the request's tail block first
    assert got == [table[2], table[1]]
    assert [(e.kind, e.hashes) for e in kv.drain_events()] == [("removed", (kv.index.hashes(tokens)[2],)),
                                                               ("removed", (kv.index.hashes(tokens)[1],))]


def test_retained_blocks_outlive_plain_lru_until_their_deadline():
    now = [0.0]
    kv = manager(num_blocks=4, retention_s=10.0, clock=lambda: now[0])
    tool, plain = request("tool", range(100, 105)), request("plain", range(200, 205))
    for req in (tool, plain):
        kv.admit(req, 0, 5)  # 2 blocks each, 1 full committed
        kv.commit(req, 4)
    kv.retain(tool)
    kv.free(tool)
    kv.free(plain)
    cached = {b for b in range(4) if b in kv.pools[0].hash_of}
    got = take(kv, 3)  # 2 empty, then the plain LRU block: the retained one survives
    assert len(set(got) & cached) == 1 and kv.pools[0].num_cached == 1
    kv.pools[0].release(got, None)
    now[0] = 11.0  # past its deadline it is an LRU block like any other
    take(kv, 4, now[0])
    assert kv.pools[0].num_cached == 0


def test_flush_is_refused_while_blocks_are_referenced():
    kv = manager()
    a = request("a", range(9))
    kv.admit(a, 0, 9)
    kv.commit(a, 8)
    assert not kv.clear() and kv.pools[0].num_cached == 2
    kv.free(a)
    kv.drain_events()
    assert kv.clear() and kv.pools[0].num_cached == 0 and kv.pools[0].num_free == 8
    assert [e.kind for e in kv.drain_events()] == ["cleared"]


def test_a_pool_smaller_than_one_max_length_request_is_refused():
    with pytest.raises(RequestError, match="cannot hold one max_model_len=512 request"):
        from engine.core.scheduler import Scheduler
        Scheduler(EngineConfig.flat(max_model_len=512, block_size=16, num_blocks=20), 1, 203, (1,),
                  spec_reserve_slots=17)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVManager(KVManagerConfig(num_blocks=16, kv_block_size=4, dp_size=1))
    p, c0, q, d = (request(rid, range(n)) for rid, n in (("p", 10), ("c0", 10), ("q", 8), ("d", 8)))
    kv.admit(p, 0, 10)  # 10 tokens: blocks 0, 1 full, block 2 partial
    table = kv.table(p)
    computed, copy = kv.fork(p, c0, 10)
    assert computed == 10 and kv.table(c0)[:2] == table[:2] and copy == (table[2], kv.table(c0)[2])
    assert kv.pools[0].refs[table[0]] == 2 and kv.pools[0].refs[table[2]] == 1
    kv.free(p)
    kv.free(c0)
    assert kv.blocks_in_use() == 0 and kv.pools[0].consistent()
    kv.admit(q, 0, 8)
    assert kv.fork(q, d, 8) == (8, None)  # whole blocks: nothing to copy
