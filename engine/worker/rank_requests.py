"""A rank's copy of its attention-DP group's requests, kept from the plans' changes (``engine.step.StepPlan``):
each request's block table and its slot in the rank's sampling state. Each step's wire items (``StepItem``)
become the runner's ``SeqWork`` here."""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.params import SamplingParams
from engine.sampling.logits_processors import SamplingState
from engine.step import SeqWork, StepItem, StepPlan

ITEM_FIELDS = tuple(f.name for f in fields(StepItem))


@dataclass
class RankRequest:
    table: list[int]
    params: SamplingParams
    seed: int
    slot: int


class RankRequests:
    """The requests of attention-DP rank ``dp_rank`` as every rank of its group keeps them."""

    def __init__(self, dp_rank: int, sampling: SamplingState):
        self.dp_rank, self.sampling = dp_rank, sampling
        self.requests: dict[str, RankRequest] = {}

    def apply(self, plan: StepPlan) -> list[SeqWork]:
        """Applies ``plan``'s changes (finished first, then added, then new blocks) → this rank's work."""
        for rid in plan.finished:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.sampling.remove(req.slot)
        for new in plan.added:
            if new.dp_rank == self.dp_rank:
                self.requests[new.request_id] = RankRequest([], new.params, new.seed, self.sampling.add(new))
        work = []
        for item in plan.work[self.dp_rank]:
            req = self.requests[item.request_id]
            req.table += plan.blocks.get(item.request_id, ())
            work.append(SeqWork(**{name: getattr(item, name) for name in ITEM_FIELDS}, block_table=list(req.table),
                                params=req.params, seed=req.seed, slot=req.slot))
        return work
