"""The step planner: each step's items per attention-DP rank, the blocks they write, and recompute preemption.

- Each step per DP rank: every running decode gets one token first, then prefills (oldest first) take chunks of the
  remaining ``max_num_batched_tokens``, each at most ``long_prefill_token_threshold`` when that is set. A prompt
  longer than the budget is prefilled over several steps; only the chunk that completes it samples. ``on_demand``:
  each item's blocks are allocated for what the step writes (a speculative item: its tree's scratch).
- Preemption (``on_demand``): when an item's blocks are not free, the running request admitted last on that rank is
  preempted — vLLM's FCFS rule: the oldest request always progresses (no livelock) and the newest has the least to
  recompute. Never one already in this step, nor one with a step in flight (``overlap``: its KV is being written):
  then the item waits a step; nor one whose KV is being loaded (a load writes its blocks). A preempted request
  frees its blocks through the prefix cache (its committed blocks
  stay cached, so its resume hits them), drops its speculative state and goes back to the front of the queue; on
  resume it prefills prompt + output and samples its next token.
- ``overlap``: step n+1 is planned before step n's tokens are back. A request sampled in step n then feeds a
  placeholder that the device fills from step n's sampled row (``SeqWork.prev_row``); its KV counts as computed when
  it is scheduled; a request whose in-flight token reaches its length limit is not scheduled again.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.journal import RankJournal
from engine.core.kv_manager import KVManager
from engine.core.requests import Request, RequestTable
from engine.core.spec_policy import AlwaysSpeculate, SpecPolicy
from engine.step import StepItem


class StepPlanner:
    def __init__(self, cfg: EngineConfig, table: RequestTable, kv: KVManager, journal: RankJournal,
                 spec_reserve_slots: int, overlap: bool, policy: SpecPolicy | None = None,
                 reclaim: Callable[[int], bool] = lambda dp: False):
        """``policy``: whether a step's decodes speculate (``spec_decode.adaptive``); ``reclaim(dp)``: frees blocks
        held for others on rank ``dp`` (an unread PD lease) before any preemption, False when none are."""
        self.cfg, self.table, self.kv, self.journal, self.reclaim = cfg, table, kv, journal, reclaim
        self.spec_reserve_slots, self.overlap = spec_reserve_slots, overlap
        self.policy = policy or AlwaysSpeculate()  # whether this step's decodes speculate (spec_decode.adaptive)
        self.in_flight: dict[int, dict[str, Request]] = {}  # step id → the requests it feeds, until its update
        self.preemptions = 0

    def plan(self, step_id: int) -> tuple[list[list[StepItem]], dict[str, tuple[int, ...]], bool]:
        """Step ``step_id``'s items per DP rank, each fed request's new block-table entries, and whether a request
        waited for blocks no preemption could free."""
        work, scheduled, blocks, blocked = [], {}, {}, False
        speculating = self.spec_reserve_slots > 0 and self._speculates()
        for dp in range(self.table.dp_size):
            budget, items, row = self.cfg.scheduler.max_num_batched_tokens, [], 0
            cap = self.cfg.scheduler.long_prefill_token_threshold
            running = self.table.running[dp]
            total_of = {r.request_id: len(r.feed_tokens) + r.pending for r in running}
            decodes = [r for r in running if self._feeds_last_token(r, total_of[r.request_id])]
            for req in decodes + [r for r in running if r not in decodes]:
                if req.dp_rank != dp or req.request_id in scheduled or req.loading >= 0:  # preempted; or loading
                    continue
                total = total_of[req.request_id]
                n = min(total - req.num_computed, budget, cap if cap and req not in decodes else budget)
                if n <= 0 or self._ends_in_flight(req):
                    continue
                decode = self._feeds_last_token(req, total)
                spec = decode and speculating
                writes = self.spec_reserve_slots if spec else n  # a tree writes its whole reserve
                if not self._blocks_for_step(req, req.num_computed + writes, scheduled):
                    blocked = True
                    continue
                budget -= n
                done = req.num_computed + n == total
                items.append(self._item(req, n, done, decode, spec))
                new = self.journal.new_blocks(req, self.kv.table(req))
                if new is not None:
                    blocks[req.request_id] = new
                scheduled[req.request_id] = req
                if self.overlap:
                    req.num_computed += n
                    if done and not req.fork_n:
                        req.pending, req.pending_row = req.pending + 1, row
                if done and not spec and not req.fork_n:  # the runner samples plain rows in item order
                    row += 1
            work.append(items)
        if scheduled:
            self.in_flight[step_id] = scheduled
        return work, blocks, blocked

    def _speculates(self) -> bool:
        """The policy's choice for this step's decodes, asked once per step (every rank's decodes run one kind)."""
        decodes = sum(self._feeds_last_token(r, len(r.feed_tokens) + r.pending) and r.loading < 0
                      for running in self.table.running for r in running)
        return self.policy.speculate(decodes) if decodes else True

    @staticmethod
    def _item(req: Request, n: int, done: bool, decode: bool, spec: bool) -> StepItem:
        tokens = req.feed_tokens[req.num_computed:req.num_computed + n]
        prev_row = -1
        if len(tokens) < n:  # the last one is in flight: the device takes it from the previous step
            tokens, prev_row = tokens + [0], req.pending_row
        return StepItem(request_id=req.request_id, token_ids=tokens, start=req.num_computed,
                        sample=done and not req.fork_n, num_generated=len(req.output) + req.pending, decode=decode,
                        spec=spec, constrained=req.params.constraint is not None, prev_row=prev_row)

    def applied(self, step_id: int) -> dict[str, Request]:
        """The requests step ``step_id`` fed, now that its results are applied (no longer in flight)."""
        return self.in_flight.pop(step_id, {})

    @staticmethod
    def _feeds_last_token(req: Request, total: int) -> bool:
        """Whether ``req``'s next item feeds only its last generated token (a decode; a resumed request's earlier
        output is prefilled)."""
        return total - req.num_computed == 1 and len(req.output) + req.pending > 0

    def _blocks_for_step(self, req: Request, slots: int, scheduled: dict[str, Request]) -> bool:
        """Grows ``req``'s blocks to ``slots``, ending unread leases, then preempting lower-priority requests of its
        rank while they are short; False when nothing can make room (the item waits)."""
        while not self.kv.allocate(req, slots):
            if self.reclaim(req.dp_rank):
                continue
            victim = self._victim(req, scheduled)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _victim(self, req: Request, scheduled: dict[str, Request]) -> Request | None:
        """The running request of ``req``'s rank admitted last after it, not in this step and with no step in
        flight; None if there is none."""
        in_flight = {rid for step in self.in_flight.values() for rid in step}
        candidates = [r for r in self.table.running[req.dp_rank] if r.admitted > req.admitted and r.pending == 0
                      and r.loading < 0 and r.request_id not in scheduled and r.request_id not in in_flight]
        return max(candidates, key=lambda r: r.admitted, default=None)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: its blocks go back through the prefix cache, it returns to the queue's front."""
        self.kv.free(req)
        self.journal.left(req)
        self.table.requeue(req)
        req.num_computed, req.preemptions, req.hashes = 0, req.preemptions + 1, None  # its output joins its feed
        self.preemptions += 1

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether a token already sampled for ``req`` (overlap: not read back yet) reaches its length limit."""
        p = req.params
        return req.pending > 0 and (len(req.output) + req.pending >= p.max_tokens
                                    or len(req.tokens) + req.pending >= self.cfg.scheduler.max_model_len)
