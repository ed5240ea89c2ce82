"""The commit of a static tree verify — walk, KV compaction, drafter context — over buffers of fixed shape, so
that a CUDA graph can capture it per verify shape.

:meth:`spec_decode.speculator.Speculator.commit_paths` launches a copy per KV store per layer (4 per layer
for MLA's latent + rope or GQA's K + V: ~250 launches on a 61-layer model) on top of the walk; captured, that
is one replay. Sampling stays eager in front of it (a few launches whatever the depth, and its shape depends
on the batch's sampling settings). A :class:`StaticCommit` holds copies of its inputs — the tree, the
picks, the verify's features, write slots and start positions — for every row of the padded batch; rows past
the real requests are the static draft's padding, whose slots lie in the scratch blocks. Capture runs on a
padding-only state (every row in the scratch blocks), so warm-up launches touch nothing else.
"""

from __future__ import annotations

import torch

from engine.capture import CapturedGraphs, GraphCoverage
from spec_decode.speculator import Speculator
from spec_decode.tree import FIELDS, DraftTree


class StaticCommit:
    """The buffers and the commit of one verify shape: ``batch`` trees of ``nodes`` nodes.

    ``run()`` → ``path [B, L]`` and ``count [B]`` (:meth:`Speculator.commit_paths`), buffers the next run
    overwrites."""

    def __init__(self, spec: Speculator, batch: int, nodes: int, scratch_blocks: tuple[int, ...]):
        self.spec = spec
        dev = spec.cache.device
        width = len(spec.capture) * spec.model.cfg.hidden_size
        self.tree = DraftTree(*(torch.zeros(batch, nodes, dtype=torch.int64, device=dev) for _ in range(3)),
                              torch.zeros(batch, nodes, dtype=torch.bool, device=dev),
                              torch.zeros(batch, nodes, nodes, dtype=torch.bool, device=dev))
        self.picks = torch.zeros(batch, nodes, dtype=torch.int64, device=dev)
        self.feats = torch.zeros(batch * nodes, width, dtype=spec.model.dtype, device=dev)
        self.slots = torch.zeros(batch, nodes, dtype=torch.int64, device=dev)
        self.start = torch.zeros(batch, dtype=torch.int64, device=dev)
        need = -(-nodes // spec.cache.block_size)
        if need > len(scratch_blocks):
            raise ValueError(f"{nodes} nodes need {need} scratch blocks, {len(scratch_blocks)} reserved")
        self.padding_slots = spec.cache.slot_tensor(list(scratch_blocks), 0, nodes)

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
    """Static commits per verify shape ``(batch, nodes)``, captured as CUDA graphs where possible, with coverage
    under the "commit" kind. :meth:`prepare` (host half of a step: the capture) then :meth:`run` (device half,
    a ``commit`` for ``Speculator.walk_and_commit``)."""

    def __init__(self, spec: Speculator, scratch_blocks: tuple[int, ...], coverage: GraphCoverage | None = None):
        super().__init__(control=spec.model.groups.control)
        self.spec, self.scratch_blocks = spec, scratch_blocks
        self.coverage = coverage or GraphCoverage()
        self.commits: dict[tuple[int, int], StaticCommit] = {}

    def commit(self, batch: int, nodes: int) -> StaticCommit:
        if (batch, nodes) not in self.commits:
            self.commits[batch, nodes] = StaticCommit(self.spec, batch, nodes, self.scratch_blocks)
        return self.commits[batch, nodes]

    def prepare(self, batch: int, nodes: int) -> str:
        """Captures the ``(batch, nodes)`` commit on its first use; returns "" or why it runs eagerly."""
        commit = self.commit(batch, nodes)
        return self._capture((batch, nodes), commit.slots.device, commit.load_padding, commit.run)

    def warm_up(self, batch: int, nodes: int) -> None:
        """Captures the ``(batch, nodes)`` commit (CUDA), or runs it once eagerly, on a padding-only state;
        records no coverage (``ModelRunner.warm_up``)."""
        if self.prepare(batch, nodes):
            commit = self.commit(batch, nodes)
            commit.load_padding()
            commit.run()

    def run(self, tree: DraftTree, picks: torch.Tensor, feats: torch.Tensor, slots: torch.Tensor,
            start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`StaticCommit.load` then the replay (or the eager run) → ``path [B, L]``, ``count [B]``."""
        key = tuple(tree.tokens.shape)
        commit = self.commit(*key)
        commit.load(tree, picks, feats, slots, start)
        _, outputs = self._replay_or_run(key, commit.run)
        self.coverage.record("commit", *self.status(key))
        return outputs
