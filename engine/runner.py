"""Runs one rank's share of a step: paged-KV forward, logits for the sampling rows, sampling;
speculative items (``SeqWork.spec``) are drafted, verified as trees in the same forward, and walked.

With static steps on (``engine.static_steps``), a step that is all plain decodes or all tree verifies of at
most the largest static batch size runs through :class:`engine.cuda_graphs.GraphRunner` (a CUDA-graph
replay on CUDA); every other step (prefill, mixed, oversized) runs the dynamic forward, and
``last_graph`` says which happened and why."""

from __future__ import annotations

import time

import torch

from engine.cuda_graphs import GraphRunner, SeqLayout, StaticSeq, no_host_sync
from engine.graphs import capture_blocker
from engine.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
from engine.sampler import SamplingBatch, sample
from engine.scheduler import SeqWork, StepResult
from model.batch import ForwardBatch
from model.transformer import CausalLM
from spec_decode.tree import DraftTree


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, speculator_factory=None,
                 static_batch_sizes: tuple[int, ...] = (), max_model_len: int = 0, max_nodes: int = 1):
        """``speculator_factory(model, cache)`` builds the rank's Speculator when spec decoding is on.
        ``static_batch_sizes`` (empty: off) are the static step sizes; the cache then gets scratch blocks after
        the ``num_blocks`` the scheduler hands out, enough for a ``max_nodes`` padding tree."""
        self.model = model
        scratch = -(-max_nodes // block_size) if static_batch_sizes else 0
        device = model.device
        self.device = device
        self.cache = PagedKVCache(KVSpec.for_model(model), num_blocks + scratch, block_size, device=device)
        self.speculator = speculator_factory(model, self.cache) if speculator_factory else None
        self.timing = {"draft_s": 0.0, "verify_s": 0.0}
        self.graphs = self.drafts = self.commits = None
        if static_batch_sizes:
            max_blocks = -(-(max_model_len + max_nodes) // block_size)
            capture = self.speculator.capture if self.speculator else ()
            scratch_blocks = tuple(range(num_blocks, num_blocks + scratch))
            self.graphs = GraphRunner(model, self.cache, max_blocks, scratch_blocks, static_batch_sizes, capture,
                                      blocker=capture_blocker(model))
            if self.speculator is not None:
                from spec_decode.static_commit import CommitGraphs  # engine/ knows spec_decode only when it is on
                from spec_decode.static_draft import DraftGraphs

                self.drafts = DraftGraphs(self.speculator, max_blocks, scratch_blocks, static_batch_sizes)
                self.commits = CommitGraphs(self.speculator, scratch_blocks)
        self.last_graph: tuple[bool, str] = (False, "static steps off")
        self.last_spec: dict[str, tuple[bool, str]] = {}  # this step's draft and commit: (replayed, why not)
        self.strict_sync = False  # static verify steps raise on a host sync between draft and commit (gpu_check)

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
        if shape is not None and shape[1] > 1:
            return self._verify_static(work, shape[0])
        t0 = time.perf_counter()
        trees = self._propose([w for w in work if w.spec])
        t1 = time.perf_counter()
        results = self._execute_dynamic(work, trees) if shape is None else self._decode_static(work, shape[0])
        self.timing["draft_s"] += t1 - t0
        self.timing["verify_s"] += time.perf_counter() - t1
        return results

    def _propose(self, items: list[SeqWork]) -> dict[str, DraftTree]:
        """The dynamic ``Speculator.propose`` for this rank's speculative items; ``last_spec`` says why the draft
        and the commit do not run statically."""
        self.last_spec = dict.fromkeys(("draft", "commit"), (False, self.last_graph[1])) if items else {}
        return self.speculator.propose(items) if items else {}

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

    def _decode_static(self, work: list[SeqWork], batch: int) -> dict[str, StepResult] | None:
        seqs = [StaticSeq(self.cache.slots(w.block_table, w.start, w.start + 1), w.block_table, w.start + 1,
                          w.token_ids, [w.start]) for w in work]
        logits, feats = self.graphs.run(seqs, 1, batch)
        self._note_graph(batch, 1)
        if self.speculator is not None:  # plain decodes extend the drafter's context
            for i, w in enumerate(work):
                self.speculator.add_context(w, feats[i:i + 1], w.start)
        if self.model.groups.attn_tp.rank != 0:  # like the dynamic path: results live on attention-TP rank 0
            return None
        return self._sample_plain(work, logits)

    def _verify_static(self, work: list[SeqWork], batch: int) -> dict[str, StepResult] | None:
        """A static tree verify: every input goes into the draft's and the verify's buffers first (host values);
        then draft → verify → walk and KV compaction run on the device, the trees read where the draft left
        them (``strict_sync``: any host synchronisation in there raises); one readback at the end. Every rank
        walks its trees (and compacts its KV shard)."""
        spec = self.speculator
        n = spec.cfg.num_nodes
        seqs = [SeqLayout(self.cache.slots(w.block_table, w.start, w.start + n), w.block_table, w.start + n)
                for w in work]
        t0 = time.perf_counter()
        size = self.drafts.load(work, batch)
        shape = self.graphs.load_tree_layout(seqs, size, n)
        self.commits.prepare(size, n)
        sampling = spec.node_sampling(work, n, self.device)
        with no_host_sync(self.strict_sync):
            tree, start = self.drafts.launch(size)
            t1 = time.perf_counter()
            logits, feats, slots = self.graphs.run_tree(shape, tree, start)
            committed = spec.walk_and_commit(tree, logits, feats, slots, start, sampling, self.commits.run) \
                if work else None
        results = committed.results(work) if work else []
        self.last_spec = {"draft": self.drafts.last, **({"commit": self.commits.last} if work else {})}
        self._note_graph(size, n)
        self.timing["draft_s"] += t1 - t0
        self.timing["verify_s"] += time.perf_counter() - t1
        if self.model.groups.attn_tp.rank != 0:
            return None
        return {w.request_id: r for w, r in zip(work, results, strict=True)}

    def _note_graph(self, batch: int, nodes: int) -> None:
        shape = self.graphs.shape_for(batch, nodes)
        self.last_graph = (shape in self.graphs.graphs, self.graphs.reasons.get(shape, ""))

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
        """The dynamic forward's tree rows → one batched walk over this rank's speculative items."""
        items = [w for w in work if w.spec]
        index = torch.cat([torch.arange(starts[i], starts[i + 1], device=self.device)
                           for i, w in enumerate(work) if w.spec])
        n = self.speculator.cfg.num_nodes
        slots = torch.stack([self.cache.slot_tensor(w.block_table, w.start, w.start + n) for w in items])
        start = torch.tensor([w.start for w in items], device=self.device)
        results = self.speculator.accept(items, DraftTree.stack([trees[w.request_id] for w in items]),
                                         self.model.logits_everywhere(hidden[index]), feats[index], slots, start)
        return {w.request_id: r for w, r in zip(items, results, strict=True)}

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
