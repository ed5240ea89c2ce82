"""The engine's :class:`engine.worker.spec_contract.Speculation` built from a :class:`SpecConfig`, and the
:class:`DFlashSpeculator` it builds per rank: the engine drives speculation through ``engine.speculation``'s
Protocols without importing spec_decode."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sampling.logits_processors import Rows
from engine.step import SeqWork, StepKind, StepResult
from engine.worker.kv_cache import KVSpec, PagedKVCache
from engine.worker.spec_contract import (
    NodeSampler,
    Speculation,
    SpeculationFacts,
    StaticLayout,
    StaticOutput,
    StaticTarget,
    TargetForward,
)
from model.transformer import CausalLM
from spec_decode.config import SpecConfig
from spec_decode.decoder import Committed, SpeculativeDecoder, drafter_kv_spec
from spec_decode.dflash import DFlashDrafter
from spec_decode.static_commit import CommitGraphs
from spec_decode.static_draft import DraftGraphs
from spec_decode.tree import DraftTree


class DFlashSpeculator:
    """One rank's :class:`engine.worker.spec_contract.Speculator` for a DFlash drafter (chain or DDTree): the
    arithmetic of ``spec`` (:class:`spec_decode.decoder.SpeculativeDecoder`) and, with a ``static`` layout, its
    static draft per batch size and static commit per verify shape. Each speculative step runs here from draft to
    commit."""

    def __init__(self, spec: SpeculativeDecoder, static: StaticLayout | None):
        self.spec = spec
        self.feature_layers = spec.feature_layers
        self.drafts = self.commits = None
        if static is not None:
            self.drafts = DraftGraphs(spec, static.max_blocks, static.scratch_blocks, static.batch_sizes)
            self.commits = CommitGraphs(spec, static.scratch_blocks)

    @torch.no_grad()
    def speculate(self, work: list[SeqWork], target: TargetForward) -> list[StepResult]:
        """Drafts ``work``'s trees (one drafter forward; constrained requests' trees built on the host under their
        grammar), verifies them in the step's target forward, then samples, walks and commits them on the device;
        one readback."""
        spec = self.spec
        trees, masks = spec.draft(work, target.sampler)
        logits, feats = target.verify_trees([spec.tree_rows(w, trees[w.request_id]) for w in work])
        return spec.accept_rows(work, trees, logits, feats, target.sampler, masks)

    @torch.no_grad()
    def speculate_static(self, work: list[SeqWork], batch: int, target: StaticTarget) -> StaticOutput:
        """Every input goes into the draft's, the verify's and the commit's buffers first (host values, capturing
        each shape on first use, in the order every rank follows: draft, verify, commit); then draft → verify →
        sample → walk and KV compaction on the device, the trees read where the draft left them (inside
        ``target.no_host_sync()``); one readback at the end. Every rank walks its trees (and compacts its KV
        shard)."""
        n = self.spec.cfg.tree_size
        size = self.drafts.load(work, batch)
        target.load_tree_layout(work, size)
        self.commits.prepare(size, n)
        rows = target.sampler.prepare(work, n)
        with target.no_host_sync():
            tree, start = self.drafts.launch(size)
            logits, feats, slots = target.verify_trees(*self.spec.verify_inputs(tree, start))
            committed = self.commit_static(tree, logits, feats, slots, start, target.sampler, rows) if work else None
        coverage = {StepKind.DRAFT: self.drafts.status(size)}
        if committed is None:  # an idle rank's padding step commits nothing
            return StaticOutput([], coverage)
        coverage[StepKind.COMMIT] = self.commits.status((size, n))
        return StaticOutput(committed.results(work), coverage)

    def commit_static(self, tree: DraftTree, logits: torch.Tensor, feats: torch.Tensor, slots: torch.Tensor,
                      start: torch.Tensor, sampler: NodeSampler, rows: Rows) -> Committed:
        """:meth:`SpeculativeDecoder.walk_and_commit` with the walk and the KV compaction in the static commit of the
        whole padded batch (a graph replay on CUDA): ``tree [B, N]``, ``logits [B*N, V]``, ``feats [B*N, k*H]``,
        ``slots [B, N]``, ``start [B]``; ``rows`` of the J real requests."""
        out, picks = self.spec.sample_nodes(tree, logits, sampler, rows)
        path, count = (t[:picks.shape[0]] for t in self.commits.run(tree, picks, feats, slots, start))
        return Committed.along(out, picks, path, count)

    def warm_up_static(self, batch: int, target: StaticTarget) -> None:
        """An idle rank's ``batch`` static step, then the commit it skips, on padding only."""
        self.speculate_static([], batch, target)
        self.commits.warm_up(batch, self.spec.cfg.tree_size)

    def features_computed(self, work: list[SeqWork], feats: torch.Tensor) -> None:
        """Stores the drafter context of ``work``'s fed tokens from their target features ``feats [T, k*H]``."""
        at = 0
        for w in work:
            n = len(w.token_ids)
            self.spec.add_context(w, feats[at:at + n], w.start)
            at += n


def speculation_from(spec: SpecConfig, build: Callable[[CausalLM, PagedKVCache], SpeculativeDecoder],
                     context_kv: KVSpec | None = None) -> Speculation:
    """A Speculation whose speculators wrap ``build(model, cache)``, shaped by ``spec``; ``context_kv``: the
    drafter context's layer group, declared in the rank's KV cache and counted by its budget (None: the decoder
    adds its group to the cache itself, for callers that size the KV cache themselves, as the tests and GPU
    checks do)."""
    facts = SpeculationFacts(method=spec.method, tree_size=spec.tree_size, draft_block_size=spec.block_size,
                             draft_rows=spec.draft_rows, spec_reserve_slots=spec.spec_reserve_slots,
                             drafter_path=spec.drafter_path, context_kv=context_kv,
                             tree_temperature=spec.tree_temperature, draft_head_dtype=spec.draft_head_dtype,
                             coupled=spec.coupled, adaptive=spec.adaptive)
    return Speculation(facts=facts, build=lambda model, cache, static: DFlashSpeculator(build(model, cache), static))


def load_speculation(spec: SpecConfig, model: CausalLM) -> Speculation | None:
    """``spec``'s Speculation for ``model`` (None when speculative decoding is off): loads the DFlash drafter once,
    on ``model.device``; every runner built with it shares the drafter."""
    if not spec.enabled:
        return None
    drafter = DFlashDrafter.load(spec.drafter_path).place(model.device)
    return speculation_from(spec, lambda target, cache: SpeculativeDecoder(target, drafter, spec, cache),
                            drafter_kv_spec(drafter))
