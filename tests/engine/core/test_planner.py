"""The step planner by hand (``engine/core/planner.py``): decodes first, then prefills oldest first in chunks within
the token budget; on_demand blocks per step; the reclaim callback before any preemption; recompute preemption of
the rank's newest request; an item that nothing can make room for waits. Blocks of 4 tokens throughout."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.admission import Admission
from engine.core.journal import RankJournal
from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.leases import Leases
from engine.core.planner import StepPlanner
from engine.core.requests import Request, RequestTable
from engine.params import SamplingParams

P = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def parts(num_blocks=32, **over) -> tuple[StepPlanner, Admission, RequestTable, KVManager]:
    cfg = EngineConfig.flat(**{"max_num_seqs": 4, "max_num_batched_tokens": 8, "max_model_len": 64, "block_size": 4,
                               "num_blocks": num_blocks} | over)
    table, journal = RequestTable(cfg, 1, 1000, 0), RankJournal()
    kv = KVManager(KVManagerConfig(num_blocks=num_blocks, kv_block_size=4, dp_size=1, namespace=b"t"))
    return (StepPlanner(cfg, table, kv, journal, 0, False), Admission(cfg, table, kv, journal), table, kv)


def admit(adm: Admission, table: RequestTable, *prompts: tuple[str, list[int]]) -> list[Request]:
    for rid, prompt in prompts:
        table.add(rid, prompt, P, 0)
    adm.admit(set())
    return [table.requests[rid] for rid, _ in prompts]


def decoding(req: Request, kv: KVManager, token: int = 9) -> None:
    """``req`` as if its prompt were computed and one token sampled: its next item feeds that token."""
    req.num_computed = len(req.prompt)
    req.output.append(token)
    kv.commit(req, len(req.prompt))


def shape(work) -> list[tuple[str, int, int, bool, bool]]:
    return [(w.request_id, w.start, len(w.token_ids), w.sample, w.decode) for w in work[0]]


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget_oldest_first():
    planner, adm, table, kv = parts()
    long, short = admit(adm, table, ("long", list(range(100, 120))), ("short", [1, 2, 3]))
    work, blocks, blocked = planner.plan(0)
    # budget 8: the older request takes it all, the newer waits for a later step
    assert shape(work) == [("long", 0, 8, False, False)] and not blocked
    assert blocks == {"long": (0, 1)}
    long.num_computed = 8
    work, blocks, _ = planner.plan(1)
    # block 2 went to short at admission (its first chunk)
    assert shape(work) == [("long", 8, 8, False, False)] and blocks == {"long": (3, 4)}
    long.num_computed = 16
    work, _, _ = planner.plan(2)  # the last 4 prompt tokens sample; short takes the 4 left
    assert shape(work) == [("long", 16, 4, True, False), ("short", 0, 3, True, False)]
    assert set(planner.applied(2)) == {"long", "short"} and planner.applied(2) == {}


def test_decodes_go_first_then_prefills_take_what_is_left():
    planner, adm, table, kv = parts()
    first, second = admit(adm, table, ("first", list(range(100, 120))), ("second", [1, 2, 3, 4, 5]))
    decoding(second, kv)
    work, _, _ = planner.plan(0)
    assert shape(work) == [("second", 5, 1, True, True), ("first", 0, 7, False, False)]
    assert work[0][0].token_ids == [9] and work[0][0].num_generated == 1


def test_long_prefill_token_threshold_caps_each_prefill_chunk():
    planner, adm, table, _ = parts(long_prefill_token_threshold=3)
    admit(adm, table, ("a", list(range(100, 110))), ("b", list(range(200, 210))))
    work, _, _ = planner.plan(0)
    assert shape(work) == [("a", 0, 3, False, False), ("b", 0, 3, False, False)]


def three_full(num_blocks=6, decoder=0):
    """Three 8-token prompts admitted in order (a, b, c) on a pool of ``num_blocks``, 2 blocks each, the one at
    ``decoder`` decoding: its next token needs a third block."""
    planner, adm, table, kv = parts(num_blocks=num_blocks)
    reqs = admit(adm, table, *[(rid, list(range(10 * i, 10 * i + 8))) for i, rid in enumerate("abc")])
    assert [r.dp_rank for r in reqs] == [0, 0, 0] and kv.num_free(0) == num_blocks - 6
    decoding(reqs[decoder], kv)
    return planner, table, kv, reqs


def test_the_newest_request_is_preempted_when_blocks_run_out():
    planner, table, kv, (a, b, c) = three_full()
    asked = []
    planner.reclaim = lambda dp: asked.append(dp) or False
    work, _, blocked = planner.plan(0)
    assert asked == [0] and planner.preemptions == 1 and not blocked
    assert shape(work) == [("a", 8, 1, True, True), ("b", 0, 7, False, False)]
    assert list(table.waiting) == [c] and c.num_computed == 0 and c.preemptions == 1 and c.hashes is None
    assert len(kv.table(a)) == 3 and c.request_id not in kv.requests
    # c was never sent to the ranks: its join and leave cancel out
    assert [n.request_id for n in planner.journal.take().added] == ["a", "b"]


def test_an_unread_lease_ends_before_anyone_is_preempted():
    planner, table, kv, (a, b, c) = three_full(num_blocks=8)
    leases = Leases(kv)
    planner.reclaim = leases.reclaim
    done = Request("done", list(range(500, 508)), P, 0, dp_rank=0)
    assert kv.admit(done, 0, 8) == 0
    leases.take(done, 8, lease_s=60.0)  # the last 2 blocks, held for a decode worker
    assert kv.num_free(0) == 0
    work, _, blocked = planner.plan(0)
    assert leases.reclaimed == 1 and planner.preemptions == 0 and not blocked and not table.waiting
    assert shape(work)[0] == ("a", 8, 1, True, True)


def test_the_newest_request_waits_when_no_one_is_newer():
    planner, table, kv, (a, b, c) = three_full(decoder=2)
    planner.reclaim = lambda dp: False
    work, _, blocked = planner.plan(0)
    # c decodes first but only a newer request could give it a block: it waits; a prefills its 8 and samples,
    # b gets no budget
    assert blocked and planner.preemptions == 0 and not table.waiting
    assert shape(work) == [("a", 0, 8, True, False)]


def test_a_request_with_a_step_in_flight_is_not_preempted_the_next_newest_is():
    planner, table, kv, (a, b, c) = three_full()
    planner.in_flight[7] = {"c": c}  # step 7 fed c and is not applied yet: its KV is being written
    work, _, blocked = planner.plan(8)
    assert list(table.waiting) == [b] and planner.preemptions == 1 and not blocked
    assert shape(work) == [("a", 8, 1, True, True), ("c", 0, 7, False, False)]
