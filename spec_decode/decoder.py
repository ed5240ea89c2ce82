"""The arithmetic of speculative steps on one rank: the drafter's context, drafting (DFlash chain or DDTree),
verify inputs, sampling the nodes, the walk and the KV compaction. ``spec_decode.speculation`` composes it into
the engine's :class:`engine.worker.spec_contract.Speculator`.

Every rank of an attention-DP group runs the same speculative steps on the same inputs, so each
computes the same tree and the same accepted path and compacts its own KV shard; no extra
collective is needed beyond the drafter's embedding lookup and LM head (attention-TP group).

Lossless by construction: the pick at each tree node is the target's own choice at that node —
argmax at T=0, and at T>0 a sample from the counter-based sampler at output index ``num_generated + depth``,
which is the very draw plain decoding makes for that output index (so the same seed gives the same
tokens with or without speculation, up to floating-point ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.logits_processors import Rows, SamplingState, TreeSampling
from engine.sampling.sampler import SampleOutput
from engine.step import SeqWork, StepResult
from engine.worker.kv_cache import DRAFTER, KVSpec, PagedKVCache, SeqSlots
from engine.worker.spec_contract import NodeSampler, TreeRows
from model.kernel_select import native_bf16_matmul
from model.transformer import CausalLM
from spec_decode.config import SpecConfig
from spec_decode.dflash import DFlashDrafter
from spec_decode.tree import (
    DraftTree,
    build_chain,
    build_tree,
    build_tree_grammar,
    build_tree_host,
    path_by_depth,
    walk,
)


def check_drafter_fits(drafter, target, path: str | None) -> None:
    """Raises ValueError naming the drafter (``path``) and what does not match when a DFlash drafter's config
    (``DFlashConfig``) was not made for ``target`` (``ModelConfig``): hidden size, the target layers it reads,
    its mask token."""
    where = f"spec_decode.drafter_path={path}" if path else "the drafter"
    hint = ("it was trained for another target: set spec_decode.drafter_path=DIR (model.path=DIR alone keeps the "
            "model group's drafter, e.g. tiny_kimi's)")
    if drafter.hidden_size != target.hidden_size:
        raise ValueError(f"{where} has hidden_size {drafter.hidden_size}, the target {target.hidden_size}; {hint}")
    if drafter.num_target_layers and drafter.num_target_layers != target.num_layers:
        raise ValueError(f"{where} was made for a {drafter.num_target_layers}-layer target, this one has "
                         f"{target.num_layers}; {hint}")
    if not drafter.target_layer_ids or not 0 <= min(drafter.target_layer_ids) <= max(drafter.target_layer_ids) \
            < target.num_layers:
        raise ValueError(f"{where} reads target layers {list(drafter.target_layer_ids)}, the target has "
                         f"{target.num_layers}; {hint}")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ValueError(f"{where} has mask_token_id {drafter.mask_token_id}, outside the target's vocab of "
                         f"{target.vocab_size}; {hint}")


def drafter_kv_spec(drafter: DFlashDrafter) -> KVSpec:
    """The drafter context's per-token entries: K and V ``[kv_heads, head_dim]`` per draft layer, in the drafter's
    dtype (its layer group of the KV cache: ``SpeculationFacts.context_kv``). The drafter is not sharded: every
    attention-TP rank holds the same entries."""
    c = drafter.c
    return KVSpec(((c.num_kv_heads, c.head_dim),) * 2, c.num_layers, next(drafter.parameters()).dtype, True)


def draft_scores(logits: torch.Tensor, coupled: tuple[torch.Tensor, torch.Tensor] | None, cfg: SpecConfig
                 ) -> torch.Tensor:
    """What the chain takes the per-depth argmax of, or the per-depth log-probs the tree ranks prefixes by, from the
    drafter's ``logits [J, D', V]``. Greedy rows (and every row when ``coupled`` is None): the logits, or
    ``log_softmax(logits / cfg.tree_temperature)``. Sampled rows of ``coupled = (scores, temperature [J])``
    (:meth:`engine.sampling.logits_processors.TreeSampling.couple`): the coupled scores, whose argmax is the
    sampler's draw where the drafter is right; the tree ranks by ``log_softmax(scores × T / c)``, c =
    ``cfg.coupled_tree_temperature`` — the scores back in logit units (the noise scaled by T), so the best path is
    the coupled chain and the others rank by how far the drafter would have to be off to miss them."""
    chain = cfg.method == "dflash"
    if coupled is None:
        return logits if chain else (logits / cfg.tree_temperature).log_softmax(dim=-1)
    scores, temperature = coupled
    if chain:
        return scores
    scale = temperature[:, None, None] / cfg.coupled_tree_temperature
    greedy = (logits / cfg.tree_temperature).log_softmax(dim=-1)
    return torch.where(temperature[:, None, None] > 0, (scores * scale).log_softmax(dim=-1), greedy)


class SpeculativeDecoder:
    def __init__(self, model: CausalLM, drafter: DFlashDrafter, cfg: SpecConfig, cache: PagedKVCache):
        check_drafter_fits(drafter.c, model.cfg, cfg.drafter_path)
        self.model, self.drafter, self.cfg, self.cache = model, drafter, cfg, cache
        self.feature_layers = tuple(drafter.c.target_layer_ids)
        drafter.rotary.reserve(model.model.rotary.num_positions)
        self.context = cache.group(DRAFTER, drafter_kv_spec(drafter))
        self.draft_head = self._draft_head_weight()
        self.pruned = 0  # draft candidates a grammar kept out of constrained trees (the bench reads it)

    def _draft_head_weight(self) -> torch.Tensor | None:
        """A bf16 copy of this rank's LM-head shard for the drafter's rows (``SpecConfig.draft_head_dtype``), or
        None to use the target's weight as is. On this CPU box the LM head streams its weight from memory
        for every draft, so half the bytes is most of half the time."""
        weight, want = self.model.lm_head.weight, self.cfg.draft_head_dtype
        if want == "target" or weight.element_size() <= 2:
            return None
        if want == "auto" and not native_bf16_matmul(weight.device):
            return None
        return weight.to(torch.bfloat16)

    # ---- drafter context ---------------------------------------------------------------------------
    @torch.no_grad()
    def add_context(self, w: SeqWork, feats: torch.Tensor, start: int) -> None:
        """Stores the drafter K/V of target features ``[n, k*H]`` at positions ``start .. start+n-1`` of ``w``.

        The drafter's context is a layer group of the target's cache (``self.context``), at the slots of the
        request's block table: it comes and goes with the request's KV blocks (nothing to free, nothing to leak, a
        fork's or a transfer's block copy covers it) and appending never copies what is already there."""
        n = feats.shape[0]
        slots = self.cache.slot_tensor(w.block_table, start, start + n)
        self.write_context(slots, feats, torch.arange(start, start + n, device=slots.device))

    def write_context(self, slots: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Stores the drafter K/V of target features ``feats [R, k*H]`` at token ``positions [R]``, in drafter
        context ``slots [R]`` (any requests' rows at once)."""
        for layer, kv in enumerate(self.drafter.context_kv(feats.float(), positions, self.model.kernels)):
            self.context.write(layer, slots, kv)

    # ---- draft -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, work: list[SeqWork], sampler: NodeSampler | None = None
              ) -> tuple[dict[str, DraftTree], torch.Tensor | None]:
        """One drafter forward for every request's ``[bonus, MASK × depth]`` block → a DFlash chain or DDTree per
        request, rooted at its bonus (:meth:`draft_logits`), by request id; constrained requests' trees are built
        under their grammar (``sampler.grammar``) on the host — the step's one round trip: the drafter's candidates
        come to the host, the grammar's matcher walks the tree (accept, fill, roll back), no node holds a token the
        grammar forbids (``cfg.prune_drafts``), and the node masks of that walk come back ``[J*N, W]`` int32 (None
        when no request is constrained)."""
        if not work:
            return {}, None
        logits = self.draft_logits(work)
        walks = [sampler.grammar(w) if sampler is not None else None for w in work]
        chain = self.cfg.method == "dflash"
        coupled = sampler.couple(work, logits, self.cfg.coupled_candidates) \
            if sampler is not None and self.cfg.coupled else None
        logq = draft_scores(logits, coupled, self.cfg)
        if not any(walks):
            if chain:
                return {w.request_id: build_chain(logq[j], w.token_ids[0]) for j, w in enumerate(work)}, None
            build = build_tree_host if logq.device.type == "cpu" else build_tree  # no host sync off the CPU
            return {w.request_id: build(logq[j], w.token_ids[0], self.cfg.budget) for j, w in enumerate(work)}, None
        n, words = self.cfg.tree_size, next(g for g in walks if g is not None).words
        masks, trees = torch.full((len(work), n, words), -1, dtype=torch.int32), {}
        host = logq.float().cpu()
        for j, (w, g) in enumerate(zip(work, walks, strict=True)):
            if g is None:
                tree = build_chain(host[j], w.token_ids[0]) if chain else \
                    build_tree_host(host[j], w.token_ids[0], self.cfg.budget)
            else:
                tree, pruned = build_tree_grammar(host[j], w.token_ids[0], self.cfg.budget, g, masks[j], chain=chain,
                                                  prune=self.cfg.prune_drafts)
                self.pruned += pruned
            trees[w.request_id] = DraftTree(*(getattr(tree, f).to(logq.device) for f in
                                              ("tokens", "parents", "depth", "valid", "ancestors")))
        return trees, masks.reshape(len(work) * n, words)

    def draft_logits(self, work: list[SeqWork]) -> torch.Tensor:
        """The drafter's full-vocab logits ``[J, D', V]`` (fp32) for depths 1..D' of each request's block
        (``D' = SpecConfig.draft_rows``). The requests' context K/V are gathered from the paged store through
        their block tables and concatenated; each block sees only its own request's rows (as in training), so
        batching does not change any request's draft."""
        c, d = self.drafter.c, self.cfg.depth
        dev = self.cache.device
        ids = torch.tensor([[w.token_ids[0]] + [c.mask_token_id] * d for w in work], dtype=torch.int64, device=dev)
        emb = self.model.embed(ids.reshape(-1)).float().view(len(work), d + 1, -1)  # [J, B, H]
        pos = torch.tensor([w.start for w in work], device=dev)[:, None] + torch.arange(d + 1, device=dev)
        rows = torch.cat([self.cache.slot_tensor(w.block_table, 0, w.start) for w in work])  # [S] all contexts
        kv = [tuple(store.index_select(0, rows) for store in stores) for stores in self.context.layers]
        if len(work) == 1:
            visible = None  # one block, its own context: unmasked attention
        else:
            lens = torch.tensor([w.start for w in work], device=dev)
            owner = torch.repeat_interleave(torch.arange(len(work), device=dev), lens)  # [S] request of each row
            visible = owner[None, :] == torch.arange(len(work), device=dev)[:, None]  # [J, S]
        used = self.cfg.draft_rows  # a B-node tree is at most B deep: deeper rows never reach the LM head
        hidden = self.drafter(emb, pos, kv, visible, self.model.kernels)[:, 1:1 + used]  # [J, D', H]
        return self.head_logits(hidden.reshape(-1, hidden.shape[-1])).view(len(work), used, -1)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over drafter rows ``[R, H]`` → fp32 logits ``[R, V]`` on every rank (in
        ``draft_head``'s dtype when there is one)."""
        head = self.draft_head
        hidden = hidden.to(self.model.dtype if head is None else head.dtype)
        return self.model.logits_everywhere(hidden, head).float()

    @staticmethod
    def verify_inputs(tree: DraftTree, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A batch of trees ``[B, N]`` rooted at positions ``start [B]`` → the static verify's ``token_ids,
        positions [B*N]`` and ``tree_mask [B, N, N]`` (``GraphRunner.run_tree``), on the device."""
        return tree.tokens.reshape(-1), (start[:, None] + tree.depth).reshape(-1), tree.ancestors

    def tree_rows(self, w: SeqWork, tree: DraftTree) -> TreeRows:
        """``w``'s tree as dynamic-forward rows: node tokens, their positions ``start + depth`` (node i's KV slot
        is that of position ``start + i``) and the ancestor-only mask over the paged context."""
        n = tree.tree_size
        mask = torch.ones(n, w.start + n, dtype=torch.bool, device=tree.ancestors.device)
        mask[:, w.start:] = tree.ancestors
        positions = (w.start + tree.depth).tolist()
        return TreeRows(tree.tokens.tolist(), positions, SeqSlots(w.block_table, w.start, n, mask))

    # ---- verify ----------------------------------------------------------------------------------------
    @staticmethod
    def sample_nodes(tree: DraftTree, logits: torch.Tensor, sampler: NodeSampler, rows: Rows
                     ) -> tuple[SampleOutput, torch.Tensor]:
        """Samples every node of the first J trees of a verified batch, on the device without host
        synchronisation: ``rows`` are ``sampler.prepare``'s for J requests, ``tree`` a batched DraftTree ``[J',
        N]`` (rows past J pad), ``logits [J'*N, V]`` at its nodes. A node's pick is the draw plain decoding makes
        for its output index and history. Returns the draws (rows ``[J*N]``) and the picks ``[J, N]``."""
        n = tree.tree_size
        j = len(rows.slots) // n
        out = sampler.sample(rows, tree.tokens, tree.depth, tree.ancestors, logits)
        return out, out.tokens.view(j, n)

    @torch.no_grad()
    def walk_and_commit(self, tree: DraftTree, logits: torch.Tensor, feats: torch.Tensor, slots: torch.Tensor,
                        start: torch.Tensor, sampler: NodeSampler, rows: Rows) -> Committed:
        """:meth:`sample_nodes`, then :meth:`commit_paths` over the J sampled requests' rows: each request's
        accepted path is committed, on the device with fixed shapes and no host synchronisation. ``feats [J'*N,
        k*H]`` the target features at the nodes; ``slots [J', N]`` int64 the target KV slots of positions ``start
        .. start+N-1``; ``start [J']`` the first tree position."""
        out, picks = self.sample_nodes(tree, logits, sampler, rows)
        j, n = picks.shape
        path, count = self.commit_paths(tree.head(j), picks, feats[:j * n], slots[:j], start[:j])
        return Committed.along(out, picks, path, count)

    def commit_paths(self, tree: DraftTree, picks: torch.Tensor, feats: torch.Tensor, slots: torch.Tensor,
                     start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Walks ``tree`` ``[B, N]`` under the target's ``picks [B, N]`` (:func:`walk`, :func:`path_by_depth`),
        moves the accepted path's KV to positions ``start .. start+k`` and stores the path's drafter context
        (``feats [B*N, k*H]``) there; returns ``path [B, L]`` and ``count [B]``. Fixed shapes, L = ``draft_rows +
        1`` entries per row whatever is accepted: past a path they are self-copies and context rows that later
        steps overwrite before reading them. Every launch scales with the layer count, none with acceptance."""
        b, n, length = picks.shape[0], tree.tree_size, self.cfg.draft_rows + 1
        path, count = path_by_depth(tree, walk(tree, picks), length)  # [B, L], [B]
        src, dst = slots.gather(1, path).reshape(-1), slots[:, :length].reshape(-1)
        for stores in self.cache.layers:
            for store in stores:
                store.index_copy_(0, dst, store.index_select(0, src))
        rows = (torch.arange(b, device=path.device)[:, None] * n + path).reshape(-1)
        positions = (start[:, None] + torch.arange(length, device=path.device)).reshape(-1)
        self.write_context(dst, feats[rows], positions)
        return path, count

    def accept(self, work: list[SeqWork], tree: DraftTree, logits: torch.Tensor, feats: torch.Tensor,
               slots: torch.Tensor, start: torch.Tensor, sampler: NodeSampler | None = None,
               masks: torch.Tensor | None = None) -> list[StepResult]:
        """:meth:`walk_and_commit` for ``work`` (its arguments as there; ``masks``: the grammar's node masks from
        :meth:`draft`), then the one readback of the step. Without a ``sampler`` (direct callers) ``work``'s own
        settings sample, through a sampling state of their own."""
        if sampler is None:
            state = SamplingState(self.model.cfg.vocab_size, tuple(self.model.cfg.eos_token_ids), logits.device)
            work, sampler = state.bind(work), TreeSampling(state)
        rows = sampler.prepare(work, self.cfg.tree_size, masks)
        return self.walk_and_commit(tree, logits, feats, slots, start, sampler, rows).results(work)

    def accept_rows(self, work: list[SeqWork], trees: dict[str, DraftTree], logits: torch.Tensor,
                    feats: torch.Tensor, sampler: NodeSampler | None = None,
                    masks: torch.Tensor | None = None) -> list[StepResult]:
        """:meth:`accept` for the dynamic forward's tree rows: ``trees`` by request id (:meth:`draft`), ``logits
        [J*N, V]`` and ``feats [J*N, k*H]`` at the nodes of ``work``'s J trees, in order."""
        n = self.cfg.tree_size
        slots = torch.stack([self.cache.slot_tensor(w.block_table, w.start, w.start + n) for w in work])
        start = torch.tensor([w.start for w in work], device=self.cache.device)
        return self.accept(work, DraftTree.stack([trees[w.request_id] for w in work]), logits, feats, slots, start,
                           sampler, masks)


@dataclass(frozen=True)
class Committed:
    """What a speculative step commits, on the device: per request ``count [J]`` tokens (k accepted drafts +
    the bonus) — the first ``count`` of ``tokens, logprobs [J, L]`` and ``top_ids, top_logprobs [J, L, m]``."""

    count: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @staticmethod
    def along(out: SampleOutput, picks: torch.Tensor, path: torch.Tensor, count: torch.Tensor) -> Committed:
        """The draws ``out`` (rows ``[J*N]``) and ``picks [J, N]`` of :meth:`SpeculativeDecoder.sample_nodes` gathered
        along each request's accepted ``path [J, L]`` (``count [J]`` entries:
        :meth:`SpeculativeDecoder.commit_paths`)."""
        j, n = picks.shape
        rows = (torch.arange(j, device=path.device)[:, None] * n + path).reshape(-1)  # flat node row of each entry
        m, length = out.top_ids.shape[-1], path.shape[1]
        return Committed(count, picks.gather(1, path), out.logprobs.view(j, n).gather(1, path),
                         out.top_ids[rows].view(j, length, m), out.top_logprobs[rows].view(j, length, m))

    def results(self, work: list[SeqWork]) -> list[StepResult]:
        """The readback — one device→host copy of every field, the step's one host synchronisation — → one
        StepResult per request of ``work``."""
        if not work:
            return []
        j, length, m = self.top_ids.shape
        flat = [t.reshape(j, -1) for t in (self.count, self.tokens, self.logprobs, self.top_ids, self.top_logprobs)]
        host = torch.cat([t.double() for t in flat], dim=1).cpu()  # token ids < 2**53: exact in float64
        count, tokens, lps, ids, vals = host.split([t.shape[1] for t in flat], dim=1)
        results = []
        for i, w in enumerate(work):
            k, top = int(count[i, 0]), w.params.logprobs
            top_ids = ids[i].reshape(length, m)[:k, :top].long().tolist()
            top_lps = vals[i].reshape(length, m)[:k, :top].tolist()
            results.append(StepResult(tokens[i, :k].long().tolist(), lps[i, :k].tolist(),
                                      [list(zip(a, b, strict=True)) for a, b in zip(top_ids, top_lps, strict=True)]))
        return results
