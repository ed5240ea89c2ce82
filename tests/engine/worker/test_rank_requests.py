"""A rank's copy of its DP group's requests, on its own: plans' changes in order (finished, added, blocks), only its
own DP group's requests, wire items turned into SeqWork with what the rank keeps, slots given back."""

import torch

from engine.params import SamplingParams
from engine.sampling.logits_processors import SamplingState
from engine.step import NewRequest, StepItem, StepPlan
from engine.worker.rank_requests import RankRequests

P = SamplingParams(temperature=0.0, max_tokens=4)


def new(rid: str, dp: int, seed: int = 0) -> NewRequest:
    return NewRequest(request_id=rid, dp_rank=dp, prompt=(1, 2, 3), output=(), params=P, seed=seed)


def item(rid: str, start: int, tokens: list[int]) -> StepItem:
    return StepItem(request_id=rid, token_ids=tokens, start=start, sample=True, num_generated=0, decode=False)


def test_plans_build_the_work_of_this_dp_rank_only():
    state = SamplingState(16, (0,), torch.device("cpu"))
    ranks = RankRequests(1, state)
    plan = StepPlan(0, [[item("a", 0, [1, 2, 3])], [item("b", 0, [1, 2, 3])]], added=(new("a", 0), new("b", 1, 7)),
                    blocks={"a": (4,), "b": (5, 6)})
    (work,) = ranks.apply(plan)
    assert set(ranks.requests) == {"b"}  # "a" runs on DP rank 0
    assert (work.request_id, work.block_table, work.seed, work.params, work.token_ids) == ("b", [5, 6], 7, P, [1, 2, 3])
    assert work.slot == ranks.requests["b"].slot >= 0
    (work,) = ranks.apply(StepPlan(1, [[], [item("b", 3, [9])]], blocks={"b": (8,)}))  # a block appended
    assert work.block_table == [5, 6, 8] and work.start == 3


def test_a_finished_request_leaves_before_one_is_added_and_its_slot_is_reused():
    state = SamplingState(16, (0,), torch.device("cpu"))
    ranks = RankRequests(0, state)
    ranks.apply(StepPlan(0, [[item("a", 0, [1])]], added=(new("a", 0),), blocks={"a": (0,)}))
    slot = ranks.requests["a"].slot
    (work,) = ranks.apply(StepPlan(1, [[item("a", 0, [1])]], finished=("a",), added=(new("a", 0, 3),),
                                   blocks={"a": (2,)}))  # preempted and re-admitted in one plan: a fresh copy
    assert work.block_table == [2] and work.seed == 3 and ranks.requests["a"].slot == slot
    ranks.apply(StepPlan(2, [[]], finished=("a", "never-seen")))
    assert ranks.requests == {}
