"""Runs one rank's share of a step: paged-KV forward, logits for the sampling rows, sampling;
speculative items (``SeqWork.spec``) are drafted, verified as trees in the same forward, and walked.

With static steps on (``engine.static_steps``), a step that is all plain decodes or all tree verifies of at
most the largest static batch size runs through :class:`engine.cuda_graphs.GraphRunner` (a CUDA-graph
replay on CUDA); every other step (prefill, mixed, oversized) runs the dynamic forward, and
``last_graph`` says which happened and why."""

from __future__ import annotations

import time

import torch

from engine.cuda_graphs import GraphRunner, StaticSeq
from engine.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
from engine.sampler import SamplingBatch, sample
from engine.scheduler import SeqWork, StepResult
from model.batch import ForwardBatch
from model.transformer import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, speculator_factory=None,
                 static_batch_sizes: tuple[int, ...] = (), max_model_len: int = 0, max_nodes: int = 1):
        """``speculator_factory(model, cache)`` builds the rank's Speculator when spec decoding is on.
        ``static_batch_sizes`` (empty: off) are the static step sizes; the cache then gets scratch blocks after
        the ``num_blocks`` the scheduler hands out, enough for a ``max_nodes`` padding tree."""
        self.model = model
        scratch = -(-max_nodes // block_size) if static_batch_sizes else 0
        device = model.model.norm.weight.device
        self.device = device
        self.cache = PagedKVCache(KVSpec.for_model(model), num_blocks + scratch, block_size, device=device)
        self.speculator = speculator_factory(model, self.cache) if speculator_factory else None
        self.timing = {"draft_s": 0.0, "verify_s": 0.0}
        self.graphs = self.drafts = None
        if static_batch_sizes:
            max_blocks = -(-(max_model_len + max_nodes) // block_size)
            capture = self.speculator.capture if self.speculator else ()
            scratch_blocks = tuple(range(num_blocks, num_blocks + scratch))
            self.graphs = GraphRunner(model, self.cache, max_blocks, scratch_blocks, static_batch_sizes, capture)
            if self.speculator is not None:
                from spec_decode.static_draft import DraftGraphs  # engine/ knows spec_decode only when it is on

                self.drafts = DraftGraphs(self.speculator, max_blocks, scratch_blocks, static_batch_sizes)
        self.last_graph: tuple[bool, str] = (False, "static steps off")
        self.last_draft: tuple[bool, str] | None = None  # (replayed, why not) of this step's draft; None: none

    def _batch(self, work: list[SeqWork], trees: dict) -> ForwardBatch:
        ids, pos, seqs = [], [], []
        for w in work:
            if w.spec:
                tokens, positions, slots = self.speculator.verify_slots(w, trees[w.request_id])
            else:
                tokens, positions = w.token_ids, list(range(w.start, w.start + len(w.token_ids)))
                slots = SeqSlots(w.block_table, w.start, len(tokens))
            ids += tokens
            pos += positions
            seqs.append(slots)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=self.device)
        return ForwardBatch(ids_t, pos_t, [s.query_len for s in seqs], PagedKV(self.cache, seqs))

    @torch.no_grad()
    def execute(self, work: list[SeqWork], dp_work: list[list[SeqWork]] | None = None
                ) -> dict[str, StepResult] | None:
        """Collective over the layout (idle DP ranks pass ``[]`` and still enter every MoE collective).
        ``dp_work``: every attention-DP rank's work this step (the whole plan; default ``[work]``), from which
        all ranks pick the same static shape. Returns each sampling request's StepResult on the rank that
        holds the logits, None on the others."""
        shape = self._static_shape([work] if dp_work is None else dp_work)
        t0 = time.perf_counter()
        trees = self._draft([w for w in work if w.spec], shape)
        t1 = time.perf_counter()
        if shape:
            results = self._execute_static(work, trees, *shape)
        else:
            results = self._execute_dynamic(work, trees)
        self.timing["draft_s"] += t1 - t0
        self.timing["verify_s"] += time.perf_counter() - t1
        return results

    def _draft(self, items: list[SeqWork], shape: tuple[int, int] | None) -> dict:
        """This rank's draft trees: a static draft when the step is a static tree verify, else the dynamic
        ``Speculator.propose``; ``last_draft`` says which and why."""
        if not items:
            self.last_draft = None
            return {}
        if shape is not None and shape[1] > 1 and self.drafts is not None:
            trees = self.drafts.run(items)
            self.last_draft = self.drafts.last
            return trees
        self.last_draft = (False, self.last_graph[1])
        return self.speculator.propose(items)

    def _static_shape(self, dp_work: list[list[SeqWork]]) -> tuple[int, int] | None:
        """``(batch, nodes)`` when this step runs as a static step on every rank, else None (why: last_graph).

        Decided from every attention-DP rank's work, so all ranks agree without a collective: each busy rank
        must hold only plain decodes or only tree verifies (the same kind everywhere), the batch is the busiest
        rank's, and idle or less busy ranks pad to it — every rank then runs (replays) the same shape and its
        MoE collectives line up, as DeepEP's low-latency kernels inside a graph require."""
        if self.graphs is None:
            return None
        busy = [w for w in dp_work if w]
        sizes, batch = self.graphs.batch_sizes, max(len(w) for w in dp_work)
        verify = [all(x.spec for x in w) for w in busy]
        decode = [all(x.decode and x.sample and not x.spec and len(x.token_ids) == 1 for x in w) for w in busy]
        if not busy:
            self.last_graph = (False, "no work on any rank")
        elif batch > sizes[-1]:
            self.last_graph = (False, f"batch {batch} above the largest static batch size {sizes[-1]}")
        elif all(verify):
            return batch, self.speculator.cfg.num_nodes
        elif all(decode):
            return batch, 1
        else:
            self.last_graph = (False, "prefill or mixed step (variable shapes)")
        return None

    def _execute_static(self, work: list[SeqWork], trees: dict, batch: int, nodes: int
                        ) -> dict[str, StepResult] | None:
        seqs = []
        for w in work:
            if w.spec:
                tree = trees[w.request_id]
                tokens, positions = self.speculator.tree_inputs(w, tree)
                mask = tree.ancestors
            else:
                tokens, positions, mask = w.token_ids, [w.start], None
            seqs.append(StaticSeq(tokens, positions, self.cache.slots(w.block_table, w.start, w.start + nodes),
                                  w.block_table, w.start + nodes, mask))
        logits, feats = self.graphs.run(seqs, nodes, batch)
        shape = self.graphs.shape_for(batch, nodes)
        self.last_graph = (shape in self.graphs.graphs, self.graphs.reasons.get(shape, ""))
        if self.speculator is not None and nodes == 1:  # plain decodes extend the drafter's context
            for i, w in enumerate(work):
                self.speculator.add_context(w, feats[i:i + 1], w.start)
        out = {}
        if nodes > 1:  # every rank walks its tree (and compacts its KV shard)
            for i, w in enumerate(work):
                rows = slice(i * nodes, (i + 1) * nodes)
                out[w.request_id] = self.speculator.accept(w, trees[w.request_id], logits[rows], feats[rows])
        if self.model.groups.attn_tp.rank != 0:  # like the dynamic path: results live on attention-TP rank 0
            return None
        return out if nodes > 1 else self._sample_plain(work, logits)

    def _execute_dynamic(self, work: list[SeqWork], trees: dict) -> dict[str, StepResult] | None:
        spec = self.speculator
        batch = self._batch(work, trees)
        if spec is not None:
            hidden, feats = self.model(batch, capture=spec.capture)
        else:
            hidden, feats = self.model(batch), None
        starts = [0, *torch.tensor(batch.query_lens, dtype=torch.int64).cumsum(0).tolist()]
        results = self._speculative(work, trees, hidden, feats, starts) if trees else {}
        if spec is not None:  # prefill chunks extend the drafter's context
            for i, w in enumerate(work):
                if not w.spec:
                    spec.add_context(w, feats[starts[i]:starts[i + 1]], w.start)
        plain = [i for i, w in enumerate(work) if w.sample and not w.spec]
        ends = torch.tensor([starts[i + 1] - 1 for i in plain], dtype=torch.int64, device=self.device)
        logits = self.model.logits(hidden[ends])
        if logits is None:
            return None
        results.update(self._sample_plain([work[i] for i in plain], logits))
        return results

    def _speculative(self, work, trees, hidden, feats, starts) -> dict[str, StepResult]:
        rows = [(i, w) for i, w in enumerate(work) if w.spec]
        index = torch.cat([torch.arange(starts[i], starts[i + 1], device=self.device) for i, _ in rows])
        logits = self.model.logits_everywhere(hidden[index])
        out, offset = {}, 0
        for i, w in rows:
            n = starts[i + 1] - starts[i]
            out[w.request_id] = self.speculator.accept(w, trees[w.request_id], logits[offset:offset + n],
                                                       feats[starts[i]:starts[i + 1]])
            offset += n
        return out

    def _sample_plain(self, chosen: list[SeqWork], logits: torch.Tensor) -> dict[str, StepResult]:
        if not chosen:
            return {}
        sb = SamplingBatch.build([w.params for w in chosen], [w.seed for w in chosen],
                                 [w.num_generated for w in chosen], self.model.cfg.eos_token_ids,
                                 [w.num_generated for w in chosen], device=logits.device)
        out = sample(logits.float(), sb)
        tokens, lps = out.tokens.tolist(), out.logprobs.tolist()
        top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        result = {}
        for i, w in enumerate(chosen):
            n = w.params.logprobs
            top = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True))
            result[w.request_id] = StepResult([tokens[i]], [lps[i]], [top])
        return result
