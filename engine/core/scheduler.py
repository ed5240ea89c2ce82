"""Continuous batching with chunked prefill, on-demand KV blocks with recompute preemption, prefix caching,
admission limits and abort; one waiting queue, one running set per attention-DP rank.

The scheduler only wires its components and keeps their order within a step (each file says its policy):
the request table (``requests.py``: intake, validation, ``n > 1`` fan-out, where each request is), admission
(``admission.py``: placement on DP ranks, the reserve, deferral behind a prefix being prefilled), the step planner
(``planner.py``: the items, preemption, overlap), the output processor (``outputs.py``: finish reasons, outputs)
and the journal of what the ranks must learn (``journal.py``). Blocks are the KV manager's (``kv_manager.py``).

- Committed tokens (KV of target and drafter written, ids known) are handed to the KV manager after every step;
  it indexes their full blocks.
- Limits apply per DP rank, as with vLLM's per-DP-rank engines: ``max_num_seqs`` running,
  ``max_num_batched_tokens`` fed per forward.
- Every end (stop, length, abort, error) releases the request's blocks.
- KV from elsewhere: a request added with ``kv_tokens`` is admitted with its blocks reserved and waits, placed but
  not fed, while its load runs off the step thread (:meth:`take_loads`, :meth:`loaded`); the others' steps go on.
- ``overlap`` (``engine.overlap=on``, plain decoding only): a request that stops (or is aborted) at step n may be in
  step n+1 already: that step's token for it is discarded, and its blocks were freed once, when it ended.
- ``n > 1``: one request prefills the prompt but its last token and then forks into n samples (seeds ``seed + i``)
  that share its full blocks; a forking request holds n running slots from admission.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.blocks import blocks_for
from engine.config import EngineConfig, RequestError
from engine.core.admission import Admission, KVLoad
from engine.core.journal import RankJournal
from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.leases import Leases
from engine.core.outputs import OutputProcessor
from engine.core.planner import StepPlanner
from engine.core.requests import Request, RequestTable
from engine.core.spec_policy import SpecPolicy
from engine.core.step_record import RankLoad
from engine.params import SamplingParams
from engine.step import RequestOutput, StepPlan, StepResult


@dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    """The scheduler at one moment (:meth:`Scheduler.stats`). ``blocked``: why the last plan left work waiting —
    "kv" (no free blocks for the queue's head or a running item), "max_num_seqs" (no running slot for the head) or
    "". Token and preemption figures count since start."""

    per_dp: tuple[RankLoad, ...]
    blocked: str
    running: int
    waiting: int
    blocks_in_use: int
    loading: int  # of the waiting, those whose KV is being loaded (placed on their rank, not fed yet)
    preemptions: int
    prefix_waits: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def has_work(self) -> bool:
        return self.running + self.waiting > 0


class Scheduler:
    def __init__(self, cfg: EngineConfig, dp_size: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 spec_reserve_slots: int = 0, namespace: bytes = b"", retain_after: frozenset[int] = frozenset(),
                 host_slots: int = 0, store_lookup: Callable[[list[int]], int] | None = None,
                 spec_policy: SpecPolicy | None = None):
        """``spec_reserve_slots`` > 0 turns speculative decoding on: decodes become draft + verify steps, each writing
        that many KV slots (its tree). ``namespace``: what the prefix cache's hashes are computed under (model,
        drafter, KV dtype, numerics, layout). ``retain_after``: token ids that, ending an output, retain its KV.
        ``host_slots``: the host KV tier's blocks per attention-DP rank (0: none). ``store_lookup(hashes)``: leading
        blocks of ``hashes`` the shared KV store holds (None: no store). ``spec_policy``: whether a step's decodes
        speculate (``engine.core.spec_policy``; None: always)."""
        length, cache = cfg.scheduler.max_model_len, cfg.cache
        if length is None:
            raise ValueError("engine.max_model_len is unset: resolve it with EngineConfig.for_model first")
        need = blocks_for(length + spec_reserve_slots, cache.block_size)
        if need > cache.num_blocks:  # vLLM's rule: else a request that fits max_model_len could wait forever
            raise RequestError(f"engine.num_blocks={cache.num_blocks} (blocks of {cache.block_size} tokens) cannot "
                               f"hold one max_model_len={length} request plus its speculative scratch of "
                               f"{spec_reserve_slots} slots: it needs {need} blocks; raise engine.num_blocks or "
                               "lower engine.max_model_len")
        self.cfg, self.dp_size, self.spec_reserve_slots = cfg, dp_size, spec_reserve_slots
        self.overlap = cfg.runner.overlap == "on" and spec_reserve_slots == 0  # a verify's start needs its accepted
        self.kv = KVManager(KVManagerConfig(num_blocks=cache.num_blocks, kv_block_size=cache.block_size,
                                            dp_size=dp_size, prefix_caching=cache.prefix_caching,
                                            retention_s=cache.kv_retention_s, namespace=namespace,
                                            host_slots=host_slots, host_write=cache.host_kv_write,
                                            store=store_lookup is not None))
        self.table = RequestTable(cfg, dp_size, vocab_size, spec_reserve_slots)
        self.leases = Leases(self.kv)  # blocks a prefill keeps for a decode worker to read
        self.journal = RankJournal()
        self.admission = Admission(cfg, self.table, self.kv, self.journal, store_lookup, self.leases.reclaim)
        self.planner = StepPlanner(cfg, self.table, self.kv, self.journal, spec_reserve_slots, self.overlap,
                                   spec_policy, self.leases.reclaim)
        self.outputs = OutputProcessor(cfg, self.kv, eos_token_ids, self.overlap, retain_after, self._finish,
                                       self._fork)
        self._steps = itertools.count()
        self._last_fed: set[str] = set()  # the requests the last plan fed (share_inflight_prefix waits only on them)
        self._blocked = ""

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int, dp_rank: int | None = None,
            retain_kv: bool = False, kv_tokens: int = 0, lease_s: float = 0.0, kv_origin: str = "") -> Request:
        """Queues a request (:meth:`RequestTable.add`); raises RequestError naming the field."""
        return self.table.add(request_id, prompt, params, seed, dp_rank, retain_kv, kv_tokens, lease_s, kv_origin)

    def take_loads(self) -> list[KVLoad]:
        """The KV loads admission started since the last call (:meth:`Admission.take_loads`)."""
        return self.admission.take_loads()

    def loaded(self, load_id: int, failed: bool = False) -> None:
        """Load ``load_id`` is done: its request (if it still runs) has its loaded tokens computed and committed, and
        is fed from the next step; every rank waits for the load before that step. ``failed`` (a store error on some
        rank): the request computes those tokens itself instead, in the blocks it holds."""
        self.journal.loaded(load_id)
        for req in self.table.requests.values():
            if req.loading == load_id:
                if not failed:
                    req.num_computed = req.kv_tokens
                    self.kv.commit(req, req.num_computed)
                req.num_cached = min(req.num_cached, req.num_computed)
                req.kv_tokens, req.loading = 0, -1
                return

    def has_work(self) -> bool:
        return self.table.has_work()

    def schedule(self) -> StepPlan:
        """Admits what fits, then plans the step; its plan carries the request changes since the last plan with
        work (a plan without work is not broadcast: the ranks hear of them with the next one)."""
        self._blocked = self.admission.admit(self._last_fed)
        overlap = self.overlap and not any(r.params.constraint is not None for rs in self.table.running for r in rs)
        step_id = next(self._steps)
        work, blocks, blocked = self.planner.plan(step_id)
        if blocked:
            self._blocked = "kv"
        fed = {w.request_id for per_rank in work for w in per_rank}
        self._last_fed = fed
        if not fed:
            return StepPlan(step_id, work, overlap=overlap)
        changes = self.journal.take()
        return StepPlan(step_id, work, overlap=overlap, added=changes.added, finished=changes.finished, blocks=blocks,
                        copies=changes.copies, loads=changes.loads)

    def update(self, plan: StepPlan, results: Mapping[str, StepResult],
               stopped: Mapping[str, tuple[int, str]] | None = None) -> list[RequestOutput]:
        """Applies a finished step (:meth:`OutputProcessor.apply`); ``stopped``: request id → (token index, string)
        of the stop-string matches the front found in ``results``."""
        items = [w for per_rank in plan.work for w in per_rank]
        return self.outputs.apply(items, self.planner.applied(plan.step_id), results, stopped or {})

    def _fork(self, parent: Request) -> None:
        """``parent`` has computed its prompt but the last token: its n samples take its KV (full blocks shared, the
        partial one copied on the ranks) and each feeds the last prompt token and samples with its own seed."""
        dp, computed, table = parent.dp_rank, len(parent.feed_tokens), self.table
        at = table.running[dp].index(parent)
        for i, child in enumerate(table.samples_of(parent)):
            child.num_computed, copy = self.kv.fork(parent, child, computed)
            child.dp_rank, child.admitted, child.num_cached = dp, parent.admitted, parent.num_cached
            if copy is not None:
                self.journal.copy(dp, *copy)
            table.register(child)
            table.running[dp].insert(at + 1 + i, child)
            self.journal.joined(child)
        self.kv.free(parent)
        self.journal.left(parent)
        table.remove(parent)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.loading >= 0:  # its blocks go back now: whoever gets them waits for the load first
            self.journal.loaded(req.loading)
        if req.dp_rank is not None and req.lease_s > 0 and reason != "abort":
            self.leases.take(req, self._leasable_tokens(req), req.lease_s)
        elif req.dp_rank is not None:
            self.kv.free(req)
        self.journal.left(req)
        self.table.remove(req)

    def _leasable_tokens(self, req: Request) -> int:
        """Prompt tokens of a finished ``req`` whose KV (target and drafter context) is written: all of them
        without speculation; with it, its committed full blocks (the drafter's context of the prompt's tail waits
        for the first verify)."""
        if not self.spec_reserve_slots:
            return min(req.num_computed, len(req.prompt))
        return min(self.kv.committed_blocks(req) * self.cfg.cache.block_size, len(req.prompt))

    @property
    def blocked(self) -> str:
        """Why the last plan left work waiting: "kv", "max_num_seqs" or ""."""
        return self._blocked

    def knows(self, request_id: str) -> bool:
        return self.table.knows(request_id)

    def abort_all(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """Ends a request now (client cancel, deadline, error) and frees its blocks: one finished output per sample
        still running (n > 1: every sample; none for an unknown id)."""
        outs = []
        for req in self.table.members(request_id):
            self._finish(req, reason)
            if req.fork_n:  # not forked yet: each sample ends here
                outs += [RequestOutput(request_id=request_id, index=i, new_tokens=[], finished=True,
                                       finish_reason=reason, num_prompt_tokens=len(req.prompt), num_output_tokens=0)
                         for i in range(req.fork_n)]
                continue
            outs.append(RequestOutput(request_id=req.client_id, index=req.index, new_tokens=[], finished=True,
                                      finish_reason=reason, num_prompt_tokens=len(req.prompt),
                                      num_output_tokens=len(req.output), num_cached_tokens=req.num_cached))
        return outs

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput:
        """:meth:`abort_all`, returning the last sample's output; an unknown id is a RequestError."""
        outs = self.abort_all(request_id, reason)
        if not outs:
            raise RequestError(f"unknown request_id {request_id!r}")
        return outs[-1]

    def blocks_in_use(self) -> int:
        """Referenced blocks (cached unreferenced ones count as free)."""
        return self.kv.blocks_in_use()

    def stats(self) -> SchedulerStats:
        """The scheduler now, per attention-DP rank and in total (unpinned waiting requests count on rank 0)."""
        table, kv = self.table, self.kv
        waiting, deferred = [0] * self.dp_size, [0] * self.dp_size
        for r in table.waiting:
            dp = r.pinned_dp if r.pinned_dp is not None else 0
            waiting[dp] += 1
            deferred[dp] += r.deferred
        loading = [table.loading(dp) for dp in range(self.dp_size)]
        uncached = self.admission.waiting_uncached_tokens() if table.waiting else 0
        per_dp = tuple(RankLoad(running=len(table.running[dp]) - loading[dp], waiting=waiting[dp] + loading[dp],
                                deferred=deferred[dp], loading=loading[dp], blocks_used=pool.num_used,
                                blocks_cached=pool.num_cached, blocks_empty=pool.num_empty,
                                blocks_total=pool.num_blocks,
                                waiting_uncached_tokens=uncached if dp == 0 else 0, cache_hit_rate=kv.hit_rate_of(dp))
                       for dp, pool in enumerate(kv.pools))
        return SchedulerStats(per_dp=per_dp, blocked=self._blocked, running=table.num_running() - sum(loading),
                              waiting=len(table.waiting) + sum(loading), loading=sum(loading),
                              blocks_in_use=kv.blocks_in_use(),
                              preemptions=self.planner.preemptions, prefix_waits=self.admission.prefix_waits,
                              prompt_tokens=kv.prompt_tokens, cached_tokens=kv.cached_tokens)
