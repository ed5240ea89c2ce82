"""Static drafting: the drafter step at a fixed (batch, block) shape over preallocated buffers, so that a
CUDA graph can capture it (``engine/worker/cuda_graphs.py`` does the same for the target's decode and verify steps).

A :class:`StaticDraft` holds every input of one draft step — each sequence's bonus token, next position,
block table, context length and the slots of its block's positions — in buffers of fixed shape ``[B, ...]``,
and its forward reads nothing else: the block's drafter K/V are written into the paged drafter context
(``SpeculativeDecoder.context``) at the block's own positions, and each layer attends through the kernel set's
``tree_verify_gqa`` over the request's block table with an all-ones block mask (non-causal inside the
block, every context key visible). Those slots lie in the request's reserved KV (``SpecConfig.spec_reserve_slots``)
and are rewritten with the accepted tokens' context before any later step reads them. The tree is built by
the vectorised :func:`spec_decode.tree.build_tree` (no host synchronisation). Batches smaller than the shape
are padded with dummy sequences in the runner's scratch blocks.

Off CUDA nothing is captured: the step runs eagerly and the tests check it against the dynamic
``SpeculativeDecoder.draft``.
"""

from __future__ import annotations

import torch

from engine.blocks import scratch_table
from engine.sampling.logits_processors import draft_output_index
from engine.sampling.sampler import SamplingBatch, _int64, coupled_scores, top_k_of
from engine.step import SeqWork
from engine.worker.capture import CapturedGraphs, capturable, kernel_blocker
from spec_decode.decoder import SpeculativeDecoder, draft_scores
from spec_decode.dflash import Attend
from spec_decode.tree import FIELDS, DraftTree, build_chain, build_tree


class StaticDraft:
    """The buffers and the forward of one draft batch size (see the module docstring).

    ``run()`` → ``(logits [B, D', V], tokens, parents, depth [B, n] int64, valid [B, n] bool, ancestors
    [B, n, n] bool)`` with ``n`` = ``SpecConfig.tree_size``; buffers that the next ``run()`` overwrites."""

    def __init__(self, spec: SpeculativeDecoder, batch: int, max_blocks: int, scratch_blocks: tuple[int, ...]):
        self.spec, self.batch, self.max_blocks, self.scratch_blocks = spec, batch, max_blocks, scratch_blocks
        self.rows = spec.cfg.depth + 1  # [bonus, MASK × depth]
        dev = spec.context.device
        b, n = batch, self.rows
        self.bonus = torch.zeros(b, dtype=torch.int64, device=dev)
        self.start = torch.zeros(b, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.block_slots = torch.zeros(b * n, dtype=torch.int64, device=dev)
        self.block_mask = torch.ones(b, n, n, dtype=torch.bool, device=dev)
        self.offsets = torch.arange(n, device=dev)
        # coupled drafting: each row's sampling settings (temperature 0: greedy, padding too)
        self.settings = {name: torch.zeros(b, dtype=dtype, device=dev) for name, dtype in (
            ("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32),
            ("min_p", torch.float32), ("seed", torch.int64), ("num_generated", torch.int64))}
        # a captured graph fixes what runs: it computes the coupled scores whatever the batch; eagerly, only for a
        # batch with a sampled row
        self.fixed = capturable(dev)
        self.couple = spec.cfg.coupled and self.fixed

    def padding_seq(self) -> SeqWork:
        """A dummy request in the scratch blocks: position 0, no context."""
        table = scratch_table(self.scratch_blocks, self.rows, self.spec.cache.kv_block_size)
        return SeqWork(request_id="", token_ids=[0], start=0, block_table=table,
                       sample=False, params=None, seed=0, num_generated=0, decode=True, spec=True)

    def load(self, work: list[SeqWork]) -> None:
        """Copies ``work`` (at most ``batch`` speculative items) into the buffers, padding the rest."""
        if len(work) > self.batch:
            raise ValueError(f"a {self.batch}-sequence static draft got {len(work)} sequences")
        seqs = work + [self.padding_seq()] * (self.batch - len(work))
        n, cache = self.rows, self.spec.cache
        tables = torch.zeros(self.batch, self.max_blocks, dtype=torch.int32)
        slots = []
        for i, w in enumerate(seqs):
            if len(w.block_table) > self.max_blocks:
                raise ValueError(f"request {w.request_id!r} has {len(w.block_table)} blocks, the static draft "
                                 f"holds {self.max_blocks}")
            tables[i, :len(w.block_table)] = torch.tensor(w.block_table, dtype=torch.int32)
            slots += cache.slots(w.block_table, w.start, w.start + n)
        self.bonus.copy_(torch.tensor([w.token_ids[0] for w in seqs]))  # host → buffer copies
        self.start.copy_(torch.tensor([w.start for w in seqs]))
        self.block_tables.copy_(tables)
        self.context_lens.copy_(torch.tensor([w.start + n for w in seqs], dtype=torch.int32))
        self.block_slots.copy_(torch.tensor(slots))
        if self.spec.cfg.coupled and not self.fixed:
            self.couple = any(w.params is not None and w.params.temperature > 0 for w in work)
        if self.couple:
            real = [w.params is not None for w in seqs]
            values = {"temperature": [w.params.temperature if r else 0.0 for w, r in zip(seqs, real, strict=True)],
                      "top_k": [top_k_of(w.params) if r else 0 for w, r in zip(seqs, real, strict=True)],
                      "top_p": [w.params.top_p if r else 1.0 for w, r in zip(seqs, real, strict=True)],
                      "min_p": [w.params.min_p if r else 0.0 for w, r in zip(seqs, real, strict=True)],
                      "seed": [_int64(w.seed) for w in seqs], "num_generated": [w.num_generated for w in seqs]}
            for name, v in values.items():
                self.settings[name].copy_(torch.tensor(v, dtype=self.settings[name].dtype))

    def _paged_attend(self, layer: int) -> Attend:
        """Layer ``layer``'s attention: store the block's K/V at its slots, then read context + block through
        the block tables (``[B*N, h, d]`` rows in, the same out)."""
        spec, b, n = self.spec, self.batch, self.rows
        c = spec.drafter.c
        k_store, v_store = spec.context.layers[layer]

        def attend(q, bk, bv):
            spec.context.write(layer, self.block_slots, (bk, bv))
            out = spec.model.kernels.tree_verify_gqa(
                q.view(b, n, c.num_heads, c.head_dim), k_store, v_store, self.block_tables, self.context_lens,
                spec.cache.kv_block_size, c.head_dim ** -0.5, tree_mask=self.block_mask)
            return out.reshape(b * n, c.num_heads, c.head_dim).to(q.dtype)
        return attend

    @torch.no_grad()
    def run(self) -> tuple[torch.Tensor, ...]:
        spec, b, n = self.spec, self.batch, self.rows
        cfg, c = spec.cfg, spec.drafter.c
        ids = torch.where(self.offsets[None, :] == 0, self.bonus[:, None], c.mask_token_id)  # [B, N]
        emb = spec.model.embed(ids.reshape(-1)).float()  # [B*N, H]
        pos = (self.start[:, None] + self.offsets[None, :]).reshape(-1)
        attends = [self._paged_attend(i) for i in range(c.num_layers)]
        hidden = spec.drafter.run_blocks(emb, pos, attends, spec.model.kernels).view(b, n, -1)[:, 1:1 + cfg.draft_rows]
        logits = spec.head_logits(hidden.reshape(-1, hidden.shape[-1])).view(b, cfg.draft_rows, -1)  # [B, D', V]
        chain = cfg.method == "dflash"
        logq = draft_scores(logits, self.coupled(logits) if self.couple else None, cfg)
        if chain:
            trees = build_chain(logq, self.bonus)
        else:  # one build for the whole batch
            trees = build_tree(logq, self.bonus, cfg.budget)
        return (logits, *(getattr(trees, f) for f in FIELDS))

    def coupled(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`engine.sampling.logits_processors.TreeSampling.couple` from the loaded settings, on the device:
        ``logits [B, D', V]`` → ``(scores, temperature [B])``. No logits processors here (docs/sampling.md)."""
        b, d, vocab = logits.shape
        s = {name: t[:, None].expand(b, d).reshape(-1) for name, t in self.settings.items()}  # [B*D'] each
        index = draft_output_index(self.settings["num_generated"], d).reshape(-1)
        sb = SamplingBatch(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], min_p=s["min_p"],
                           seed=s["seed"], num_generated=index, num_logprobs=0, needs_sort=True, all_greedy=False)
        scores = coupled_scores(logits.reshape(b * d, vocab), sb, self.spec.cfg.coupled_candidates).view(b, d, vocab)
        temperature = self.settings["temperature"]
        return torch.where(temperature[:, None, None] > 0, scores, logits), temperature


class DraftGraphs(CapturedGraphs):
    """Static drafts per batch size, captured as CUDA graphs where possible; ``run(work, batch)`` → the batch's
    trees on the device (``status(batch)``: its coverage record under the DRAFT kind)."""

    def __init__(self, spec: SpeculativeDecoder, max_blocks: int, scratch_blocks: tuple[int, ...],
                 batch_sizes: tuple[int, ...]):
        # the drafter attends through the target's kernel set
        super().__init__(kernel_blocker(spec.model), spec.model.groups.control)
        self.spec, self.max_blocks, self.scratch_blocks = spec, max_blocks, scratch_blocks
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.drafts: dict[int, StaticDraft] = {}

    def draft(self, batch: int) -> StaticDraft:
        if batch not in self.drafts:
            self.drafts[batch] = StaticDraft(self.spec, batch, self.max_blocks, self.scratch_blocks)
        return self.drafts[batch]

    def capture(self, batch: int) -> str:
        """Captures the ``batch`` draft on a padding-only batch; returns "" or why it runs eagerly."""
        draft = self.draft(batch)
        return self._capture(batch, draft.bonus.device, lambda: draft.load([]), draft.run)

    def load(self, work: list[SeqWork], batch: int = 0) -> int:
        """Loads ``work`` (padded to the smallest batch size ≥ ``max(len(work), batch)``; none: an idle rank's
        all-padding draft), capturing that size on its first use; returns the size."""
        fits = [b for b in self.batch_sizes if b >= max(len(work), batch, 1)]
        if not fits:
            raise ValueError(f"{max(len(work), batch)} requests for static draft sizes {self.batch_sizes}")
        self.capture(fits[0])
        self.draft(fits[0]).load(work)
        return fits[0]

    def launch(self, batch: int) -> tuple[DraftTree, torch.Tensor]:
        """Replays (or runs) the loaded ``batch`` draft → its trees ``[B, N]`` and first tree positions ``start
        [B]``, on the device in buffers the next launch overwrites: the step's tree verify reads them there
        (``GraphRunner.run_tree``)."""
        _, (_, *fields) = self._replay_or_run(batch, self.draft(batch).run)
        return DraftTree(*fields), self.draft(batch).start

    def run(self, work: list[SeqWork], batch: int = 0) -> tuple[DraftTree, torch.Tensor]:
        """:meth:`load` then :meth:`launch`."""
        return self.launch(self.load(work, batch))
