"""Step types shared by the scheduler, the runner and spec_decode: what a step feeds (:class:`SeqWork`,
:class:`StepPlan`), what kind of step it is (:class:`StepKind`) and what it gives back (:class:`StepResult`,
:class:`RunnerOutput`, :class:`RequestOutput`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from engine.params import SamplingParams


@dataclass(frozen=True, kw_only=True)
class StepItem:
    """One sequence's share of a step as the plan carries it to the ranks of its DP group: what it feeds. What does
    not change from step to step (sampling settings, seed, the block table but its new blocks) the ranks keep
    (:class:`NewRequest`, ``engine.rank_requests``)."""

    request_id: str
    token_ids: list[int]  # fed this step, at positions start .. start+len-1
    start: int
    sample: bool  # the last fed token's logits pick the next token
    num_generated: int
    decode: bool  # feeds a generated token (not part of the prompt)
    spec: bool = False  # draft + verify a tree rooted at token_ids[0] instead of a plain decode
    constrained: bool = False  # a structured-output request: its tree is built on the host under its grammar
    # >= 0 (engine.overlap=on): token_ids[-1] is a placeholder for a token still on the device, sampled by the
    # previous step in row prev_row of this DP group's plainly sampled items; every rank of the group takes it there
    prev_row: int = -1


@dataclass(frozen=True, kw_only=True)
class SeqWork(StepItem):
    """A :class:`StepItem` with what its rank keeps of the request: the ``block_table``, ``params``, ``seed`` and
    its ``slot`` in the rank's sampling state (-1: none; the runner gives it a transient one for the step)."""

    block_table: list[int]
    params: SamplingParams
    seed: int
    slot: int = -1


def sample_id(request_id: str, index: int) -> str:
    """The core's id of sample ``index`` of an ``n > 1`` request (its outputs carry ``request_id`` and ``index``)."""
    return f"{request_id}\x1f{index}"


@dataclass(frozen=True, kw_only=True)
class NewRequest:
    """A request as its DP group's ranks learn it, once, in the plan of the step that admits it: its ``prompt``,
    ``output`` so far (a preempted request re-admitted: its logits processors replay it), sampling ``params`` and
    ``seed``."""

    request_id: str
    dp_rank: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    params: SamplingParams
    seed: int


class StepKind(StrEnum):
    """What a step runs. A target step is PREFILL (prompt tokens only), DECODE (generated tokens only, plainly),
    VERIFY (generated tokens only, speculative items among them: a DFlash chain or DDTree tree per request) or
    MIXED (prompt and generated tokens). DRAFT and COMMIT are the drafter step and the walk + KV compaction of a
    verify, counted apart in CUDA-graph coverage. One value per step, from :func:`step_kind`: the engine's step
    counts (``EngineStats.step_kinds``), its graph coverage and the expert tally agree on it."""

    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"
    MIXED = "mixed"
    DRAFT = "draft"
    COMMIT = "commit"


def step_kind(items: Iterable[StepItem]) -> StepKind:
    """A target step's kind from every attention-DP rank's items: PREFILL, DECODE, VERIFY or MIXED. A speculative
    step is VERIFY (not DECODE) in the step counts as in graph coverage, where its static step is a tree verify."""
    items = list(items)
    fed = {w.decode for w in items}
    if len(fed) == 2:
        return StepKind.MIXED
    if fed != {True}:
        return StepKind.PREFILL
    return StepKind.VERIFY if any(w.spec for w in items) else StepKind.DECODE


@dataclass(frozen=True)
class StepPlan:
    """One step as rank 0 broadcasts it: each attention-DP rank's items, and the changes to the requests the ranks
    keep since the last plan — ``finished`` ids (ended, aborted or preempted: dropped first), ``added`` requests and
    each item's new KV ``blocks`` (appended to its table) — the KV block ``copies`` a fork needs and the KV ``loads``
    to wait for."""

    step_id: int
    work: list[list[StepItem]]  # per attention-DP rank
    # every rank reads back (and rank 0 gathers) this step's results after launching the next one (engine.overlap)
    overlap: bool = False
    added: tuple[NewRequest, ...] = ()
    finished: tuple[str, ...] = ()
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # (attention-DP rank, src, dst): KV blocks each rank of that DP group copies before the step (n > 1's fork)
    copies: tuple[tuple[int, int, int], ...] = ()
    # KV loads (engine.worker.kv_loads) every rank waits for before the step: done on rank 0, their blocks now read
    loads: tuple[int, ...] = ()
    # the expert placement version of each MoE layer the step was planned for (engine.eplb_enabled; empty: not tracked)
    expert_versions: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for per_rank in self.work for w in per_rank)

    @property
    def kind(self) -> StepKind:
        """:func:`step_kind` over every attention-DP rank's items."""
        return step_kind(w for per_rank in self.work for w in per_rank)


@dataclass(frozen=True)
class StepResult:
    """What one step produced for one request: one token, or (speculative) the accepted drafts + bonus."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass(frozen=True)
class RunnerOutput:
    """One rank's share of a step (``ModelRunner.execute``): ``results`` per sampling request (None on ranks
    that do not hold the logits) and ``coverage`` ``{kind: (replayed, why not)}`` for the target step and, when
    this rank speculated, its draft and commit."""

    results: dict[str, StepResult] | None
    coverage: dict[StepKind, tuple[bool, str]]


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step (or an abort) gives one request: its new tokens and log-probs, and whether it ended."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_reason: int | str | None = None  # finish_reason "stop": the stop token id or stop string (None: EOS)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    index: int = 0  # which of the request's n samples (n > 1: request_id is the request's, shared by its samples)
    kv_transfer_params: dict | None = None  # a prefill worker's finished request: where a decode worker reads its KV
    error: str | None = None  # it ended ("abort") because its KV could not be read from where it was handed off


@dataclass
class GraphCoverage:
    """Per step kind (:class:`engine.step.StepKind`): steps run, steps that replayed a graph, the last reason one
    ran eager."""

    steps: dict[StepKind, int] = field(default_factory=lambda: dict.fromkeys(StepKind, 0))
    replays: dict[StepKind, int] = field(default_factory=lambda: dict.fromkeys(StepKind, 0))
    reasons: dict[StepKind, str] = field(default_factory=dict)

    def record(self, kind: StepKind, replayed: bool, reason: str = "") -> None:
        self.steps[kind] += 1
        if replayed:
            self.replays[kind] += 1
        elif reason:
            self.reasons[kind] = reason

    def summary(self) -> dict[StepKind, dict]:
        """``{kind: {"replays": r, "steps": n, "coverage": r/n, "eager_reason": str}}`` for kinds that ran."""
        return {k: {"replays": self.replays[k], "steps": n, "coverage": self.replays[k] / n,
                    "eager_reason": self.reasons.get(k, "")}
                for k, n in self.steps.items() if n}


Record = tuple[bool, str]  # a coverage record: (replayed, why not)


@dataclass(frozen=True)
class RankReport:
    """One rank's share of a step's result gather (or of a heartbeat's): the sampled ``results`` (None on ranks
    that do not hold the logits), its coverage records ``{kind: (replayed, why not)}`` and its telemetry sample when
    the sampler took one since the last gather (``engine.worker.telemetry.TelemetrySampler.fresh``)."""

    results: dict[str, StepResult] | None
    coverage: dict[StepKind, Record]
    telemetry: dict | None = None
