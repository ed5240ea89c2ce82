"""Runs one rank's share of a step: paged-KV forward, logits for the sampling rows, sampling;
speculative items (``SeqWork.spec``) are drafted, verified as trees in the same forward, and walked.

With static steps on (``engine.static_steps``), a step that is all plain decodes or all tree verifies of at
most the largest static batch size runs through :class:`engine.cuda_graphs.GraphRunner` (a CUDA-graph
replay on CUDA); every other step (prefill, mixed, oversized) runs the dynamic forward, and the step's
coverage records (:class:`engine.step.RunnerOutput`) say which happened and why."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from engine.capture import (
    GraphCoverage,
    capture_blocker,
    free_device_memory,
    memory_blocker,
    no_host_sync,
    static_step_bytes,
)
from engine.cuda_graphs import GraphRunner, SeqLayout, StaticSeq
from engine.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
from engine.sampler import SamplingBatch, sample
from engine.speculation import Speculation
from engine.staging import Readback, to_device
from engine.step import RunnerOutput, SeqWork, StepResult, step_kind
from model.batch import ForwardBatch
from model.expert_tally import ExpertTally
from model.transformer import CausalLM

Record = tuple[bool, str]  # a coverage record: (replayed, why not)


@dataclass
class Launched:
    """A step whose device work is queued (:meth:`ModelRunner.launch`): host-ready ``results`` (speculative items;
    None on ranks that do not report), the coverage records and the plainly sampled items with their readback,
    which :meth:`ModelRunner.finish` waits for."""

    results: dict[str, StepResult] | None
    coverage: dict[str, Record]
    sampled: tuple[list[SeqWork], Readback | None] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, speculation: Speculation | None = None,
                 static_batch_sizes: tuple[int, ...] = (), max_model_len: int = 0,
                 eager_reason: str = "static steps off", overlap: bool = False, expert_tally: bool = False):
        """``speculation`` (from spec_decode) builds the rank's speculator when spec decoding is on.
        ``static_batch_sizes`` (empty: off) are the static step sizes; the cache then gets scratch blocks after
        the ``num_blocks`` the scheduler hands out, enough for a padding tree of ``speculation.scratch_slots``
        nodes. ``eager_reason``: why no step replays when static steps are off. ``overlap`` (``engine.overlap``):
        every attention-TP rank samples, so the next step's inputs can take tokens from this one on the device.
        ``expert_tally`` (``engine.expert_tally``): :attr:`tally` counts the experts of decode and verify steps."""
        self.model, self.overlap = model, overlap
        self.tally = ExpertTally(model) if expert_tally else None  # before any capture: graphs then hold its ops
        self.reports = model.groups.attn_tp.rank == 0  # holds the group's results (the others: None)
        self.last_tokens: torch.Tensor | None = None  # the last step's plainly sampled tokens, on the device
        max_nodes = speculation.scratch_slots if speculation is not None else 1
        scratch = -(-max_nodes // block_size) if static_batch_sizes else 0
        device = model.device
        self.device = device
        self.cache = PagedKVCache(KVSpec.for_model(model), num_blocks + scratch, block_size, device=device)
        self.speculation = speculation
        self.speculator = speculation.build(model, self.cache) if speculation is not None else None
        self.timing = {"draft_s": 0.0, "verify_s": 0.0}
        self.static = self.drafts = self.commits = None
        if static_batch_sizes:
            max_blocks = -(-(max_model_len + max_nodes) // block_size)
            capture = self.speculator.capture if self.speculator else ()
            scratch_blocks = tuple(range(num_blocks, num_blocks + scratch))
            self.static = GraphRunner(model, self.cache, max_blocks, scratch_blocks, static_batch_sizes, capture,
                                      blocker=capture_blocker(model))
            if self.speculator is not None:
                self.drafts, self.commits = speculation.static_graphs(self.speculator, max_blocks, scratch_blocks,
                                                                      static_batch_sizes)
        self.eager_reason = eager_reason
        self.skipped: dict[tuple[int, int], str] = {}  # static shapes the memory guard turned away (warm_up)
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
        ids_t = to_device(ids, torch.int64, self.device)
        self._take_previous(ids_t, [(rows[-1], w.prev_row) for w, rows in zip(work, self._ends(seqs), strict=True)
                                    if w.prev_row >= 0])
        pos_t = to_device(pos, torch.int64, self.device)
        return ForwardBatch(ids_t, pos_t, [s.query_len for s in seqs], PagedKV(self.cache, seqs))

    @staticmethod
    def _ends(seqs: list[SeqSlots]) -> list[range]:
        """Each sequence's rows in the flattened batch."""
        starts = [0, *itertools.accumulate(s.query_len for s in seqs)]
        return [range(a, b) for a, b in itertools.pairwise(starts)]

    def _take_previous(self, ids: torch.Tensor, refs: list[tuple[int, int]]) -> None:
        """Fills placeholder token ids ``(index in ids, previous step's sampled row)`` on the device, from the
        previous step's sampled tokens (``SeqWork.prev_row``): no host round trip."""
        if refs:
            index, rows = zip(*refs, strict=True)
            ids.index_copy_(0, to_device(index, torch.int64, self.device),
                            self.last_tokens[to_device(rows, torch.int64, self.device)])

    def execute(self, work: list[SeqWork], dp_work: list[list[SeqWork]] | None = None) -> RunnerOutput:
        """Collective over the layout (idle DP ranks pass ``[]`` and still enter every MoE collective).
        ``dp_work``: every attention-DP rank's work this step (the whole plan; default ``[work]``), from which
        all ranks pick the same static shape. Returns each sampling request's StepResult on the rank that
        holds the logits (None on the others) and the step's coverage records, the target step's under its
        kind (prefill, decode, verify, mixed). :meth:`launch` then :meth:`finish`."""
        return self.finish(self.launch(work, dp_work))

    def finish(self, step: Launched) -> RunnerOutput:
        """``step``'s one readback (it waits for that step's copy only, not for steps launched after it)."""
        results = step.results
        if step.sampled is not None and results is not None:
            chosen, readback = step.sampled
            tokens, lps, top_ids, top_lps = readback.lists()
            for i, w in enumerate(chosen):
                n = w.params.logprobs
                top = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True))
                results[w.request_id] = StepResult([tokens[i]], [lps[i]], [top])
        return RunnerOutput(results, step.coverage)

    @torch.no_grad()
    def launch(self, work: list[SeqWork], dp_work: list[list[SeqWork]] | None = None) -> Launched:
        """Queues the step on the device (:meth:`execute` without the readback of plainly sampled tokens).
        Speculative items are walked and read back here: the next step's start depends on them."""
        dp_work = [work] if dp_work is None else dp_work
        items = [w for per_rank in dp_work for w in per_rank]
        kind = step_kind(items)
        kind = "verify" if kind == "decode" and any(w.spec for w in items) else kind
        if self.tally is not None:
            self.tally.armed = kind in ("decode", "verify")
        shape, why = self._static_shape(dp_work)
        if shape is not None and shape[1] > 1:
            results, target, parts = self._verify_static(work, shape[0])
            return Launched(results, {kind: target, **parts})
        t0 = time.perf_counter()
        spec_items = [w for w in work if w.spec]
        trees = self.speculator.propose(spec_items) if spec_items else {}
        t1 = time.perf_counter()
        if shape is None:
            (results, sampled), target = self._execute_dynamic(work, trees), (False, why)
        else:
            results, sampled, target = self._decode_static(work, shape[0])
        self.timing["draft_s"] += t1 - t0
        self.timing["verify_s"] += time.perf_counter() - t1
        # a dynamic step's draft and commit do not run statically, for the step's reason
        parts = dict.fromkeys(("draft", "commit"), (False, why)) if spec_items else {}
        return Launched(results, {kind: target, **parts}, sampled)

    def static_shapes(self) -> list[tuple[int, int]]:
        """Every configured static shape ``(batch, nodes)``: a decode (nodes 1) per static batch size, or, with
        speculation on (every decode is then a tree verify), a verify of ``num_nodes`` nodes per batch size —
        each a draft, a verify and a commit."""
        if self.static is None:
            return []
        nodes = self.speculation.num_nodes if self.speculator is not None else 1
        return [(b, nodes) for b in self.static.batch_sizes]

    @torch.no_grad()
    def warm_up(self, batch: int, nodes: int) -> tuple[bool, str]:
        """Runs static shape ``(batch, nodes)`` once on an all-padding batch — capturing it on CUDA (the
        capture's own warm-up runs compile the Triton kernels) — as an idle attention-DP rank would: only the
        scratch blocks are written. Collective: every rank warms the same shape. Counts no coverage and no
        timing. Returns the target step's ``(replayed, why not)``."""
        reason = self._memory_guard(batch, nodes)
        if reason:
            self.skipped[batch, nodes] = reason
            return False, reason
        if self.tally is not None:
            self.tally.armed = True  # a static shape is a decode or a verify, and its capture holds the count
        holders = [g for g in (self.static, self.drafts, self.commits) if g is not None]
        saved = [g.coverage for g in holders], dict(self.timing)
        for g in holders:
            g.coverage = GraphCoverage()
        try:
            if nodes == 1:
                return self._decode_static([], batch)[2]
            _, record, _ = self._verify_static([], batch)
            self.commits.warm_up(batch, nodes)  # an idle rank's verify does not commit
            return record
        finally:
            for g, coverage in zip(holders, saved[0], strict=True):
                g.coverage = coverage
            self.timing = saved[1]

    def _memory_guard(self, batch: int, nodes: int) -> str:
        """"" when static shape ``(batch, nodes)``'s buffers fit in free device memory on every rank, else why not
        (:func:`engine.capture.memory_blocker`). Collective over the control group, so every rank skips alike."""
        cfg, spec = self.model.cfg, self.speculation
        need = static_step_bytes(batch=batch, nodes=nodes, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
                                 intermediate=max(cfg.intermediate_size, cfg.moe.intermediate_size * cfg.moe.top_k),
                                 dtype_bytes=self.model.dtype.itemsize,
                                 feature_width=len(self.speculator.capture) * cfg.hidden_size if spec else 0,
                                 draft_rows=spec.scratch_slots if spec else 0)
        reason = memory_blocker(need, free_device_memory(self.device))
        control = self.model.groups.control
        if control is None or control.size == 1:
            return reason
        reasons = control.all_gather_objects(reason)
        rank = next((r for r, why in enumerate(reasons) if why), None)
        return "" if rank is None else f"rank {control.ranks[rank]}: {reasons[rank]}"

    def _static_shape(self, dp_work: list[list[SeqWork]]) -> tuple[tuple[int, int] | None, str]:
        """``((batch, nodes), "")`` when this step runs as a static step on every rank, else ``(None, why not)``.

        Decided from every attention-DP rank's work, so all ranks agree without a collective: each busy rank
        must hold only plain decodes or only tree verifies (the same kind everywhere), the batch is the busiest
        rank's, and idle or less busy ranks pad to it — every rank then runs (replays) the same shape and its
        MoE collectives line up, as DeepEP's low-latency kernels inside a graph require."""
        if self.static is None:
            return None, self.eager_reason
        busy = [w for w in dp_work if w]
        sizes, batch = self.static.batch_sizes, max(len(w) for w in dp_work)
        verify = [all(x.spec for x in w) for w in busy]
        decode = [all(x.decode and x.sample and not x.spec and len(x.token_ids) == 1 for x in w) for w in busy]
        if not busy:
            return None, "no work on any rank"
        if batch > sizes[-1]:
            return None, f"batch {batch} above the largest static batch size {sizes[-1]}"
        if all(verify) or all(decode):
            nodes = self.speculation.num_nodes if all(verify) else 1
            skipped = self.skipped.get((self.static.shape_for(batch, nodes).batch, nodes))
            return (None, f"static shape skipped: {skipped}") if skipped else ((batch, nodes), "")
        return None, "prefill or mixed step (variable shapes)"

    def _decode_static(self, work: list[SeqWork], batch: int):
        """→ ``(results, sampled, record)``: no host results yet, the sampled rows, the coverage record."""
        seqs = [StaticSeq(self.cache.slots(w.block_table, w.start, w.start + 1), w.block_table, w.start + 1,
                          w.token_ids, [w.start]) for w in work]
        refs = [(i, w.prev_row) for i, w in enumerate(work) if w.prev_row >= 0]
        logits, feats = self.static.run(seqs, 1, batch, fill=lambda ids: self._take_previous(ids, refs))
        record = self.static.status(self.static.shape_for(batch, 1))
        if self.speculator is not None:  # plain decodes extend the drafter's context
            for i, w in enumerate(work):
                self.speculator.add_context(w, feats[i:i + 1], w.start)
        # like the dynamic path: results live on attention-TP rank 0 (with overlap every rank samples)
        sampled = self._sample_plain(work, logits) if self.reports or self.overlap else None
        return ({} if self.reports else None), sampled, record

    def _verify_static(self, work: list[SeqWork], batch: int
                       ) -> tuple[dict[str, StepResult] | None, Record, dict[str, Record]]:
        """A static tree verify: every input goes into the draft's and the verify's buffers first (host values);
        then draft → verify → walk and KV compaction run on the device, the trees read where the draft left
        them (``strict_sync``: any host synchronisation in there raises); one readback at the end. Every rank
        walks its trees (and compacts its KV shard). Returns the results, the verify's coverage record and the
        draft's and (with work) the commit's."""
        spec = self.speculator
        n = self.speculation.num_nodes
        seqs = [SeqLayout(self.cache.slots(w.block_table, w.start, w.start + n), w.block_table, w.start + n)
                for w in work]
        t0 = time.perf_counter()
        size = self.drafts.load(work, batch)
        shape = self.static.load_tree_layout(seqs, size, n)
        self.commits.prepare(size, n)
        sampling = spec.node_sampling(work, n, self.device)
        with no_host_sync(self.strict_sync):
            tree, start = self.drafts.launch(size)
            t1 = time.perf_counter()
            logits, feats, slots = self.static.run_tree(shape, *spec.verify_inputs(tree, start))
            committed = spec.walk_and_commit(tree, logits, feats, slots, start, sampling, self.commits.run) \
                if work else None
        results = committed.results(work) if work else []
        parts = {"draft": self.drafts.status(size), **({"commit": self.commits.status((size, n))} if work else {})}
        self.timing["draft_s"] += t1 - t0
        self.timing["verify_s"] += time.perf_counter() - t1
        record = self.static.status(shape)
        if self.model.groups.attn_tp.rank != 0:
            return None, record, parts
        return {w.request_id: r for w, r in zip(work, results, strict=True)}, record, parts

    def _execute_dynamic(self, work: list[SeqWork], trees: dict):
        """→ ``(results, sampled)``: the speculative items' results (None on ranks that do not report) and the
        plainly sampled rows."""
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
        ends = to_device([starts[i + 1] - 1 for i in plain], torch.int64, self.device)
        # overlap: every attention-TP rank samples the same tokens from the same gathered logits
        logits = (self.model.logits_everywhere if self.overlap else self.model.logits)(hidden[ends])
        if logits is None:
            return None, None
        return (results if self.reports else None), self._sample_plain([work[i] for i in plain], logits)

    def _speculative(self, work, trees, hidden, feats, starts) -> dict[str, StepResult]:
        """The dynamic forward's tree rows → one batched walk over this rank's speculative items."""
        items = [w for w in work if w.spec]
        index = torch.cat([torch.arange(starts[i], starts[i + 1], device=self.device)
                           for i, w in enumerate(work) if w.spec])
        results = self.speculator.accept_rows(items, trees, self.model.logits_everywhere(hidden[index]), feats[index])
        return {w.request_id: r for w, r in zip(items, results, strict=True)}

    def _sample_plain(self, chosen: list[SeqWork], logits: torch.Tensor
                      ) -> tuple[list[SeqWork], Readback | None] | None:
        """Samples ``chosen``'s rows of ``logits`` on the device (kept as :attr:`last_tokens`) and, on the
        reporting rank, starts their one readback."""
        if not chosen:
            return None
        sb = SamplingBatch.build([w.params for w in chosen], [w.seed for w in chosen],
                                 [w.num_generated for w in chosen], self.model.cfg.eos_token_ids,
                                 [w.num_generated for w in chosen], device=logits.device)
        out = sample(logits.float(), sb)
        self.last_tokens = out.tokens
        if not self.reports:
            return chosen, None
        return chosen, Readback([out.tokens, out.logprobs, out.top_ids, out.top_logprobs])
