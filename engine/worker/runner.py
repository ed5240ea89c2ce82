"""Runs one rank's share of a step: paged-KV forward, logits for the sampling rows, sampling. Speculative items
(``SeqWork.spec``) go to the speculator (``engine.worker.spec_contract.Speculator``), which drafts, verifies their trees
through the target forward this runner lends it (in the step's one forward), samples, walks and commits them.

With static steps on (``engine.static_steps``), a step that is all plain decodes or all tree verifies of at
most the largest static batch size runs through :class:`engine.worker.cuda_graphs.GraphRunner` (a CUDA-graph
replay on CUDA); every other step (prefill, mixed, oversized) runs the dynamic forward, and the step's
coverage records (:class:`engine.step.RunnerOutput`) say which happened and why."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from engine.blocks import blocks_for
from engine.params import Constraint
from engine.sampling.grammar import GrammarBackend, GrammarMasks
from engine.sampling.logits_processors import SamplingState, TreeSampling
from engine.staging import Readback, to_device
from engine.step import Record, RunnerOutput, SeqWork, StepItem, StepKind, StepPlan, StepResult, step_kind
from engine.worker.capture import capture_blocker, free_device_memory, memory_blocker, no_host_sync, static_step_bytes
from engine.worker.cuda_graphs import GraphRunner, SeqLayout, StaticSeq, StepShape
from engine.worker.expert_moves import ExpertMaps
from engine.worker.kv_budget import cache_spec
from engine.worker.kv_cache import PagedKV, PagedKVCache, SeqSlots
from engine.worker.kv_loads import HostPool, RankLoads, host_slots
from engine.worker.kv_store import KVStore, StoreSettings
from engine.worker.rank_requests import RankRequests
from engine.worker.spec_contract import Speculation, StaticLayout, TreeRows
from model.batch import ForwardBatch
from model.expert_load import ALL_ROWS, ExpertLoad
from model.expert_tally import ExpertTally
from model.transformer import CausalLM


@dataclass
class Launched:
    """A step whose device work is queued (:meth:`ModelRunner.launch`): host-ready ``results`` (speculative items;
    None on ranks that do not report), the coverage records and the plainly sampled items with their readback,
    which :meth:`ModelRunner.finish` waits for; ``draft_s`` / ``target_s``: the launch's host seconds in the
    speculator's draft and in the target step (with its sampling, and a speculative step's walk and commit)."""

    results: dict[str, StepResult] | None
    coverage: dict[StepKind, Record]
    sampled: tuple[list[SeqWork], Readback | None] | None = None
    draft_s: float = 0.0
    target_s: float = 0.0


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, kv_block_size: int, speculation: Speculation | None = None,
                 static_batch_sizes: tuple[int, ...] = (), max_model_len: int = 0,
                 eager_reason: str = "static steps off", overlap: bool = False, expert_tally: bool = False,
                 expert_load: bool = False, grammar: GrammarBackend | None = None, host_kv_cache_gb: float = 0.0,
                 kv_store: StoreSettings | None = None):
        """``speculation`` (from spec_decode) builds the rank's speculator when spec decoding is on.
        ``static_batch_sizes`` (empty: off) are the static step sizes; the cache then gets scratch blocks after
        the ``num_blocks`` the scheduler hands out, enough for a padding sequence of ``spec_reserve_slots``
        slots. ``eager_reason``: why no step replays when static steps are off. ``overlap`` (``engine.overlap``):
        every attention-TP rank samples, so the next step's inputs can take tokens from this one on the device.
        ``expert_tally`` (``engine.expert_tally``): :attr:`tally` counts the experts of decode and verify steps.
        ``expert_load`` (``engine.expert_load``): :attr:`expert_load` counts the tokens routed to each expert in every
        step (on attention-TP rank 0; a static step's padding rows left out).
        ``grammar``: structured output's xgrammar backend (None: constraints refused upstream).
        ``host_kv_cache_gb`` (``engine.host_kv_cache_gb``): the host KV tier's GiB per attention-DP group (0: none).
        ``kv_store``: the shared KV store's settings (None: no store)."""
        self.model, self.overlap = model, overlap
        self.tally = ExpertTally(model) if expert_tally else None  # before any capture: graphs then hold its ops
        self.expert_load = ExpertLoad(model, counting=model.groups.attn_tp.rank == 0) if expert_load else None
        self.expert_maps = ExpertMaps(model, model.groups)  # where each MoE layer's experts sit, and its version
        self.reports = model.groups.attn_tp.rank == 0  # holds the group's results (the others: None)
        self.last_tokens: torch.Tensor | None = None  # the last step's plainly sampled tokens, on the device
        # KV slots one step writes per request past its next position: a decode's token or a speculative step's
        step_slots = speculation.facts.spec_reserve_slots if speculation is not None else 1
        scratch = blocks_for(step_slots, kv_block_size) if static_batch_sizes else 0
        device = model.device
        self.device = device
        self.cache = PagedKVCache(cache_spec(model, speculation), num_blocks + scratch, kv_block_size, device=device)
        static = StaticLayout(batch_sizes=tuple(sorted(static_batch_sizes)),
                              max_blocks=blocks_for(max_model_len + step_slots, kv_block_size),
                              scratch_blocks=tuple(range(num_blocks, num_blocks + scratch))
                              ) if static_batch_sizes else None
        self.speculation = speculation
        self.speculator = speculation.build(model, self.cache, static) if speculation is not None else None
        self.feature_layers = self.speculator.feature_layers if self.speculator is not None else ()
        self.static = None
        if static is not None:
            self.static = GraphRunner(model, self.cache, static.max_blocks, static.scratch_blocks, static.batch_sizes,
                                      self.feature_layers, blocker=capture_blocker(model))
        self.eager_reason = eager_reason
        self.skipped: dict[tuple[int, int], str] = {}  # static shapes the memory guard turned away (warm_up)
        self.strict_sync = False  # static verify steps raise on a host sync between draft and commit (gpu_check)
        cfg = model.cfg
        self.sampling = SamplingState(cfg.vocab_size, tuple(cfg.eos_token_ids), device,
                                      GrammarMasks(grammar, device) if grammar is not None else None)
        self.requests = RankRequests(model.groups.coords.attn_dp_rank, self.sampling)
        slots = host_slots(host_kv_cache_gb, self.cache.block_bytes(), model.groups.attn_tp.size)
        host = HostPool(slots, self.cache.block_bytes(), pin=device.type == "cuda") if slots else None
        store = KVStore(kv_store, self.cache.replicated_bytes()) if kv_store is not None else None
        if store is not None:
            store.connect()
        # KV copies in and out (kv_loads.py)
        self.loads = RankLoads(self.cache, model.groups.rank, host, store, model.groups.attn_tp.rank)

    @property
    def tree_size(self) -> int:
        """Rows per request of a decode step: the speculation's tree size, or 1 (plain decoding)."""
        return self.speculation.facts.tree_size if self.speculation is not None else 1

    def _forward(self, work: list[SeqWork], trees: list[TreeRows]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                            list[int]]:
        """The dynamic forward over ``work``: each plain item's fed tokens, each speculative item's tree (``trees``,
        in order). Returns the hidden states ``[T, H]``, the drafter features ``[T, k*H]`` (None without
        speculation) and where each item's rows start (``T`` last)."""
        ids, pos, seqs = [], [], []
        remaining = iter(trees)
        for w in work:
            if w.spec:
                tree = next(remaining)
                tokens, positions, slots = tree.token_ids, tree.positions, tree.slots
            else:
                tokens, positions = w.token_ids, list(range(w.start, w.start + len(w.token_ids)))
                slots = SeqSlots(w.block_table, w.start, len(tokens))
            ids += tokens
            pos += positions
            seqs.append(slots)
        starts = [0, *itertools.accumulate(s.query_len for s in seqs)]
        ids_t = to_device(ids, torch.int64, self.device)
        self._take_previous(ids_t, [(starts[i + 1] - 1, w.prev_row) for i, w in enumerate(work) if w.prev_row >= 0])
        batch = ForwardBatch(ids_t, to_device(pos, torch.int64, self.device), [s.query_len for s in seqs],
                             PagedKV(self.cache, seqs))
        if self.feature_layers:
            hidden, feats = self.model(batch, capture=self.feature_layers)
        else:
            hidden, feats = self.model(batch), None
        return hidden, feats, starts

    def _take_previous(self, ids: torch.Tensor, refs: list[tuple[int, int]]) -> None:
        """Fills placeholder token ids ``(index in ids, previous step's sampled row)`` on the device, from the
        previous step's sampled tokens (``SeqWork.prev_row``): no host round trip."""
        if refs:
            index, rows = zip(*refs, strict=True)
            ids.index_copy_(0, to_device(index, torch.int64, self.device),
                            self.last_tokens[to_device(rows, torch.int64, self.device)])

    def precompile(self, constraint: Constraint) -> None:
        """Starts compiling ``constraint`` on the grammar thread (``Engine.precompile``; a rank without a grammar
        backend has no constrained requests)."""
        if self.sampling.grammar is not None:
            self.sampling.grammar.backend.compile_soon(constraint)

    def launch_plan(self, plan: StepPlan) -> Launched:
        """:meth:`launch` of this rank's share of ``plan``, after applying its changes to the requests kept here and
        its KV block copies (a fork's partial block, every layer group of the cache), once the KV loads it names are
        written."""
        self.expert_maps.check(plan.expert_versions)
        self.loads.wait(plan.loads)
        self.loads.wait_stores()
        dp = self.requests.dp_rank
        copies = [(src, dst) for rank, src, dst in plan.copies if rank == dp]
        self.cache.copy_blocks(copies)
        return self.launch(self.requests.apply(plan), plan.work)

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
    def launch(self, work: list[SeqWork], dp_work: list[list[StepItem]] | None = None) -> Launched:
        """Queues the step on the device; :meth:`finish` reads it back. Collective over the layout (idle DP ranks
        pass ``[]`` and still enter every MoE collective). ``dp_work``: every attention-DP rank's work this step (the
        whole plan; default ``[work]``), from which all ranks pick the same static shape. Speculative items are walked
        and read back here: the next step's start depends on them. The tokens ``work`` feeds join its requests'
        histories first (the logits processors' state). ``finish`` returns each sampling request's StepResult on the
        rank that holds the logits (None on the others) and the step's coverage records, the target step's under its
        kind (:func:`engine.step.step_kind`)."""
        dp_work = [work] if dp_work is None else dp_work
        work = self.sampling.bind(work)
        self.sampling.feed(work, self.last_tokens)
        kind = step_kind(w for per_rank in dp_work for w in per_rank)
        if self.tally is not None:
            self.tally.armed = kind in (StepKind.DECODE, StepKind.VERIFY)
        shape, why = self._static_shape(dp_work)
        if self.expert_load is not None:  # a static step's real rows come first, its padding after them
            self.expert_load.valid_rows.fill_(ALL_ROWS if shape is None else len(work) * shape.tree_size)
        t0 = time.perf_counter()
        sampled = None
        if shape is not None and shape.kind is StepKind.VERIFY:
            (results, target, parts), verify_started = self._verify_static(work, shape.batch)
        else:
            if shape is None:
                results, sampled, verify_started = self._execute_dynamic(work)
                target = (False, why)
            else:
                (results, sampled, target), verify_started = self._decode_static(work, shape.batch), t0
            # a dynamic step's draft and commit do not run statically, for the step's reason
            parts = dict.fromkeys((StepKind.DRAFT, StepKind.COMMIT), (False, why)) if any(w.spec for w in work) else {}
        return Launched(results, {kind: target, **parts}, sampled, draft_s=verify_started - t0,
                        target_s=time.perf_counter() - verify_started)

    def static_shapes(self) -> list[tuple[int, int]]:
        """Every configured static shape ``(batch, tree_size)``: a decode (tree size 1) per static batch size, or,
        with speculation on (every decode is then a tree verify), a verify of the speculation's tree size per batch
        size — each a draft, a verify and a commit — and, when the speculation is adaptive (its steps may be plain
        decodes), the decodes too."""
        if self.static is None:
            return []
        adaptive = self.speculation is not None and self.speculation.facts.adaptive
        return [(b, size) for b in self.static.batch_sizes
                for size in ((self.tree_size, 1) if adaptive else (self.tree_size,))]

    @torch.no_grad()
    def warm_up(self, batch: int, tree_size: int) -> tuple[bool, str]:
        """Runs static shape ``(batch, tree_size)`` once on an all-padding batch — capturing it on CUDA (the
        capture's own warm-up runs compile the Triton kernels) — as an idle attention-DP rank would: only the
        scratch blocks are written. Collective: every rank warms the same shape. It is no step: nothing of it
        reaches a step record. Returns the target step's ``(replayed, why not)``."""
        reason = self._memory_guard(batch, tree_size)
        if reason:
            self.skipped[batch, tree_size] = reason
            return False, reason
        if self.tally is not None:
            self.tally.armed = True  # a static shape is a decode or a verify, and its capture holds the count
        if self.expert_load is not None:
            self.expert_load.valid_rows.fill_(0)  # all padding
        if tree_size == 1:
            return self._decode_static([], batch)[2]
        target = _StaticTarget(self)
        self.speculator.warm_up_static(batch, target)
        return self.static.status(target.shape)

    def _memory_guard(self, batch: int, tree_size: int) -> str:
        """"" when static shape ``(batch, tree_size)``'s buffers fit in free device memory on every rank, else why
        not (:func:`engine.worker.capture.memory_blocker`). Collective over the control group, so every rank skips
        alike."""
        cfg, facts = self.model.cfg, self.speculation.facts if self.speculation is not None else None
        need = static_step_bytes(batch=batch, tree_size=tree_size, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
                                 intermediate=max(cfg.intermediate_size, cfg.moe.intermediate_size * cfg.moe.top_k),
                                 dtype_bytes=self.model.dtype.itemsize,
                                 feature_width=len(self.feature_layers) * cfg.hidden_size,
                                 draft_rows=facts.draft_rows if facts is not None else 0)
        reason = memory_blocker(need, free_device_memory(self.device))
        control = self.model.groups.control
        if control is None or control.size == 1:
            return reason
        reasons = control.all_gather_objects(reason)
        rank = next((r for r, why in enumerate(reasons) if why), None)
        return "" if rank is None else f"rank {control.ranks[rank]}: {reasons[rank]}"

    def _static_shape(self, dp_work: list[list[StepItem]]) -> tuple[StepShape | None, str]:
        """``(StepShape(batch, tree_size), "")`` when this step runs as a static step on every rank (``batch``: the
        busiest rank's item count, before rounding up to a static batch size), else ``(None, why not)``.

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
        if any(x.spec and x.constrained for w in busy for x in w):
            return None, "constrained speculative rows: their trees are built on the host under the grammar"
        if batch > sizes[-1]:
            return None, f"batch {batch} above the largest static batch size {sizes[-1]}"
        if all(verify) or all(decode):
            tree_size = self.tree_size if all(verify) else 1
            skipped = self.skipped.get((self.static.shape_for(batch, tree_size).batch, tree_size))
            return (None, f"static shape skipped: {skipped}") if skipped else (StepShape(batch, tree_size), "")
        return None, "prefill or mixed step (variable shapes)"

    def _decode_static(self, work: list[SeqWork], batch: int):
        """→ ``(results, sampled, record)``: no host results yet, the sampled rows, the coverage record."""
        seqs = [StaticSeq(self.cache.slots(w.block_table, w.start, w.start + 1), w.block_table, w.start + 1,
                          w.token_ids, [w.start]) for w in work]
        refs = [(i, w.prev_row) for i, w in enumerate(work) if w.prev_row >= 0]
        logits, feats = self.static.run(seqs, 1, batch, fill=lambda ids: self._take_previous(ids, refs))
        record = self.static.status(self.static.shape_for(batch, 1))
        if self.speculator is not None:  # plain decodes extend the drafter's context
            self.speculator.features_computed(work, feats)
        # like the dynamic path: results live on attention-TP rank 0 (with overlap every rank samples)
        sampled = self._sample_plain(work, logits) if self.reports or self.overlap else None
        return ({} if self.reports else None), sampled, record

    def _verify_static(self, work: list[SeqWork], batch: int):
        """A static speculative step, run by the speculator through the static tree verify lent to it
        (:class:`_StaticTarget`; ``strict_sync``: any host synchronisation between its draft and its commit
        raises). Every rank walks its trees (and compacts its KV shard). Returns ``((results, the verify's coverage
        record, the draft's and (with work) the commit's), when the verify started)``."""
        target = _StaticTarget(self)
        out = self.speculator.speculate_static(work, batch, target)
        self.sampling.accepted(work, out.results)
        record = self.static.status(target.shape)
        results = {w.request_id: r for w, r in zip(work, out.results, strict=True)} \
            if self.model.groups.attn_tp.rank == 0 else None
        return (results, record, out.coverage), target.verify_started

    def _execute_dynamic(self, work: list[SeqWork]):
        """→ ``(results, sampled, verify_started)``: the speculative items' results (None on ranks that do not
        report), the plainly sampled rows, and when the target forward started (the speculator drafts before)."""
        spec_items = [w for w in work if w.spec]
        target = _DynamicTarget(self, work)
        results = {}
        if spec_items:
            spec_results = self.speculator.speculate(spec_items, target)
            self.sampling.accepted(spec_items, spec_results)
            results = dict(zip((w.request_id for w in spec_items), spec_results, strict=True))
            if target.hidden is None:
                raise RuntimeError("the speculator returned without running the step's target forward")
        else:
            target.forward([])
        hidden, feats, starts = target.hidden, target.feats, target.starts
        plain = [i for i, w in enumerate(work) if not w.spec]
        if self.speculator is not None and plain:  # prefill chunks extend the drafter's context
            rows = feats if not spec_items else torch.cat([feats[starts[i]:starts[i + 1]] for i in plain])
            self.speculator.features_computed([work[i] for i in plain], rows)
        chosen = [i for i in plain if work[i].sample]
        ends = to_device([starts[i + 1] - 1 for i in chosen], torch.int64, self.device)
        # overlap: every attention-TP rank samples the same tokens from the same gathered logits
        logits = (self.model.logits_everywhere if self.overlap else self.model.logits)(hidden[ends])
        if logits is None:
            return None, None, target.verify_started
        sampled = self._sample_plain([work[i] for i in chosen], logits)
        return (results if self.reports else None), sampled, target.verify_started

    def _sample_plain(self, chosen: list[SeqWork], logits: torch.Tensor
                      ) -> tuple[list[SeqWork], Readback | None] | None:
        """Samples ``chosen``'s rows of ``logits`` on the device (kept as :attr:`last_tokens`) and, on the
        reporting rank, starts their one readback."""
        if not chosen:
            return None
        out = self.sampling.sample(logits.float(), self.sampling.plain_rows(chosen))
        self.last_tokens = out.tokens
        if not self.reports:
            return chosen, None
        return chosen, Readback([out.tokens, out.logprobs, out.top_ids, out.top_logprobs])


class _DynamicTarget:
    """:class:`engine.worker.spec_contract.TargetForward` of one dynamic step: the step's one forward over every item of
    ``work``, the speculator's trees among them. The hidden states and features stay here for the plain items."""

    def __init__(self, runner: ModelRunner, work: list[SeqWork]):
        self.runner, self.work = runner, work
        self.sampler = TreeSampling(runner.sampling)
        self.hidden: torch.Tensor | None = None
        self.feats: torch.Tensor | None = None
        self.starts: list[int] = []
        self.verify_started = time.perf_counter()  # reset when the speculator asks for the forward

    def forward(self, trees: list[TreeRows]) -> None:
        self.hidden, self.feats, self.starts = self.runner._forward(self.work, trees)

    def verify_trees(self, trees: list[TreeRows]) -> tuple[torch.Tensor, torch.Tensor]:
        self.verify_started = time.perf_counter()
        self.forward(trees)
        index = torch.cat([torch.arange(self.starts[i], self.starts[i + 1], device=self.runner.device)
                           for i, w in enumerate(self.work) if w.spec])
        return self.runner.model.logits_everywhere(self.hidden[index]), self.feats[index]


class _StaticTarget:
    """:class:`engine.worker.spec_contract.StaticTarget` of one static speculative step: the runner's static tree verify
    (:meth:`engine.worker.cuda_graphs.GraphRunner.load_tree_layout` and
    :meth:`~engine.worker.cuda_graphs.GraphRunner.run_tree`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sampler = TreeSampling(runner.sampling)
        self.shape: StepShape | None = None
        self.verify_started = time.perf_counter()

    def load_tree_layout(self, work: list[SeqWork], batch: int) -> None:
        cache, n = self.runner.cache, self.runner.tree_size
        seqs = [SeqLayout(cache.slots(w.block_table, w.start, w.start + n), w.block_table, w.start + n) for w in work]
        self.shape = self.runner.static.load_tree_layout(seqs, batch, n)

    def verify_trees(self, token_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.verify_started = time.perf_counter()
        return self.runner.static.run_tree(self.shape, token_ids, positions, tree_mask)

    def no_host_sync(self):
        return no_host_sync(self.runner.strict_sync)
