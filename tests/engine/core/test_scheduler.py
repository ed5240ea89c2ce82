"""The scheduler's components one by one (``engine/core/``): the request table, admission, the step planner, the
output processor and the rank journal, each on hand-worked cases, and the orchestrator's ``stats()``."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig, RequestError
from engine.core.journal import RankJournal
from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.requests import Request, RequestTable
from engine.core.scheduler import Scheduler
from engine.params import SamplingParams
from engine.step import StepResult, sample_id

CFG = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, block_size=4, num_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def scheduler(dp_size=1, **over) -> Scheduler:
    return Scheduler(CFG.replace(**over), dp_size, 100, (1,))


def results(plan, tokens=(5,)) -> dict[str, StepResult]:
    return {w.request_id: StepResult(list(tokens), [0.0] * len(tokens), [[]] * len(tokens))
            for per_rank in plan.work for w in per_rank if w.sample}


# ---- the request table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "params", "dp_rank", "message"), [
    ([], GREEDY, None, "prompt is empty"),
    ([3, 100], GREEDY, None, r"prompt token ids must be in \[0, 100\), got \[100\]"),
    (list(range(90)), dataclasses.replace(GREEDY, max_tokens=40), None, "exceeds max_model_len 128"),
    ([3], dataclasses.replace(GREEDY, n=5), None, "n=5 is above max_num_seqs=4"),
    ([3], GREEDY, 2, r"data_parallel_rank must be in \[0, 2\), got 2"),
])
def test_the_table_refuses_what_can_never_run_naming_the_field(prompt, params, dp_rank, message):
    table = RequestTable(CFG, 2, 100, 0)
    with pytest.raises(RequestError, match=message):
        table.add("r", prompt, params, 0, dp_rank)
    assert not table.knows("r") and not table.waiting


def test_a_request_larger_than_the_pool_and_a_reused_id_are_refused():
    table = RequestTable(CFG.replace(num_blocks=8), 1, 100, 0)
    with pytest.raises(RequestError, match="needs 9 KV blocks"):
        table.add("big", list(range(30)), dataclasses.replace(GREEDY, max_tokens=5), 0)
    table.add("r", [3, 4], GREEDY, 0)
    with pytest.raises(RequestError, match="'r' is already in use"):
        table.add("r", [3, 4], GREEDY, 0)


def test_n_samples_fork_from_one_request_or_queue_at_once_for_a_one_token_prompt():
    table = RequestTable(CFG, 1, 100, 0)
    parent = table.add("a", [3, 4, 5], dataclasses.replace(GREEDY, n=3), 10)
    assert parent.fork_n == 3 and list(table.waiting) == [parent] and table.members("a") == [parent]
    samples = table.samples_of(parent)
    assert [(s.request_id, s.seed, s.params.seed, s.params.n, s.client_id, s.index) for s in samples] == [
        (sample_id("a", i), 10 + i, 10 + i, 1, "a", i) for i in range(3)]
    first = table.add("b", [7], dataclasses.replace(GREEDY, n=2), 0)
    assert first.request_id == sample_id("b", 0) and [r.request_id for r in table.members("b")] == [
        sample_id("b", 0), sample_id("b", 1)]
    for req in table.members("b"):
        table.remove(req)
    assert not table.knows("b") and table.knows("a")


# ---- admission -----------------------------------------------------------------------------------------------


def test_admission_places_on_the_longest_cached_prefix_then_the_most_free_blocks():
    sched = scheduler(dp_size=2)
    sched.add("first", list(range(10, 30)), GREEDY, 0)  # 20 tokens: placed on rank 0 (equal pools: lowest rank)
    while sched.has_work():
        plan = sched.schedule()
        sched.update(plan, results(plan))
    sched.add("other", list(range(50, 60)), GREEDY, 0)
    sched.add("again", list(range(10, 30)), GREEDY, 0)
    plan = sched.schedule()
    placed = {w.request_id: dp for dp, per_rank in enumerate(plan.work) for w in per_rank}
    assert placed == {"other": 0, "again": 0}  # rank 0: 'again' hits the cache; 'other' ties on free blocks
    assert {w.request_id: w.start for w in plan.work[0]} == {"other": 0, "again": 16}


def test_admission_stops_at_max_num_seqs_and_a_pinned_request_waits_without_holding_up_the_rest():
    sched = scheduler(dp_size=2, max_num_seqs=1)
    sched.add("a", [3, 4], GREEDY, 0, dp_rank=0)
    sched.add("pinned", [3, 4], GREEDY, 0, dp_rank=0)
    sched.add("free", [3, 4], GREEDY, 0)
    plan = sched.schedule()
    assert [[w.request_id for w in r] for r in plan.work] == [["a"], ["free"]]
    assert sched.stats().blocked == "max_num_seqs" and sched.stats().waiting == 1


def test_reserve_allocation_takes_the_whole_request_at_admission():
    for allocation, blocks in (("on_demand", 1), ("reserve", 3)):  # 3 prompt + 8 new tokens = 11 slots, blocks of 4
        sched = scheduler(kv_allocation=allocation)
        sched.add("r", [3, 4, 5], dataclasses.replace(GREEDY, max_tokens=8), 0)
        plan = sched.schedule()
        assert len(plan.blocks["r"]) == blocks, allocation


# ---- the step planner ----------------------------------------------------------------------------------------


def test_decodes_go_first_and_prefills_take_chunks_of_the_rest_of_the_budget():
    sched = scheduler(max_num_batched_tokens=8)
    sched.add("d", [3, 4], GREEDY, 0)
    plan = sched.schedule()
    sched.update(plan, results(plan))
    sched.add("p", list(range(10, 30)), GREEDY, 0)
    plan = sched.schedule()
    assert [(w.request_id, len(w.token_ids), w.decode, w.sample) for w in plan.work[0]] == [
        ("d", 1, True, True), ("p", 7, False, False)]


def test_a_capped_long_prefill_leaves_room_for_the_short_prompt_behind_it():
    sched = scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    sched.add("long", list(range(10, 50)), GREEDY, 0)
    sched.add("short", [3, 4, 5], GREEDY, 0)
    plan = sched.schedule()
    assert [(w.request_id, len(w.token_ids), w.sample) for w in plan.work[0]] == [("long", 6, False),
                                                                                  ("short", 3, True)]
    sched.update(plan, results(plan))
    plan = sched.schedule()  # the short one decodes first; the long one's next chunk is capped again
    assert [(w.request_id, len(w.token_ids)) for w in plan.work[0]] == [("short", 1), ("long", 6)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        scheduler(long_prefill_token_threshold=-1)


def test_preemption_takes_the_latest_admitted_and_it_resumes_first_with_its_output():
    sched = scheduler(num_blocks=33, max_num_batched_tokens=64)  # 32 blocks of 4 for one max_model_len request
    sched.add("old", list(range(10, 70)), dataclasses.replace(GREEDY, max_tokens=60), 0)
    sched.add("new", list(range(10, 70)), dataclasses.replace(GREEDY, max_tokens=60), 0)
    preempted_at = None
    for step in range(200):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if preempted_at is None and sched.stats().preemptions:
            preempted_at = step
            assert [w.request_id for w in plan.work[0]] == ["old"]
        sched.update(plan, results(plan))
    assert preempted_at is not None and not sched.has_work() and sched.blocks_in_use() == 0


# ---- the output processor ------------------------------------------------------------------------------------


def test_a_stop_id_wins_over_a_stop_string_on_the_same_token_and_min_tokens_holds_both_back():
    sched = scheduler()
    sched.add("id", [3, 4], dataclasses.replace(GREEDY, stop_token_ids=(7,), stop=("x",), ignore_eos=False), 0)
    sched.add("min", [3, 4], dataclasses.replace(GREEDY, stop_token_ids=(7,), min_tokens=2), 0)
    plan = sched.schedule()
    out = {o.request_id: o for o in sched.update(plan, results(plan, (7,)), {"id": (0, "x")})}
    assert (out["id"].finish_reason, out["id"].stop_reason) == ("stop", 7)
    assert not out["min"].finished  # one token out of min_tokens=2


def test_a_speculative_result_is_cut_at_the_stop_string_the_front_found():
    sched = Scheduler(CFG, 1, 100, (1,), spec_reserve_slots=4)
    sched.add("r", [3, 4], dataclasses.replace(GREEDY, max_tokens=10, stop=("ab",)), 0)
    plan = sched.schedule()
    sched.update(plan, results(plan))
    plan = sched.schedule()
    assert plan.work[0][0].spec
    out = sched.update(plan, results(plan, (8, 9, 10, 11)), {"r": (1, "ab")})
    assert (out[0].new_tokens, out[0].finish_reason, out[0].stop_reason, out[0].num_output_tokens) == (
        [8, 9], "stop", "ab", 3)
    assert sched.blocks_in_use() == 0


def test_length_ends_at_max_tokens():
    sched = scheduler()
    sched.add("r", [3, 4], dataclasses.replace(GREEDY, max_tokens=2), 0)
    reasons = []
    while sched.has_work():
        plan = sched.schedule()
        reasons += [o.finish_reason for o in sched.update(plan, results(plan))]
    assert reasons == [None, "length"]


# ---- the journal ---------------------------------------------------------------------------------------------


def test_the_journal_never_sends_a_request_that_left_before_the_ranks_heard_of_it():
    journal, req = RankJournal(), Request("r", [3, 4], GREEDY, 0, dp_rank=0)
    journal.joined(req)
    journal.left(req)
    assert journal.take() == journal.take() and journal.take().added == () and journal.take().finished == ()
    journal.joined(req)
    assert [a.request_id for a in journal.take().added] == ["r"] and req.sent_blocks == 0
    assert journal.new_blocks(req, [4, 9]) == (4, 9) and journal.new_blocks(req, [4, 9]) is None
    journal.copy(0, 4, 5)
    journal.left(req)
    changes = journal.take()
    assert changes.finished == ("r",) and changes.copies == ((0, 4, 5),) and req.sent_blocks == -1


def test_stats_count_per_rank_and_the_kv_manager_owns_the_prefix_caching_switch():
    for caching in (True, False):
        sched = scheduler(prefix_caching=caching)
        for rid in ("a", "b"):
            sched.add(rid, list(range(10, 30)), GREEDY, 0)
            while sched.has_work():
                plan = sched.schedule()
                sched.update(plan, results(plan))
        s = sched.stats()
        assert (s.running, s.waiting, s.has_work, s.blocks_in_use) == (0, 0, False, 0)
        assert s.cached_tokens == (16 if caching else 0) and s.prompt_tokens == 40
        kv = KVManager(KVManagerConfig(num_blocks=4, kv_block_size=4, dp_size=1, prefix_caching=caching))
        assert kv.hashes(Request("x", list(range(9)), GREEDY, 0)) == ([] if not caching else kv.index.hashes(
            list(range(9))))
