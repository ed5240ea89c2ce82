"""Continuous batching with chunked prefill, on-demand KV blocks with recompute preemption, prefix caching,
admission limits and abort; one waiting queue, one running set per attention-DP rank.

Policy (written down here because vLLM and SGLang differ; blocks themselves are ``engine/kv_manager.py``'s):
- One waiting queue, first come first served. A request is placed when it is admitted: on the attention-DP rank
  holding its longest cached prefix, then the one with most free blocks (``GenerateRequest.data_parallel_rank``, when
  set, pins it). Admission needs the blocks of its first chunk (``on_demand``) or of its whole request (``reserve``:
  prompt + max_tokens capped at max_model_len, plus the speculative scratch); the cached prefix needs none.
- Each step per DP rank: every running decode gets one token first, then prefills (oldest first) take chunks of
  the remaining ``max_num_batched_tokens``. A prompt longer than the budget is prefilled over several steps; only
  the chunk that completes it samples. ``on_demand``: each item's blocks are allocated for what the step writes
  (a speculative item: its tree's scratch).
- Preemption (``on_demand``): when an item's blocks are not free, the running request admitted last on that rank
  is preempted — vLLM's FCFS rule: the oldest request always progresses (no livelock) and the newest has the least
  to recompute. Never one already in this step, nor one with a step in flight (``overlap``: its KV is being
  written): then the item waits a step. A preempted request frees its blocks through the prefix cache (its
  committed blocks stay cached, so its resume hits them), drops its speculative state and goes back to the front of
  the queue; on resume it prefills prompt + output and samples its next token: its stream goes on with no token
  repeated or lost, and with the counter-based sampler its tokens are an unpreempted run's.
- Committed tokens (KV of target and drafter written, ids known) are handed to the KV manager after every step;
  it indexes their full blocks.
- Limits apply per DP rank, as with vLLM's per-DP-rank engines: ``max_num_seqs`` running,
  ``max_num_batched_tokens`` fed per forward.
- Every end (stop, length, abort, error) releases the request's blocks.
- ``overlap`` (``engine.overlap=on``, plain decoding only): step n+1 is planned before step n's tokens are back.
  A request sampled in step n then feeds a placeholder that the device fills from step n's sampled row
  (``SeqWork.prev_row``); its KV counts as computed when it is scheduled; a request whose in-flight token
  reaches its length limit is not scheduled again. A request that stops (or is aborted) at step n may be in step
  n+1 already: that step's token for it is discarded, and its blocks were freed once, when it ended.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.blocks import blocks_for
from engine.kv_manager import KVManager, KVManagerConfig
from engine.sampler import SamplingParams
from engine.step import NewRequest, RequestOutput, StepItem, StepPlan, StepResult
from engine.stop_strings import Detokenize, IncrementalDetokenizer, StopStrings

ALLOCATIONS = ("on_demand", "reserve")


def sample_id(request_id: str, index: int) -> str:
    """The scheduler's id of sample ``index`` of an ``n > 1`` request (its outputs carry ``request_id``)."""
    return f"{request_id}\x1f{index}"


class RequestError(ValueError):
    """A request the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context length (vLLM's rule; for_model)
    block_size: int = 16
    num_blocks: int = 1024  # per DP rank
    # decode / tree-verify steps over fixed-shape buffers (engine/cuda_graphs.py): "auto" = on a CUDA device,
    # where they are captured as CUDA graphs; "on" = everywhere (off CUDA they run eagerly); "off" = never
    static_steps: str = "auto"
    # on CUDA: share of the device's memory the engine may use; num_blocks is then sized from what is free after
    # the weights (engine/kv_budget.py). None: num_blocks as given. Off CUDA num_blocks is always used.
    gpu_memory_utilization: float | None = 0.9
    warm_up: bool = True  # the scripts run Engine.warm_up (every static shape, captured on CUDA) before serving
    overlap: str = "off"  # "on": the host schedules and stages step n+1 while step n runs (Engine.step)
    # every row's arithmetic independent of what shares its launch (model.kernel_select.batch_invariant_kernels):
    # speculation and batching give plain decoding's tokens bit for bit, in bf16 too; docs/batch_invariance.md
    batch_invariant: bool = False
    # count the distinct experts each MoE layer reads in decode/verify steps (model.expert_tally; GetEngineInfo
    # reports them): a few device ops per MoE layer, captured with the step. The bench turns it on.
    expert_tally: bool = False
    # full blocks of committed tokens indexed by a chained hash and reused by later requests (docs/kv_cache.md)
    prefix_caching: bool = True
    # a waiting request whose next uncached block a running request is prefilling waits for that block to be
    # committed, then hits it, rather than computing the shared prefix again (SGLang's in-batch prefix caching)
    share_inflight_prefix: bool = True
    # "on_demand": blocks allocated per step for what it writes, recompute preemption when they run out;
    # "reserve": prompt + max_tokens reserved at admission, never preempted
    kv_allocation: str = "on_demand"
    # a retained request's blocks (a turn that ended in a tool call, or one that asked) outlive plain LRU this long
    kv_retention_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RequestError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.static_steps not in ("auto", "on", "off"):
            raise RequestError(f"engine.static_steps must be auto, on or off, got {self.static_steps!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"engine.gpu_memory_utilization must be in (0, 1] or null, got "
                               f"{self.gpu_memory_utilization}")
        if self.overlap not in ("on", "off"):
            raise RequestError(f"engine.overlap must be on or off, got {self.overlap!r}")
        if self.kv_allocation not in ALLOCATIONS:
            raise RequestError(f"engine.kv_allocation must be one of {ALLOCATIONS}, got {self.kv_allocation!r}")
        if self.kv_retention_s < 0:
            raise RequestError(f"engine.kv_retention_s must be >= 0, got {self.kv_retention_s}")

    def for_model(self, context_len: int) -> SchedulerConfig:
        """This config for a model of ``context_len`` tokens (``max_position_embeddings``): ``max_model_len`` unset
        becomes it; one above it is refused, naming both."""
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=context_len)
        if self.max_model_len > context_len:
            raise RequestError(f"engine.max_model_len={self.max_model_len} is above the model's context length "
                               f"{context_len} (max_position_embeddings in its config.json); leave it unset or "
                               "lower it")
        return self


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    dp_rank: int | None = None  # placed at admission (None while waiting, unless pinned)
    pinned_dp: int | None = None  # GenerateRequest.data_parallel_rank
    retain_kv: bool = False  # keep its blocks past plain LRU when it ends (an agent's tool call, or asked)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (overlap: or in a launched step)
    num_cached: int = 0  # prompt tokens its first admission took from the prefix cache
    admitted: int = -1  # first admission's order (later = lower priority; kept across preemptions)
    hashes: list[int] | None = None  # its tokens' prefix-block hashes from admission (kv.prefix_hashes)
    deferred: bool = False  # the last admission pass put it off for a prefix being prefilled (share_inflight_prefix)
    preemptions: int = 0
    finish_reason: str | None = None
    pending: int = 0  # overlap: tokens sampled by launched steps, not yet read back
    pending_row: int = -1  # overlap: the latest of those steps' row for it (SeqWork.prev_row)
    stops: StopStrings | None = None  # its stop-string check (params.stop)
    stop_reason: int | str | None = None  # what ended it with "stop": a stop token id, or the stop string
    sent_blocks: int = -1  # block-table entries its ranks hold (-1: the ranks do not hold it)
    client_id: str = ""  # the id its outputs carry: its own, or (one of n samples) its request's
    index: int = 0  # which of its request's n samples
    fork_n: int = 0  # > 0: it prefills the prompt but its last token, then forks into this many samples

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def feed_tokens(self) -> list[int]:
        """The tokens it computes: a forking request stops short of the prompt's last token (each sample feeds it)."""
        return self.prompt[:-1] if self.fork_n else self.prompt + self.output


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, dp_size: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 spec_reserve_slots: int = 0, tokenizer: Detokenize | None = None, namespace: bytes = b"",
                 retain_after: frozenset[int] = frozenset()):
        """``spec_reserve_slots`` > 0 turns speculative decoding on: decodes become draft + verify steps, each writing
        that many KV slots (its tree). ``tokenizer`` detokenizes outputs for stop strings (without one, a request with
        stop strings is refused). ``namespace``: what the prefix cache's hashes are computed under (model, drafter, KV
        dtype, numerics, layout). ``retain_after``: token ids that, ending an output, retain its KV (tool calls)."""
        self.cfg, self.dp_size, self.vocab_size, self.eos = cfg, dp_size, vocab_size, set(eos_token_ids)
        self.tokenizer, self.retain_after = tokenizer, retain_after
        self.spec_reserve_slots = spec_reserve_slots
        if cfg.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len is unset: resolve it with for_model first")
        need = blocks_for(cfg.max_model_len + spec_reserve_slots, cfg.block_size)
        if need > cfg.num_blocks:  # vLLM's rule: else a request that fits max_model_len could wait forever
            raise RequestError(f"engine.num_blocks={cfg.num_blocks} (blocks of {cfg.block_size} tokens) cannot "
                               f"hold one max_model_len={cfg.max_model_len} request plus its speculative scratch of "
                               f"{spec_reserve_slots} slots: it needs {need} blocks; raise engine.num_blocks or "
                               "lower engine.max_model_len")
        self.kv = KVManager(KVManagerConfig(num_blocks=cfg.num_blocks, kv_block_size=cfg.block_size,
                                            dp_size=dp_size, prefix_caching=cfg.prefix_caching,
                                            retention_s=cfg.kv_retention_s, namespace=namespace))
        self.waiting: deque[Request] = deque()
        self.running: list[list[Request]] = [[] for _ in range(dp_size)]
        self.requests: dict[str, Request] = {}
        self.overlap = cfg.overlap == "on" and spec_reserve_slots == 0  # a verify's next start needs its accepted count
        self._scheduled: dict[int, dict[str, Request]] = {}  # step id → the requests it feeds, until its update
        self._steps = itertools.count()
        self._admissions = itertools.count()
        self.preemptions = 0
        self.prefix_waits = 0  # admission passes that put a request off for a block another is prefilling
        self._last_fed: set[str] = set()  # the requests the last plan fed (share_inflight_prefix waits only on them)
        # why the last schedule() left work waiting: "kv" (the queue's head or a running item had no free blocks),
        # "max_num_seqs" (no rank had a running slot for the head), or "" (nothing waited)
        self.blocked = ""
        self._added: list[NewRequest] = []  # changes the ranks have not heard of yet (the next plan with work)
        self._finished: list[str] = []
        self._copies: list[tuple[int, int, int]] = []
        self.groups: dict[str, set[str]] = {}  # n > 1: a request's id → its live members (forking request, samples)

    # ---- admission -------------------------------------------------------------------------------
    def request_slots(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots a whole request may need: prompt + max_tokens (capped at max_model_len) + its tree's scratch."""
        return min(prompt_len + max_tokens, self.cfg.max_model_len) + self.spec_reserve_slots

    def validate(self, request_id: str, prompt: list[int], params: SamplingParams, dp_rank: int | None = None) -> None:
        """Raises RequestError naming the field when the request can never run."""
        if request_id in self.requests or request_id in self.groups:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if not prompt:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt) + params.max_tokens > self.cfg.max_model_len:
            raise RequestError(f"prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds "
                               f"max_model_len {self.cfg.max_model_len}")
        if params.n > self.cfg.max_num_seqs:
            raise RequestError(f"n={params.n} is above max_num_seqs={self.cfg.max_num_seqs} (engine.max_num_seqs, "
                               "server.max_num_seqs when served): a request's samples run at once on one DP rank")
        need = blocks_for(self.request_slots(len(prompt), params.max_tokens), self.cfg.block_size)
        if need > self.cfg.num_blocks:
            raise RequestError(f"request needs {need} KV blocks (prompt {len(prompt)} + max_tokens "
                               f"{params.max_tokens}), more than the cache holds ({self.cfg.num_blocks})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop {list(params.stop)[:3]}: stop strings need the checkpoint's tokenizer "
                               "(tokenizer.json or tiktoken.model), and this engine was started without one")
        if dp_rank is not None and not 0 <= dp_rank < self.dp_size:
            raise RequestError(f"data_parallel_rank must be in [0, {self.dp_size}), got {dp_rank}")

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int, dp_rank: int | None = None,
            retain_kv: bool = False) -> Request:
        """Queues a request. ``params.n > 1``: one request prefills the prompt but its last token and then forks
        into n samples with seeds ``seed + i`` (:meth:`_fork`); their outputs carry ``request_id`` and ``index``."""
        self.validate(request_id, prompt, params, dp_rank)
        if params.n == 1:
            return self._queue(Request(request_id, list(prompt), params, seed, dp_rank=dp_rank, pinned_dp=dp_rank,
                                       retain_kv=retain_kv))
        self.groups[request_id] = set()
        if len(prompt) > 1:
            return self._queue(Request(request_id, list(prompt), params, seed, dp_rank=dp_rank, pinned_dp=dp_rank,
                                       retain_kv=retain_kv, fork_n=params.n))
        for i in range(params.n):  # nothing to share
            self._queue(self._sample_of(request_id, prompt, params, seed, i, dp_rank, retain_kv))
        return self.requests[sample_id(request_id, 0)]

    @staticmethod
    def _sample_of(request_id: str, prompt: list[int], params: SamplingParams, seed: int, i: int,
                   dp_rank: int | None, retain_kv: bool) -> Request:
        return Request(sample_id(request_id, i), list(prompt), dataclasses.replace(params, n=1, seed=seed + i),
                       seed + i, dp_rank=dp_rank, pinned_dp=dp_rank, retain_kv=retain_kv, client_id=request_id, index=i)

    def _queue(self, req: Request) -> Request:
        req.client_id = req.client_id or req.request_id
        if req.params.stop:
            req.stops = StopStrings(req.params.stop, IncrementalDetokenizer(self.tokenizer, req.prompt,
                                                                            req.params.skip_special_tokens))
        self.requests[req.request_id] = req
        if req.client_id in self.groups:
            self.groups[req.client_id].add(req.request_id)
        self.waiting.append(req)
        return req

    def _fork(self, parent: Request) -> None:
        """``parent`` has computed its prompt but the last token: its n samples take its KV (full blocks shared, the
        partial one copied on the ranks) and each feeds the last prompt token and samples with its own seed."""
        dp, computed = parent.dp_rank, len(parent.feed_tokens)
        running = self.running[dp]
        at = running.index(parent)
        for i in range(parent.fork_n):
            child = self._sample_of(parent.request_id, parent.prompt, parent.params, parent.seed, i, parent.pinned_dp,
                                    parent.retain_kv)
            child.num_computed, copy = self.kv.fork(parent.request_id, child.request_id, dp, computed)
            child.dp_rank, child.admitted, child.num_cached, child.sent_blocks = dp, parent.admitted, \
                parent.num_cached, 0
            if copy is not None:
                self._copies.append((dp, *copy))
            child.client_id = parent.request_id
            if child.params.stop:
                child.stops = StopStrings(child.params.stop, IncrementalDetokenizer(
                    self.tokenizer, child.prompt, child.params.skip_special_tokens))
            self.requests[child.request_id] = child
            self.groups[parent.request_id].add(child.request_id)
            running.insert(at + 1 + i, child)
            self._added.append(NewRequest(request_id=child.request_id, dp_rank=dp, prompt=tuple(child.prompt),
                                          output=(), params=child.params, seed=child.seed))
        running.remove(parent)
        self.kv.free(parent.request_id, dp)
        self._leave_ranks(parent)
        del self.requests[parent.request_id]
        self.groups[parent.request_id].discard(parent.request_id)

    def _seats(self, dp: int) -> int:
        """Running slots DP rank ``dp`` has promised: a request that will fork into n samples holds n of them."""
        return sum(max(req.fork_n, 1) for req in self.running[dp])

    def _admit(self) -> None:
        """Admits in queue order while a rank has room and the blocks a request's first step needs; a request pinned
        to a full rank waits without holding up the others, one whose blocks are not free stops admission (FCFS).
        Sets :attr:`blocked` when a request stays for want of a slot or of blocks. A request whose next uncached
        block is being prefilled waits without holding up the others (:meth:`_waits_for_prefill`)."""
        prefilling = None
        for req in self.waiting:
            req.deferred = False
        for req in list(self.waiting):
            ranks = [r for r in ([req.pinned_dp] if req.pinned_dp is not None else range(self.dp_size))
                     if self._seats(r) + max(req.fork_n, 1) <= self.cfg.max_num_seqs]
            if not ranks:
                self.blocked = self.blocked or "max_num_seqs"
                if req.pinned_dp is None:
                    return
                continue
            tokens, hashes = req.feed_tokens, self._hashes(req)
            if self.cfg.share_inflight_prefix and hashes:
                prefilling = prefilling if prefilling is not None else self._prefilling()
                if self._waits_for_prefill(hashes, ranks, prefilling):
                    req.deferred = True
                    self.prefix_waits += 1
                    continue
            pools = self.kv.pools
            dp = max(ranks, key=lambda r: (self.kv.cached_blocks(r, hashes), pools[r].num_free, -r))
            if self.cfg.kv_allocation == "reserve":
                reserve = self.request_slots(len(req.prompt), req.params.max_tokens)
            else:
                hit = self.kv.cached_blocks(dp, hashes) * self.cfg.block_size
                reserve = hit + min(len(tokens) - hit, self.cfg.max_num_batched_tokens)
            cached = self.kv.admit(req.request_id, dp, tokens, hashes, reserve, req.retain_kv)
            if cached is None:
                self.blocked = "kv"
                return
            self.waiting.remove(req)
            req.dp_rank, req.num_computed, req.sent_blocks = dp, cached, 0
            if prefilling is not None:  # admitted now: those behind it wait for what it will compute
                prefilling[dp].update(hashes[cached // self.cfg.block_size:])
            self._added.append(NewRequest(request_id=req.request_id, dp_rank=dp, prompt=tuple(req.prompt),
                                          output=tuple(req.output), params=req.params, seed=req.seed))
            if req.admitted < 0:
                req.admitted, req.num_cached = next(self._admissions), cached
            running = self.running[dp]
            running.insert(sum(r.admitted < req.admitted for r in running), req)  # in priority order

    def _prefilling(self) -> list[set[int]]:
        """Per DP rank, the hashes of the full blocks not yet committed of the running requests the last plan fed (one
        stalled for want of blocks is not waited for: it may not move until older requests end)."""
        kv, fed = self.kv, self._last_fed
        return [{h for r in running if r.hashes and r.request_id in fed
                 for h in r.hashes[kv.committed_blocks(r.request_id):]} for running in self.running]

    def _waits_for_prefill(self, hashes: list[int], ranks: list[int], prefilling: list[set[int]]) -> bool:
        """Whether the first block of ``hashes`` that none of ``ranks`` caches is one a request running there is
        computing now (``engine.share_inflight_prefix``): waiting, the request hits it once it is committed."""
        first = max(self.kv.cached_blocks(r, hashes) for r in ranks) if hashes else 0
        return first < len(hashes) and any(hashes[first] in prefilling[r] for r in ranks)

    def _hashes(self, req: Request) -> list[int]:
        """``req``'s prefix-block hashes (computed once from its feed tokens; [] with prefix caching off)."""
        if req.hashes is None:
            req.hashes = self.kv.prefix_hashes(req.feed_tokens) if self.cfg.prefix_caching else []
        return req.hashes

    # ---- stepping --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(self.running) or bool(self.waiting)

    def schedule(self) -> StepPlan:
        self.blocked = ""
        self._admit()
        work, scheduled, blocks = [], {}, {}
        overlap = self.overlap and not any(r.params.constraint is not None for rs in self.running for r in rs)
        for dp in range(self.dp_size):
            budget, items, row = self.cfg.max_num_batched_tokens, [], 0
            total_of = {r.request_id: len(r.feed_tokens) + r.pending for r in self.running[dp]}
            decodes = [r for r in self.running[dp] if self._feeds_last_token(r, total_of[r.request_id])]
            prefills = [r for r in self.running[dp] if r not in decodes]
            for req in decodes + prefills:
                if req.dp_rank != dp or req.request_id in scheduled:  # preempted by an earlier item of this step
                    continue
                total = total_of[req.request_id]
                n = min(total - req.num_computed, budget)
                if n <= 0 or self._ends_in_flight(req):
                    continue
                decode = self._feeds_last_token(req, total)
                spec = decode and self.spec_reserve_slots > 0
                writes = self.spec_reserve_slots if spec else n  # a tree writes its whole reserve
                if not self._blocks_for_step(req, req.num_computed + writes, scheduled):
                    self.blocked = "kv"
                    continue
                budget -= n
                done = req.num_computed + n == total
                tokens = req.feed_tokens[req.num_computed:req.num_computed + n]
                prev_row = -1
                if len(tokens) < n:  # the last one is in flight: the device takes it from the previous step
                    tokens, prev_row = tokens + [0], req.pending_row
                items.append(StepItem(request_id=req.request_id, token_ids=tokens, start=req.num_computed,
                                      sample=done and not req.fork_n, num_generated=len(req.output) + req.pending,
                                      decode=decode, spec=spec, constrained=req.params.constraint is not None,
                                      prev_row=prev_row))
                table = self.kv.table(req.request_id)
                if len(table) > req.sent_blocks:
                    blocks[req.request_id], req.sent_blocks = tuple(table[req.sent_blocks:]), len(table)
                scheduled[req.request_id] = req
                if self.overlap:
                    req.num_computed += n
                    if done:
                        req.pending, req.pending_row = (req.pending, req.pending_row) if req.fork_n else \
                            (req.pending + 1, row)
                if done and not spec and not req.fork_n:  # the runner samples plain rows in item order
                    row += 1
            work.append(items)
        if not scheduled:  # not broadcast: the ranks hear of the changes with the next plan that has work
            self._last_fed = set()
            return StepPlan(next(self._steps), work, overlap=overlap)
        plan = StepPlan(next(self._steps), work, overlap=overlap, added=tuple(self._added),
                        finished=tuple(self._finished), blocks=blocks, copies=tuple(self._copies))
        self._added, self._finished, self._copies = [], [], []
        self._scheduled[plan.step_id] = scheduled
        self._last_fed = set(scheduled)
        return plan

    @staticmethod
    def _feeds_last_token(req: Request, total: int) -> bool:
        """Whether ``req``'s next item feeds only its last generated token (a decode; a resumed request's earlier
        output is prefilled)."""
        return total - req.num_computed == 1 and len(req.output) + req.pending > 0

    def _blocks_for_step(self, req: Request, slots: int, scheduled: dict[str, Request]) -> bool:
        """Grows ``req``'s blocks to ``slots``, preempting lower-priority requests of its rank while they are short;
        False when no preemption can make room (the item waits)."""
        while not self.kv.allocate(req.request_id, req.dp_rank, slots):
            victim = self._victim(req, scheduled)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _victim(self, req: Request, scheduled: dict[str, Request]) -> Request | None:
        """The running request of ``req``'s rank admitted last after it, not in this step and with no step in
        flight; None if there is none."""
        in_flight = {rid for step in self._scheduled.values() for rid in step}
        candidates = [r for r in self.running[req.dp_rank] if r.admitted > req.admitted and r.pending == 0
                      and r.request_id not in scheduled and r.request_id not in in_flight]
        return max(candidates, key=lambda r: r.admitted, default=None)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: its blocks go back through the prefix cache, it returns to the queue's front."""
        self.kv.free(req.request_id, req.dp_rank)
        self._leave_ranks(req)
        self.running[req.dp_rank].remove(req)
        req.num_computed, req.preemptions, req.hashes = 0, req.preemptions + 1, None  # its output joins its feed
        if req.pinned_dp is None:
            req.dp_rank = None
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether a token already sampled for ``req`` (overlap: not read back yet) reaches its length limit."""
        p = req.params
        return req.pending > 0 and (len(req.output) + req.pending >= p.max_tokens
                                    or len(req.tokens) + req.pending >= self.cfg.max_model_len)

    def update(self, plan: StepPlan, results: dict[str, StepResult]) -> list[RequestOutput]:
        """Applies a finished step: advances computed tokens, appends tokens (stopping at the first stop
        or length limit), commits what the step wrote to the KV manager, finishes requests. A speculative step
        commits its accepted drafts too: their KV is already compacted in place, so ``num_computed`` covers the
        bonus-rooted path."""
        outputs, scheduled = [], self._scheduled.pop(plan.step_id, {})
        for w in (w for per_rank in plan.work for w in per_rank):
            req = scheduled.get(w.request_id)
            if req is None or req.finish_reason is not None:  # ended (stop, abort) while the step ran
                continue
            if not w.sample:
                req.num_computed = max(req.num_computed, w.start + len(w.token_ids))
                self.kv.commit(req.request_id, req.dp_rank, req.tokens, w.start + len(w.token_ids))
                if req.fork_n and req.num_computed >= len(req.feed_tokens):
                    self._fork(req)
                continue
            r = results[w.request_id]
            written = w.start + (len(r.tokens) if w.spec else len(w.token_ids))  # fed: the root + accepted drafts
            if self.overlap:  # its KV counted when it was scheduled
                req.pending -= 1
            else:  # spec: the root + accepted drafts are in the KV (len(tokens) - 1 drafts + bonus came back)
                req.num_computed = written
            new, reason = 0, None
            for token in r.tokens:  # a speculative step's tokens are cut at the first that ends the request
                req.output.append(token)
                new += 1
                reason = self._finish_reason(req, token)
                if reason:
                    break
            req.logprobs += r.logprobs[:new]
            req.top_logprobs += r.top[:new]
            # a speculative step cut at a stop commits up to its last kept token (the rest is not the request's)
            self.kv.commit(req.request_id, req.dp_rank, req.tokens, min(written, len(req.tokens)))
            if reason:
                if req.output and req.output[-1] in self.retain_after:
                    self.kv.retain(req.request_id)
                self._finish(req, reason)
            outputs.append(RequestOutput(
                request_id=req.client_id, index=req.index, new_tokens=r.tokens[:new], finished=reason is not None,
                finish_reason=reason, num_prompt_tokens=len(req.prompt), num_output_tokens=len(req.output),
                new_logprobs=r.logprobs[:new], new_top_logprobs=r.top[:new], stop_reason=req.stop_reason,
                num_cached_tokens=req.num_cached))
        return outputs

    def _finish_reason(self, req: Request, token: int) -> str | None:
        """After ``token`` was appended: "stop" (a stop id, EOS, or a stop string it completes; once ``min_tokens``
        are out), "length", or None. Every token goes through the stop-string check, to keep its text whole."""
        p = req.params
        checked = len(req.output) >= p.min_tokens
        matched = req.stops.add(token, checked) if req.stops is not None else None
        if checked and (token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)):
            req.stop_reason = token if token in p.stop_token_ids else None
            return "stop"
        if matched is not None:
            req.stop_reason = matched
            return "stop"
        if len(req.output) >= p.max_tokens or len(req.tokens) >= self.cfg.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.dp_rank is not None and req in self.running[req.dp_rank]:
            self.running[req.dp_rank].remove(req)
        if req.dp_rank is not None:
            self.kv.free(req.request_id, req.dp_rank)
        self._leave_ranks(req)
        del self.requests[req.request_id]
        group = self.groups.get(req.client_id)
        if group is not None:
            group.discard(req.request_id)
            if not group:
                del self.groups[req.client_id]

    def _leave_ranks(self, req: Request) -> None:
        """The ranks drop ``req`` with the next plan (it ended or was preempted; re-admission adds it again)."""
        if req.sent_blocks < 0:
            return
        unsent = [a for a in self._added if a.request_id == req.request_id]
        if unsent:  # admitted since the last plan: the ranks never heard of it
            self._added.remove(unsent[0])
        else:
            self._finished.append(req.request_id)
        req.sent_blocks = -1

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput:
        """Ends a request now (client cancel, deadline, error) and frees its blocks (n > 1: every sample; the last
        one's output is returned, :meth:`abort_all` returns each)."""
        outs = self.abort_all(request_id, reason)
        if not outs:
            raise RequestError(f"unknown request_id {request_id!r}")
        return outs[-1]

    def knows(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def abort_all(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """:meth:`abort` → one finished output per sample still running (none for an unknown id)."""
        members = sorted(self.groups.get(request_id, ())) if request_id in self.groups else [request_id]
        outs = []
        for rid in members:
            req = self.requests.get(rid)
            if req is None:
                continue
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

    # ---- accounting ------------------------------------------------------------------------------
    def blocks_in_use(self) -> int:
        """Referenced blocks (cached unreferenced ones count as free)."""
        return self.kv.blocks_in_use()

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens of waiting requests not in the prefix cache (their best rank's hit)."""
        if not self.cfg.prefix_caching:
            return sum(len(r.tokens) for r in self.waiting)
        total = 0
        for req in self.waiting:
            hashes = self._hashes(req)
            total += len(req.tokens) - max(self.kv.cached_blocks(dp, hashes) for dp in range(self.dp_size)) \
                * self.cfg.block_size
        return total
