"""The contract between the engine and speculative decoding. engine/ never imports spec_decode (arrows point down):
spec_decode builds a :class:`Speculation` (``spec_decode.speculation.load_speculation``) and the runner drives the
:class:`Speculator` it builds only through the members declared here
(``tests/architecture/test_speculation_contract.py``).

A speculative step belongs to the speculator — draft → tree → verify → sample → walk → commit, as SGLang's EAGLE
worker runs around its target worker: the runner hands it the step's speculative items and lends it the target's
forward (:class:`TargetForward` on the dynamic path, :class:`StaticTarget` for a static step) and takes back one
:class:`~engine.step.StepResult` per item. Names: ``docs/GLOSSARY.md``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling.logits_processors import GrammarWalk, Rows
from engine.sampling.sampler import SampleOutput
from engine.step import Record, SeqWork, StepKind, StepResult
from engine.worker.kv_cache import KVSpec, PagedKVCache, SeqSlots
from model.transformer import CausalLM


@dataclass(frozen=True, kw_only=True)
class SpeculationFacts:
    """What the engine, the KV budget and EngineInfo know of the speculation, fixed when it is loaded.

    ``tree_size``: nodes per tree, root included (a verify's rows per request); ``draft_block_size``: the DFlash
    block ``[bonus, MASK × (draft_block_size - 1)]``; ``draft_rows``: block rows whose draft distributions are used;
    ``spec_reserve_slots``: KV slots past a request's next position that one speculative step writes (the
    scheduler reserves them per request); ``context_kv``: the entries of the drafter's context, a layer group of
    the rank's KV cache over the target's blocks (None: the speculator adds its group itself, uncounted by the KV
    budget); ``coupled``: sampled requests' drafts are coupled to the sampler's noise (EngineInfo shows it);
    ``adaptive``: rank 0 chooses per step between a speculative and a plain decode step from measured
    costs (``engine.core.spec_policy``)."""

    method: str
    tree_size: int
    draft_block_size: int
    draft_rows: int
    spec_reserve_slots: int
    drafter_path: str
    context_kv: KVSpec | None
    tree_temperature: float
    draft_head_dtype: str
    coupled: bool = True
    adaptive: bool = False


@dataclass(frozen=True, kw_only=True)
class StaticLayout:
    """Where static steps live, shared by the target's and the speculator's: the static ``batch_sizes``, block
    tables of ``max_blocks`` entries, and the ``scratch_blocks`` that padding sequences write and read."""

    batch_sizes: tuple[int, ...]
    max_blocks: int
    scratch_blocks: tuple[int, ...]


@dataclass(frozen=True)
class TreeRows:
    """One request's tree as rows of the dynamic target forward: node ``token_ids`` and ``positions`` (N host
    ints each, root first) and the KV ``slots`` they are written at and attend through (``SeqSlots.mask
    [N, start + N]``: the context and each node's ancestors)."""

    token_ids: list[int]
    positions: list[int]
    slots: SeqSlots


class NodeSampler(Protocol):
    """The rank's sampling of tree nodes, lent with the target forward: each request's settings and logits processors
    (min_tokens, penalties, logit bias, grammar masks) at each node, with the node's ancestor path as history."""

    def grammar(self, w: SeqWork) -> GrammarWalk | None:
        """``w``'s grammar to build its tree under, on the host (None: unconstrained)."""
        ...

    def couple(self, work: list[SeqWork], logits: torch.Tensor, candidates: int
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Coupled drafting: ``work``'s drafter logits ``[J, D', V]`` → ``(scores [J, D', V], temperature [J])``,
        each sampled row's ``candidates`` best tokens scored as the sampler scores the draw of the output index it
        proposes (greedy rows: their logits, temperature 0); None when no request of ``work`` samples. On the
        device."""
        ...

    def prepare(self, work: list[SeqWork], tree_size: int, masks: torch.Tensor | None = None) -> Rows:
        """Host half, before the device region: the rows of ``work``'s trees of ``tree_size`` nodes (``masks [J*N,
        W]`` int32 host grammar bitmasks of the nodes, from the tree builder; None when no tree was built under a
        grammar)."""
        ...

    def sample(self, rows: Rows, tokens: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor,
               logits: torch.Tensor) -> SampleOutput:
        """Device half, without host synchronisation: samples every node of the first J trees of ``tokens, depth
        [J', N]``, ``ancestors [J', N, N]`` (rows past J pad) from ``logits [J'*N, V]`` → rows ``[J*N]``; a node's
        pick is the draw plain decoding makes for its output index and history."""
        ...


class TargetForward(Protocol):
    """The step's dynamic target forward, lent to :meth:`Speculator.speculate`."""

    @property
    def sampler(self) -> NodeSampler:
        """The step's node sampling."""
        ...

    def verify_trees(self, trees: list[TreeRows]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the step's one target forward with ``trees`` (one per speculative item, in order) among its rows
        (other items of the step ride along) → logits ``[J*N, V]`` on every attention-TP rank and drafter
        features ``[J*N, k*H]`` at the trees' rows. Called once per step."""
        ...


class StaticTarget(Protocol):
    """The target's static tree verify, lent to :meth:`Speculator.speculate_static` (a CUDA-graph replay on CUDA)."""

    @property
    def sampler(self) -> NodeSampler:
        """The step's node sampling."""
        ...

    def load_tree_layout(self, work: list[SeqWork], batch: int) -> None:
        """Host half: captures the ``batch`` verify shape on first use and loads ``work``'s KV layout (trees at
        positions ``start .. start + tree_size - 1``; the rows past ``work`` pad)."""
        ...

    def verify_trees(self, token_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device half: ``token_ids, positions [B*N]`` and ``tree_mask [B, N, N]`` of every row, on the device →
        logits ``[B*N, V]``, features ``[B*N, k*H]`` and KV write slots ``[B, N]`` int64 (buffers the next step
        overwrites)."""
        ...

    def no_host_sync(self) -> AbstractContextManager[None]:
        """The region from the draft to the commit: with the runner's ``strict_sync`` a host synchronisation in
        there raises."""
        ...


@dataclass(frozen=True)
class StaticOutput:
    """A static speculative step's results (one per item of its work, in order) and its draft's and, when it
    committed, its commit's coverage records."""

    results: list[StepResult]
    coverage: dict[StepKind, Record]


class Speculator(Protocol):
    """One rank's speculative decoding, as the runner drives it. Every rank of an attention-DP group runs the same
    calls on the same work."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter reads (the forward captures them: ``[T, k*H]``)."""
        ...

    def speculate(self, work: list[SeqWork], target: TargetForward) -> list[StepResult]:
        """The dynamic speculative step of ``work`` (speculative items): draft, verify through ``target``, sample,
        walk, commit (KV compaction and drafter context) → one result per item, read back."""
        ...

    def speculate_static(self, work: list[SeqWork], batch: int, target: StaticTarget) -> StaticOutput:
        """The static speculative step of ``work`` padded to static batch size ``batch`` (``work`` empty: an idle
        attention-DP rank's padding step, which commits nothing)."""
        ...

    def warm_up_static(self, batch: int, target: StaticTarget) -> None:
        """Runs (captures) the ``batch`` static step's draft, verify and commit once on padding only, recording no
        coverage."""
        ...

    def features_computed(self, work: list[SeqWork], feats: torch.Tensor) -> None:
        """Target features ``feats [T, k*H]`` of ``work``'s fed tokens (each item's ``token_ids`` at positions
        ``start ..``, items in order) were computed by a plain step: the drafter's context takes them."""
        ...


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding for the engine: its ``facts`` and ``build(model, cache, static)``, which makes a rank's
    :class:`Speculator` over the target ``model`` and its KV ``cache`` (``static``: the static steps' layout,
    None when static steps are off). One Speculation may build the speculators of several runners."""

    facts: SpeculationFacts
    build: Callable[[CausalLM, PagedKVCache, StaticLayout | None], Speculator]
