"""Runs one rank's share of a step: paged-KV forward, logits for the sampling rows, sampling;
speculative items (``SeqWork.spec``) are drafted, verified as trees in the same forward, and walked."""

from __future__ import annotations

import time

import torch

from engine.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
from engine.sampler import SamplingBatch, sample
from engine.scheduler import SeqWork, StepResult
from model.batch import ForwardBatch
from model.transformer import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, speculator_factory=None):
        """``speculator_factory(model, cache)`` builds the rank's Speculator when spec decoding is on."""
        self.model = model
        self.cache = PagedKVCache(KVSpec.for_model(model), num_blocks, block_size)
        self.speculator = speculator_factory(model, self.cache) if speculator_factory else None
        self.timing = {"draft_s": 0.0, "verify_s": 0.0}

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
        return ForwardBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                            [s.query_len for s in seqs], PagedKV(self.cache, seqs))

    @torch.no_grad()
    def execute(self, work: list[SeqWork], finished: tuple[str, ...] = ()) -> dict[str, StepResult] | None:
        """Collective over the layout (idle DP ranks pass ``[]`` and still enter every MoE collective).
        Returns each sampling request's StepResult on the rank that holds the logits, None on the others."""
        spec = self.speculator
        if spec is not None:
            spec.drop(finished)
        t0 = time.perf_counter()
        trees = {w.request_id: spec.propose(w) for w in work if w.spec}
        t1 = time.perf_counter()
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
                    spec.add_context(w.request_id, feats[starts[i]:starts[i + 1]],
                                     torch.arange(w.start, w.start + len(w.token_ids)))
        plain = [i for i, w in enumerate(work) if w.sample and not w.spec]
        ends = torch.tensor([starts[i + 1] - 1 for i in plain], dtype=torch.int64)
        logits = self.model.logits(hidden[ends])
        self.timing["draft_s"] += t1 - t0
        self.timing["verify_s"] += time.perf_counter() - t1
        if logits is None:
            return None
        results.update(self._sample_plain([work[i] for i in plain], logits))
        return results

    def _speculative(self, work, trees, hidden, feats, starts) -> dict[str, StepResult]:
        rows = [(i, w) for i, w in enumerate(work) if w.spec]
        index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i, _ in rows])
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
                                 [w.num_generated for w in chosen])
        out = sample(logits.float(), sb)
        tokens, lps = out.tokens.tolist(), out.logprobs.tolist()
        top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        result = {}
        for i, w in enumerate(chosen):
            n = w.params.logprobs
            top = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True))
            result[w.request_id] = StepResult([tokens[i]], [lps[i]], [top])
        return result
