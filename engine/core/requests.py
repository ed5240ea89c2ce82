"""The request table: every request the core holds, from intake (validation, ``n > 1`` fan-out) to its end, and
where each one is — the waiting queue or the running set of its attention-DP rank."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from engine.blocks import blocks_for
from engine.config import EngineConfig, RequestError
from engine.params import SamplingParams
from engine.step import sample_id


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
    hashes: list[int] | None = None  # its feed tokens' prefix-block hashes (KVManager.hashes; reset on preemption)
    deferred: bool = False  # the last admission pass put it off for a prefix being prefilled (share_inflight_prefix)
    preemptions: int = 0
    finish_reason: str | None = None
    pending: int = 0  # overlap: tokens sampled by launched steps, not yet read back
    pending_row: int = -1  # overlap: the latest of those steps' row for it (SeqWork.prev_row)
    stop_reason: int | str | None = None  # what ended it with "stop": a stop token id, or the stop string
    sent_blocks: int = -1  # block-table entries its ranks hold (-1: the ranks do not hold it)
    client_id: str = ""  # the id its outputs carry: its own, or (one of n samples) its request's
    index: int = 0  # which of its request's n samples
    fork_n: int = 0  # > 0: it prefills the prompt but its last token, then forks into this many samples
    kv_tokens: int = 0  # leading prompt tokens whose KV arrives from elsewhere (a KV source) at admission
    loading: int = -1  # the id of its KV load while it runs (admitted, blocks reserved, not fed until it is done)
    lease_s: float = 0.0  # > 0: when it finishes, its prompt's blocks stay leased this long (a prefill worker's)
    kv_origin: str = ""  # its KV source's cache namespace when not this engine's: its blocks are indexed apart

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def feed_tokens(self) -> list[int]:
        """The tokens it computes: a forking request stops short of the prompt's last token (each sample feeds it)."""
        return self.prompt[:-1] if self.fork_n else self.prompt + self.output


class RequestTable:
    """Requests by id, ``n > 1`` groups, the waiting queue (first come first served) and each DP rank's running set
    in priority order (admission order)."""

    def __init__(self, cfg: EngineConfig, dp_size: int, vocab_size: int, spec_reserve_slots: int):
        self.cfg, self.dp_size, self.vocab_size, self.spec_reserve_slots = cfg, dp_size, vocab_size, spec_reserve_slots
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, set[str]] = {}  # n > 1: a request's id → its live members (forking request, samples)
        self.waiting: deque[Request] = deque()
        self.running: list[list[Request]] = [[] for _ in range(dp_size)]

    def request_slots(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots a whole request may need: prompt + max_tokens (capped at max_model_len) + its tree's scratch."""
        return min(prompt_len + max_tokens, self.cfg.scheduler.max_model_len) + self.spec_reserve_slots

    def validate(self, request_id: str, prompt: list[int], params: SamplingParams, dp_rank: int | None = None) -> None:
        """Raises RequestError naming the field when the request can never run."""
        if self.knows(request_id):
            raise RequestError(f"request_id {request_id!r} is already in use")
        if not prompt:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt) + params.max_tokens > self.cfg.scheduler.max_model_len:
            raise RequestError(f"prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds "
                               f"max_model_len {self.cfg.scheduler.max_model_len}")
        if params.n > self.cfg.scheduler.max_num_seqs:
            limit = self.cfg.scheduler.max_num_seqs
            raise RequestError(f"n={params.n} is above max_num_seqs={limit} (engine.max_num_seqs, "
                               "server.max_num_seqs when served): a request's samples run at once on one DP rank")
        need = blocks_for(self.request_slots(len(prompt), params.max_tokens), self.cfg.cache.block_size)
        if need > self.cfg.cache.num_blocks:
            raise RequestError(f"request needs {need} KV blocks (prompt {len(prompt)} + max_tokens "
                               f"{params.max_tokens}), more than the cache holds ({self.cfg.cache.num_blocks})")
        if dp_rank is not None and not 0 <= dp_rank < self.dp_size:
            raise RequestError(f"data_parallel_rank must be in [0, {self.dp_size}), got {dp_rank}")

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int, dp_rank: int | None = None,
            retain_kv: bool = False, kv_tokens: int = 0, lease_s: float = 0.0, kv_origin: str = "") -> Request:
        """Validates and queues a request. ``params.n > 1``: one request prefills the prompt but its last token and
        then forks into n samples (:meth:`samples_of`); a one-token prompt has nothing to share and queues the
        samples at once. ``kv_tokens``: leading prompt tokens whose KV a source holds (loaded at admission, a partial
        last block included, up to the prompt's last token, which is fed to sample). ``lease_s``: keep its prompt's
        blocks leased that long when it finishes (``engine.core.leases``). ``kv_origin``: the source's cache namespace
        when it is not this engine's (KV of another layout): the request's blocks are indexed apart from this engine's
        own (``PrefixIndex.space``)."""
        self.validate(request_id, prompt, params, dp_rank)
        if (kv_tokens or lease_s) and params.n > 1:
            raise RequestError(f"n={params.n}: a request whose KV arrives from elsewhere, or is leased to another "
                               "worker, runs one sample")
        if params.n == 1:
            return self._queue(Request(request_id, list(prompt), params, seed, dp_rank=dp_rank, pinned_dp=dp_rank,
                                       retain_kv=retain_kv, kv_tokens=min(kv_tokens, len(prompt) - 1),
                                       lease_s=lease_s, kv_origin=kv_origin))
        self.groups[request_id] = set()
        if len(prompt) > 1:
            return self._queue(Request(request_id, list(prompt), params, seed, dp_rank=dp_rank, pinned_dp=dp_rank,
                                       retain_kv=retain_kv, fork_n=params.n))
        parent = Request(request_id, list(prompt), params, seed, dp_rank=dp_rank, pinned_dp=dp_rank,
                         retain_kv=retain_kv, fork_n=params.n)
        for sample in self.samples_of(parent):
            self._queue(sample)
        return self.requests[sample_id(request_id, 0)]

    @staticmethod
    def samples_of(parent: Request) -> list[Request]:
        """The ``n`` samples of ``parent`` (``fork_n``): seeds ``seed + i``, its prompt, pin and retention."""
        return [Request(sample_id(parent.request_id, i), list(parent.prompt),
                        dataclasses.replace(parent.params, n=1, seed=parent.seed + i), parent.seed + i,
                        dp_rank=parent.pinned_dp, pinned_dp=parent.pinned_dp, retain_kv=parent.retain_kv,
                        client_id=parent.request_id, index=i)
                for i in range(parent.fork_n)]

    def _queue(self, req: Request) -> Request:
        self.register(req)
        self.waiting.append(req)
        return req

    def register(self, req: Request) -> None:
        """Enters ``req`` by id (and in its request's group) without placing it."""
        req.client_id = req.client_id or req.request_id
        self.requests[req.request_id] = req
        if req.client_id in self.groups:
            self.groups[req.client_id].add(req.request_id)

    def place(self, req: Request, dp: int) -> None:
        """``req`` runs on ``dp`` from now, in priority (admission) order."""
        running = self.running[dp]
        running.insert(sum(r.admitted < req.admitted for r in running), req)

    def requeue(self, req: Request) -> None:
        """A preempted request leaves its rank for the queue's front (it keeps its place in line)."""
        self.running[req.dp_rank].remove(req)
        if req.pinned_dp is None:
            req.dp_rank = None
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """``req`` has ended (or forked): out of the queue or its rank, its id and its group."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.dp_rank is not None and req in self.running[req.dp_rank]:
            self.running[req.dp_rank].remove(req)
        del self.requests[req.request_id]
        group = self.groups.get(req.client_id)
        if group is not None:
            group.discard(req.request_id)
            if not group:
                del self.groups[req.client_id]

    def members(self, request_id: str) -> list[Request]:
        """The live requests under a client's id: itself, or an ``n > 1`` request's forking request and samples."""
        ids = sorted(self.groups[request_id]) if request_id in self.groups else [request_id]
        return [self.requests[rid] for rid in ids if rid in self.requests]

    def knows(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def seats(self, dp: int) -> int:
        """Running slots DP rank ``dp`` has promised: a request that will fork into n samples holds n of them."""
        return sum(max(req.fork_n, 1) for req in self.running[dp])

    def has_work(self) -> bool:
        return any(self.running) or bool(self.waiting)

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    def loading(self, dp: int) -> int:
        """Requests on ``dp`` whose KV is being loaded (placed, not fed yet)."""
        return sum(r.loading >= 0 for r in self.running[dp])
