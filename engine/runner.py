"""Runs one rank's share of a step: paged-KV forward, logits for the sampling rows, sampling."""

from __future__ import annotations

import torch

from engine.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
from engine.sampler import SamplingBatch, sample
from engine.scheduler import SampledToken, SeqWork
from model.batch import ForwardBatch
from model.transformer import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.cache = PagedKVCache(KVSpec.for_model(model), num_blocks, block_size)

    def build_batch(self, work: list[SeqWork]) -> ForwardBatch:
        ids = torch.tensor([t for w in work for t in w.token_ids], dtype=torch.int64)
        pos = torch.tensor([p for w in work for p in range(w.start, w.start + len(w.token_ids))], dtype=torch.int64)
        seqs = [SeqSlots(w.block_table, w.start, len(w.token_ids)) for w in work]
        return ForwardBatch(ids, pos, [len(w.token_ids) for w in work], PagedKV(self.cache, seqs))

    @torch.no_grad()
    def execute(self, work: list[SeqWork]) -> dict[str, SampledToken] | None:
        """Collective over the layout (idle DP ranks pass ``[]`` and still enter every MoE collective).
        Returns the sampled tokens on the rank that holds the logits, None on the others."""
        batch = self.build_batch(work)
        hidden = self.model(batch)
        ends = torch.tensor(batch.query_lens, dtype=torch.int64).cumsum(0) - 1
        rows = [i for i, w in enumerate(work) if w.sample]
        logits = self.model.logits(hidden[ends[rows]] if rows else hidden[:0])
        if logits is None:
            return None
        chosen = [work[i] for i in rows]
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
            result[w.request_id] = SampledToken(tokens[i], lps[i], list(zip(top_ids[i][:n], top_lps[i][:n],
                                                                            strict=True)))
        return result
