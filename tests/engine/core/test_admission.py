"""Admission by hand (``engine/core/admission.py``): queue order, the two reasons a request stays ("max_num_seqs",
"kv"), the DP rank chosen by reusable blocks then free blocks, a pinned rank, the reserve, and the reclaim callback
asked before admission gives up. Blocks of 4 tokens throughout."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.admission import Admission
from engine.core.journal import RankJournal
from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.leases import Leases
from engine.core.requests import Request, RequestTable
from engine.params import SamplingParams

P = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def parts(dp_size=1, num_blocks=16, **over) -> tuple[Admission, RequestTable, KVManager]:
    cfg = EngineConfig.flat(**{"max_num_seqs": 4, "max_num_batched_tokens": 8, "max_model_len": 64, "block_size": 4,
                               "num_blocks": num_blocks} | over)
    table = RequestTable(cfg, dp_size, 1000, 0)
    kv = KVManager(KVManagerConfig(num_blocks=num_blocks, kv_block_size=4, dp_size=dp_size, namespace=b"t"))
    return Admission(cfg, table, kv, RankJournal()), table, kv


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_first_come_first_served_until_max_num_seqs():
    adm, table, kv = parts(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        table.add(rid, [i, 1, 2, 3, 4, 5], P, 0)
    assert adm.admit(set()) == "max_num_seqs"
    assert ids(table.running[0]) == ["a", "b"] and ids(table.waiting) == ["c"]
    # on_demand: the first chunk's blocks only, 6 prompt tokens -> 2 blocks each
    assert [len(kv.table(r)) for r in table.running[0]] == [2, 2]
    assert [r.admitted for r in table.running[0]] == [0, 1]


def test_no_free_blocks_stops_admission_with_kv():
    adm, table, kv = parts(num_blocks=4)
    for i, rid in enumerate("abc"):
        table.add(rid, list(range(20 * i, 20 * i + 10)), P, 0)  # 10 tokens, first chunk 8 (the budget): 2 blocks
    assert adm.admit(set()) == "kv"
    assert ids(table.running[0]) == ["a", "b"] and ids(table.waiting) == ["c"] and kv.num_free(0) == 0


def test_reserve_takes_the_whole_request_up_front():
    adm, table, kv = parts(num_blocks=4, kv_allocation="reserve")
    table.add("a", list(range(10, 20)), P, 0)  # 10 prompt + 4 max_tokens = 14 slots -> 4 blocks
    table.add("b", [1, 2], P, 0)
    assert adm.admit(set()) == "kv"
    assert len(kv.table(table.running[0][0])) == 4 and ids(table.waiting) == ["b"]


def test_rank_with_the_longest_cached_prefix_wins_then_the_most_free_blocks():
    adm, table, kv = parts(dp_size=2)
    prompt = list(range(100, 112))  # 12 tokens: 3 blocks, a hit may cover the first 2 (never the last token's)
    warm = Request("warm", prompt, P, 0, dp_rank=1)
    assert kv.admit(warm, 1, 12) == 0
    kv.commit(warm, 12)
    kv.free(warm)  # rank 1 keeps 3 cached blocks, free like any other: both pools have 16 free
    table.add("hit", prompt, P, 0)
    assert adm.admit(set()) == ""
    hit = table.requests["hit"]
    assert (hit.dp_rank, hit.num_computed, hit.num_cached) == (1, 8, 8)
    # hit's table on rank 1: its 2 cached blocks + 1 for its last 4 tokens; rank 1's third cached block stays free
    assert (kv.num_free(0), kv.num_free(1)) == (16, 13)
    table.add("other", [7, 8, 9], P, 0)  # cached nowhere: the most free blocks
    adm.admit(set())
    assert table.requests["other"].dp_rank == 0


def test_equal_ranks_pick_the_lowest():
    adm, table, _ = parts(dp_size=3)
    table.add("a", [1, 2, 3], P, 0)
    adm.admit(set())
    assert table.requests["a"].dp_rank == 0


def test_a_request_pinned_to_a_full_rank_waits_without_holding_up_the_others():
    adm, table, _ = parts(dp_size=2, max_num_seqs=1)
    table.add("on1", [1, 2], P, 0, dp_rank=1)
    assert adm.admit(set()) == "" and table.requests["on1"].dp_rank == 1
    table.add("pinned", [3, 4], P, 0, dp_rank=1)
    table.add("free", [5, 6], P, 0)
    assert adm.admit(set()) == "max_num_seqs"
    assert ids(table.waiting) == ["pinned"] and table.requests["free"].dp_rank == 0


def test_reclaim_is_asked_before_admission_gives_up():
    adm, table, kv = parts(num_blocks=4)
    asked = []
    adm.reclaim = lambda dp: asked.append(dp) or False
    for i, rid in enumerate("abc"):
        table.add(rid, list(range(20 * i, 20 * i + 10)), P, 0)  # 2 blocks each
    assert adm.admit(set()) == "kv" and asked == [0] and ids(table.waiting) == ["c"]


def test_an_unread_lease_ends_so_a_request_fits():
    adm, table, kv = parts(num_blocks=4)
    leases = Leases(kv)
    adm.reclaim = leases.reclaim
    done = Request("done", list(range(200, 212)), P, 0, dp_rank=0)
    assert kv.admit(done, 0, 12) == 0
    kv.commit(done, 12)
    leases.take(done, 12, lease_s=60.0)  # 3 blocks stay referenced for a decode worker that never reads them
    table.add("a", list(range(10, 20)), P, 0)  # needs 2 blocks, 1 free
    assert adm.admit(set()) == "" and table.requests["a"].dp_rank == 0
    assert leases.reclaimed == 1 and not leases.held and kv.num_free(0) == 2


def test_a_prefix_on_a_full_rank_goes_to_a_rank_with_room_and_no_lease_ends_for_it():
    """dp 2, 4 blocks each: rank 1 holds the prompt's prefix, but its pool is full (a lease keeps the prefix, a
    running request the rest). The request is admitted on rank 0, computing the prefix, rather than wait; rank 1's
    lease is not ended while another rank has room. Then rank 0 is full too: the lease ends for the next request."""
    adm, table, kv = parts(dp_size=2, num_blocks=4)
    leases = Leases(kv)
    adm.reclaim = leases.reclaim
    prompt = list(range(100, 112))  # 3 blocks; a hit may cover 2
    done = Request("done", prompt, P, 0, dp_rank=1)
    assert kv.admit(done, 1, 12) == 0
    kv.commit(done, 12)
    leases.take(done, 12, lease_s=60.0)  # 3 blocks of rank 1 held
    busy = Request("busy", [1, 2, 3], P, 0, dp_rank=1)
    assert kv.admit(busy, 1, 3) == 0 and kv.num_free(1) == 0
    table.add("same", prompt, P, 0)
    assert adm.admit(set()) == ""
    same = table.requests["same"]
    assert (same.dp_rank, same.num_computed) == (0, 0) and leases.reclaimed == 0
    table.add("fill", list(range(200, 206)), P, 0)  # 2 blocks: rank 0's last two
    table.add("more", list(range(300, 306)), P, 0)  # 2 blocks: rank 0 full, rank 1 full but for its lease
    assert adm.admit(set()) == ""
    assert [table.requests[r].dp_rank for r in ("fill", "more")] == [0, 1] and leases.reclaimed == 1


def test_a_request_waits_for_the_prefix_another_is_prefilling():
    adm, table, kv = parts()
    shared = list(range(300, 316))  # + 1 token: 4 hashable blocks (the fifth holds the last token)
    table.add("first", shared + [1], P, 0)
    table.add("second", shared + [2], P, 0)
    table.add("third", [5, 6, 7], P, 0)
    assert adm.admit(set()) == ""
    # second's first uncached block is one first computes now: it waits, third goes by
    assert ids(table.running[0]) == ["first", "third"] and ids(table.waiting) == ["second"]
    assert table.requests["second"].deferred and adm.prefix_waits == 1
    kv.commit(table.requests["first"], 8)  # first's first chunk is in: its 2 blocks are cached
    assert adm.admit({"first"}) == ""  # still waits: its block 2 is the one first computes next
    assert adm.prefix_waits == 2
    assert kv.allocate(table.requests["first"], 16)
    kv.commit(table.requests["first"], 16)
    adm.admit({"first"})
    second = table.requests["second"]
    assert second.dp_rank == 0 and second.num_computed == 16 and not second.deferred
