"""What the ranks must learn with the next plan that has work: requests added (with their settings, once),
requests that left them (ended or preempted), each item's new block-table entries, a fork's block copies and the KV
loads to wait for."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.requests import Request
from engine.step import NewRequest


@dataclass(frozen=True)
class Changes:
    """One plan's request changes (``StepPlan.added``, ``finished``, ``copies``)."""

    added: tuple[NewRequest, ...]
    finished: tuple[str, ...]
    copies: tuple[tuple[int, int, int], ...]
    loads: tuple[int, ...]


class RankJournal:
    """Kept by the scheduler between plans; a plan with work takes it (:meth:`take`). A request's
    ``sent_blocks`` says how much of its block table its ranks hold (-1: the ranks do not hold it)."""

    def __init__(self):
        self._added: list[NewRequest] = []
        self._finished: list[str] = []
        self._copies: list[tuple[int, int, int]] = []
        self._loads: list[int] = []

    def joined(self, req: Request) -> None:
        """``req`` runs on its rank from the next plan: prompt, output to replay, params and seed go once."""
        req.sent_blocks = 0
        self._added.append(NewRequest(request_id=req.request_id, dp_rank=req.dp_rank, prompt=tuple(req.prompt),
                                      output=tuple(req.output), params=req.params, seed=req.seed))

    def left(self, req: Request) -> None:
        """The ranks drop ``req`` with the next plan (it ended or was preempted; re-admission adds it again)."""
        if req.sent_blocks < 0:
            return
        unsent = [a for a in self._added if a.request_id == req.request_id]
        if unsent:  # joined since the last plan: the ranks never heard of it
            self._added.remove(unsent[0])
        else:
            self._finished.append(req.request_id)
        req.sent_blocks = -1

    def copy(self, dp: int, src: int, dst: int) -> None:
        """DP rank ``dp`` copies block ``src`` into ``dst`` before the next step (a fork's partial block)."""
        self._copies.append((dp, src, dst))

    def loaded(self, load_id: int) -> None:
        """Every rank waits for load ``load_id`` before the next step (its blocks are read or handed out then)."""
        self._loads.append(load_id)

    @staticmethod
    def new_blocks(req: Request, table: list[int]) -> tuple[int, ...] | None:
        """The entries of ``table`` (``req``'s block table) its ranks do not hold yet, now counted as sent."""
        if len(table) <= req.sent_blocks:
            return None
        new, req.sent_blocks = tuple(table[req.sent_blocks:]), len(table)
        return new

    def take(self) -> Changes:
        """The changes since the last plan with work, and a fresh journal."""
        changes = Changes(tuple(self._added), tuple(self._finished), tuple(self._copies), tuple(self._loads))
        self._added, self._finished, self._copies, self._loads = [], [], [], []
        return changes
