"""Continuous batching with chunked prefill, admission limits and abort; one queue per attention-DP rank.

Policy (written down here because vLLM and SGLang differ):
- A request is placed on the attention-DP rank with the fewest requests (running + waiting).
- Blocks for the whole request (prompt + max_tokens, capped at max_model_len) are reserved when it is
  admitted, so a running request never needs preemption; admission waits until they are free.
- Each step per DP rank: every running decode gets one token first, then prefills (oldest first) take
  chunks of the remaining ``max_num_batched_tokens``. A prompt longer than the budget is prefilled over
  several steps; only the chunk that completes it samples.
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
from engine.kv_cache import BlockAllocator
from engine.sampler import SamplingParams
from engine.step import RequestOutput, SeqWork, StepPlan, StepResult
from engine.stop_strings import Detokenize, IncrementalDetokenizer, StopStrings


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
    dp_rank: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (overlap: or in a launched step)
    finish_reason: str | None = None
    pending: int = 0  # overlap: tokens sampled by launched steps, not yet read back
    pending_row: int = -1  # overlap: the latest of those steps' row for it (SeqWork.prev_row)
    stops: StopStrings | None = None  # its stop-string check (params.stop)
    stop_reason: int | str | None = None  # what ended it with "stop": a stop token id, or the stop string

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, dp_size: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 spec_reserve_slots: int = 0, tokenizer: Detokenize | None = None):
        """``spec_reserve_slots`` > 0 turns speculative decoding on: decodes become draft + verify steps and each
        request reserves that many extra KV slots for its tree. ``tokenizer`` detokenizes outputs for stop strings
        (without one, a request with stop strings is refused)."""
        self.cfg, self.dp_size, self.vocab_size, self.eos = cfg, dp_size, vocab_size, set(eos_token_ids)
        self.tokenizer = tokenizer
        self.spec_reserve_slots = spec_reserve_slots
        self.allocators = [BlockAllocator(cfg.num_blocks) for _ in range(dp_size)]
        self.waiting: list[deque[Request]] = [deque() for _ in range(dp_size)]
        self.running: list[list[Request]] = [[] for _ in range(dp_size)]
        self.requests: dict[str, Request] = {}
        self.overlap = cfg.overlap == "on" and spec_reserve_slots == 0  # a verify's next start needs its accepted count
        self._scheduled: dict[int, dict[str, Request]] = {}  # step id → the requests it feeds, until its update
        self._steps = itertools.count()

    # ---- admission -------------------------------------------------------------------------------
    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        tokens = min(prompt_len + max_tokens, self.cfg.max_model_len) + self.spec_reserve_slots
        return blocks_for(tokens, self.cfg.block_size)

    def validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Raises RequestError naming the field when the request can never run."""
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if not prompt:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt) + params.max_tokens > self.cfg.max_model_len:
            raise RequestError(f"prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds "
                               f"max_model_len {self.cfg.max_model_len}")
        if self.blocks_needed(len(prompt), params.max_tokens) > self.cfg.num_blocks:
            raise RequestError(f"request needs more KV blocks than the cache holds ({self.cfg.num_blocks})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop {list(params.stop)[:3]}: stop strings need the checkpoint's tokenizer "
                               "(tokenizer.json or tiktoken.model), and this engine was started without one")

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> Request:
        self.validate(request_id, prompt, params)
        dp = min(range(self.dp_size), key=lambda r: (len(self.running[r]) + len(self.waiting[r]), r))
        req = Request(request_id, list(prompt), params, seed, dp_rank=dp)
        if params.stop:
            req.stops = StopStrings(params.stop, IncrementalDetokenizer(self.tokenizer, req.prompt,
                                                                        params.skip_special_tokens))
        self.requests[request_id] = req
        self.waiting[dp].append(req)
        return req

    def _admit(self, dp: int) -> None:
        queue, alloc = self.waiting[dp], self.allocators[dp]
        while queue and len(self.running[dp]) < self.cfg.max_num_seqs:
            req = queue[0]
            need = self.blocks_needed(len(req.prompt), req.params.max_tokens)
            if need > alloc.num_free:
                break
            req.blocks = alloc.allocate(need)
            self.running[dp].append(queue.popleft())

    # ---- stepping --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(self.running) or any(self.waiting)

    def schedule(self) -> StepPlan:
        work, scheduled = [], {}
        for dp in range(self.dp_size):
            self._admit(dp)
            budget, items, row = self.cfg.max_num_batched_tokens, [], 0
            decodes = [r for r in self.running[dp] if r.num_computed >= len(r.prompt)]
            prefills = [r for r in self.running[dp] if r.num_computed < len(r.prompt)]
            for req in decodes + prefills:
                total = len(req.tokens) + req.pending
                n = min(total - req.num_computed, budget)
                if n <= 0 or self._ends_in_flight(req):
                    continue
                budget -= n
                done = req.num_computed + n == total
                decode = req.num_computed >= len(req.prompt)
                spec = decode and self.spec_reserve_slots > 0
                tokens = req.tokens[req.num_computed:req.num_computed + n]
                prev_row = -1
                if len(tokens) < n:  # the last one is in flight: the device takes it from the previous step
                    tokens, prev_row = tokens + [0], req.pending_row
                items.append(SeqWork(request_id=req.request_id, token_ids=tokens, start=req.num_computed,
                                     block_table=req.blocks, sample=done, params=req.params, seed=req.seed,
                                     num_generated=len(req.output) + req.pending, decode=decode, spec=spec,
                                     prev_row=prev_row))
                scheduled[req.request_id] = req
                if self.overlap:
                    req.num_computed += n
                    if done:
                        req.pending, req.pending_row = req.pending + 1, row
                if done and not spec:  # the runner samples plain rows in item order
                    row += 1
            work.append(items)
        plan = StepPlan(next(self._steps), work, overlap=self.overlap)
        if scheduled:
            self._scheduled[plan.step_id] = scheduled
        return plan

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether a token already sampled for ``req`` (overlap: not read back yet) reaches its length limit."""
        p = req.params
        return req.pending > 0 and (len(req.output) + req.pending >= p.max_tokens
                                    or len(req.tokens) + req.pending >= self.cfg.max_model_len)

    def update(self, plan: StepPlan, results: dict[str, StepResult]) -> list[RequestOutput]:
        """Applies a finished step: advances computed tokens, appends tokens (stopping at the first stop
        or length limit), finishes requests. A speculative step commits its accepted drafts too: their KV
        is already compacted in place, so ``num_computed`` covers the bonus-rooted path."""
        outputs, scheduled = [], self._scheduled.pop(plan.step_id, {})
        for w in (w for per_rank in plan.work for w in per_rank):
            req = scheduled.get(w.request_id)
            if req is None or req.finish_reason is not None:  # ended (stop, abort) while the step ran
                continue
            if not w.sample:
                req.num_computed = max(req.num_computed, w.start + len(w.token_ids))
                continue
            r = results[w.request_id]
            if self.overlap:  # its KV counted when it was scheduled
                req.pending -= 1
            else:  # spec: the root + accepted drafts are in the KV (len(tokens) - 1 drafts + bonus came back)
                req.num_computed = w.start + (len(r.tokens) if w.spec else len(w.token_ids))
            new, reason = 0, None
            for token in r.tokens:  # a speculative step's tokens are cut at the first that ends the request
                req.output.append(token)
                new += 1
                reason = self._finish_reason(req, token)
                if reason:
                    break
            req.logprobs += r.logprobs[:new]
            req.top_logprobs += r.top[:new]
            if reason:
                self._finish(req, reason)
            outputs.append(RequestOutput(
                request_id=req.request_id, new_tokens=r.tokens[:new], finished=reason is not None,
                finish_reason=reason, num_prompt_tokens=len(req.prompt), num_output_tokens=len(req.output),
                new_logprobs=r.logprobs[:new], new_top_logprobs=r.top[:new], stop_reason=req.stop_reason))
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
        dp = req.dp_rank
        if req in self.running[dp]:
            self.running[dp].remove(req)
        elif req in self.waiting[dp]:
            self.waiting[dp].remove(req)
        self.allocators[dp].release(req.blocks)
        req.blocks = []
        del self.requests[req.request_id]

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput:
        """Ends a request now (client cancel, deadline, error) and frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            raise RequestError(f"unknown request_id {request_id!r}")
        self._finish(req, reason)
        return RequestOutput(request_id=request_id, new_tokens=[], finished=True, finish_reason=reason,
                             num_prompt_tokens=len(req.prompt), num_output_tokens=len(req.output))

    # ---- accounting ------------------------------------------------------------------------------
    def blocks_in_use(self) -> int:
        return sum(a.num_used for a in self.allocators)

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    def num_waiting(self) -> int:
        return sum(len(w) for w in self.waiting)
