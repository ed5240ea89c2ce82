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
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockAllocator
from engine.sampler import SamplingParams
from engine.step import RequestOutput, SeqWork, StepPlan, StepResult


class RequestError(ValueError):
    """A request the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 512
    block_size: int = 16
    num_blocks: int = 1024  # per DP rank
    # decode / tree-verify steps over fixed-shape buffers (engine/cuda_graphs.py): "auto" = on a CUDA device,
    # where they are captured as CUDA graphs; "on" = everywhere (off CUDA they run eagerly); "off" = never
    static_steps: str = "auto"
    # every row's arithmetic independent of what shares its launch (model.kernel_select.batch_invariant_kernels):
    # speculation and batching give plain decoding's tokens bit for bit, in bf16 too; docs/batch_invariance.md
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise RequestError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.static_steps not in ("auto", "on", "off"):
            raise RequestError(f"engine.static_steps must be auto, on or off, got {self.static_steps!r}")


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
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, dp_size: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 spec_scratch: int = 0):
        """``spec_scratch`` > 0 turns speculative decoding on: decodes become draft + verify steps and each
        request reserves that many extra KV slots for its tree."""
        self.cfg, self.dp_size, self.vocab_size, self.eos = cfg, dp_size, vocab_size, set(eos_token_ids)
        self.spec_scratch = spec_scratch
        self.allocators = [BlockAllocator(cfg.num_blocks) for _ in range(dp_size)]
        self.waiting: list[deque[Request]] = [deque() for _ in range(dp_size)]
        self.running: list[list[Request]] = [[] for _ in range(dp_size)]
        self.requests: dict[str, Request] = {}
        self._steps = itertools.count()

    # ---- admission -------------------------------------------------------------------------------
    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        tokens = min(prompt_len + max_tokens, self.cfg.max_model_len) + self.spec_scratch
        return math.ceil(tokens / self.cfg.block_size)

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

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> Request:
        self.validate(request_id, prompt, params)
        dp = min(range(self.dp_size), key=lambda r: (len(self.running[r]) + len(self.waiting[r]), r))
        req = Request(request_id, list(prompt), params, seed, dp_rank=dp)
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
        work = []
        for dp in range(self.dp_size):
            self._admit(dp)
            budget, items = self.cfg.max_num_batched_tokens, []
            decodes = [r for r in self.running[dp] if r.num_computed >= len(r.prompt)]
            prefills = [r for r in self.running[dp] if r.num_computed < len(r.prompt)]
            for req in decodes + prefills:
                n = min(len(req.tokens) - req.num_computed, budget)
                if n <= 0:
                    continue
                budget -= n
                done = req.num_computed + n == len(req.tokens)
                decode = req.num_computed >= len(req.prompt)
                items.append(SeqWork(request_id=req.request_id,
                                     token_ids=req.tokens[req.num_computed:req.num_computed + n],
                                     start=req.num_computed, block_table=req.blocks, sample=done, params=req.params,
                                     seed=req.seed, num_generated=len(req.output), decode=decode,
                                     spec=decode and self.spec_scratch > 0))
            work.append(items)
        return StepPlan(next(self._steps), work)

    def update(self, plan: StepPlan, results: dict[str, StepResult]) -> list[RequestOutput]:
        """Applies a finished step: advances computed tokens, appends tokens (stopping at the first stop
        or length limit), finishes requests. A speculative step commits its accepted drafts too: their KV
        is already compacted in place, so ``num_computed`` covers the bonus-rooted path."""
        outputs = []
        for w in (w for per_rank in plan.work for w in per_rank):
            req = self.requests.get(w.request_id)
            if req is None:  # aborted while the step ran
                continue
            if not w.sample:
                req.num_computed = w.start + len(w.token_ids)
                continue
            r = results[w.request_id]
            # spec: the root + accepted drafts are in the KV (len(tokens) - 1 drafts + bonus came back)
            req.num_computed = w.start + (len(r.tokens) if w.spec else len(w.token_ids))
            new, reason = 0, None
            for token in r.tokens:
                req.output.append(token)
                new += 1
                reason = self._finish_reason(req, token)
                if reason:
                    break
            req.logprobs += r.logprobs[:new]
            req.top_logprobs += r.top[:new]
            if reason:
                self._finish(req, reason)
            outputs.append(RequestOutput(req.request_id, r.tokens[:new], reason is not None, reason,
                                         len(req.prompt), len(req.output), r.logprobs[:new], r.top[:new]))
        return outputs

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if len(req.output) >= p.min_tokens and (token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)):
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
        return RequestOutput(request_id, [], True, reason, len(req.prompt), len(req.output))

    # ---- accounting ------------------------------------------------------------------------------
    def blocks_in_use(self) -> int:
        return sum(a.num_used for a in self.allocators)

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    def num_waiting(self) -> int:
        return sum(len(w) for w in self.waiting)
