"""The commit of a static tree verify — walk, KV compaction, drafter context — over buffers of fixed shape, so
that a CUDA graph can capture it per verify shape.

:meth:`spec_decode.decoder.SpeculativeDecoder.commit_paths` launches a copy per KV store per layer (4 per layer
for MLA's latent + rope or GQA's K + V: ~250 launches on a 61-layer model) on top of the walk; captured, that
is one replay. Sampling stays eager in front of it (a few launches whatever the depth, and its shape depends
on the batch's sampling settings). A :class:`StaticCommit` holds copies of its inputs — the tree, the
picks, the verify's features, write slots and start positions — for every row of the padded batch; rows past
the real requests are the static draft's padding, whose slots lie in the scratch blocks. Capture runs on a
padding-only state (every row in the scratch blocks), so warm-up launches touch nothing else.
"""

from __future__ import annotations

import torch

from engine.blocks import scratch_table
from engine.worker.capture import CapturedGraphs
from spec_decode.decoder import SpeculativeDecoder
from spec_decode.tree import FIELDS, DraftTree


class StaticCommit:
    """The buffers and the commit of one verify shape: ``batch`` trees of ``tree_size`` nodes.

    ``run()`` → ``path [B, L]`` and ``count [B]`` (:meth:`SpeculativeDecoder.commit_paths`), buffers the next run
    overwrites."""

    def __init__(self, spec: SpeculativeDecoder, batch: int, tree_size: int, scratch_blocks: tuple[int, ...]):
        self.spec = spec
        dev, n = spec.cache.device, tree_size
        width = len(spec.feature_layers) * spec.model.cfg.hidden_size
        self.tree = DraftTree(*(torch.zeros(batch, n, dtype=torch.int64, device=dev) for _ in range(3)),
                              torch.zeros(batch, n, dtype=torch.bool, device=dev),
                              torch.zeros(batch, n, n, dtype=torch.bool, device=dev))
        self.picks = torch.zeros(batch, n, dtype=torch.int64, device=dev)
        self.feats = torch.zeros(batch * n, width, dtype=spec.model.dtype, device=dev)
        self.slots = torch.zeros(batch, n, dtype=torch.int64, device=dev)
        self.start = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.padding_slots = spec.cache.slot_tensor(scratch_table(scratch_blocks, n, spec.cache.kv_block_size), 0, n)

    def load_padding(self) -> None:
        """Every row in the scratch blocks at position 0 (the state a capture runs on)."""
        self.slots.copy_(self.padding_slots.expand_as(self.slots))
        self.start.zero_()

    def load(self, tree: DraftTree, picks: torch.Tensor, feats: torch.Tensor, slots: torch.Tensor,
             start: torch.Tensor) -> None:
        """Device copies of a verified batch: ``tree`` ``[B, N]``, ``feats [B*N, k*H]``, ``slots [B, N]``,
        ``start [B]`` for every row, and ``picks [J, N]`` for the first J (the real requests; the padding rows'
        picks are whatever the buffer holds: they commit into the scratch blocks)."""
        for f in FIELDS:
            getattr(self.tree, f).copy_(getattr(tree, f))
        self.picks[:picks.shape[0]].copy_(picks)
        self.feats.copy_(feats)
        self.slots.copy_(slots)
        self.start.copy_(start)

    @torch.no_grad()
    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spec.commit_paths(self.tree, self.picks, self.feats, self.slots, self.start)


class CommitGraphs(CapturedGraphs):
    """Static commits per verify shape ``(batch, tree_size)``, captured as CUDA graphs where possible
    (``status(key)``: the coverage record under the COMMIT kind). :meth:`prepare` (host half of a step: the capture)
    then :meth:`run` (device half: the commit of a static step's sampled trees, ``spec_decode.speculation``)."""

    def __init__(self, spec: SpeculativeDecoder, scratch_blocks: tuple[int, ...]):
        super().__init__(control=spec.model.groups.control)
        self.spec, self.scratch_blocks = spec, scratch_blocks
        self.commits: dict[tuple[int, int], StaticCommit] = {}

    def commit(self, batch: int, tree_size: int) -> StaticCommit:
        if (batch, tree_size) not in self.commits:
            self.commits[batch, tree_size] = StaticCommit(self.spec, batch, tree_size, self.scratch_blocks)
        return self.commits[batch, tree_size]

    def prepare(self, batch: int, tree_size: int) -> str:
        """Captures the ``(batch, tree_size)`` commit on its first use; returns "" or why it runs eagerly."""
        commit = self.commit(batch, tree_size)
        return self._capture((batch, tree_size), commit.slots.device, commit.load_padding, commit.run)

    def warm_up(self, batch: int, tree_size: int) -> None:
        """Captures the ``(batch, tree_size)`` commit (CUDA), or runs it once eagerly, on a padding-only state
        (``ModelRunner.warm_up``)."""
        if self.prepare(batch, tree_size):
            commit = self.commit(batch, tree_size)
            commit.load_padding()
            commit.run()

    def run(self, tree: DraftTree, picks: torch.Tensor, feats: torch.Tensor, slots: torch.Tensor,
            start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`StaticCommit.load` then the replay (or the eager run) → ``path [B, L]``, ``count [B]``."""
        key = (tree.tokens.shape[0], tree.tree_size)
        commit = self.commit(*key)
        commit.load(tree, picks, feats, slots, start)
        return self._replay_or_run(key, commit.run)[1]
