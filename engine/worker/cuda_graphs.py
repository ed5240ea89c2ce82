"""CUDA graphs for decode and tree verify: one static step per (batch, tree size) shape, captured once, replayed.

A :class:`StaticStep` owns every input of a target forward in a preallocated buffer of fixed shape — token
ids and positions ``[B*N]``, KV write slots ``[B*N]``, block tables ``[B, max_blocks]``, context lengths
``[B]`` and, for tree verify, the ancestor mask ``[B, N, N]`` — and the forward reads nothing else:
attention goes through the paged kernels on the cache (:class:`TablesKV`, ``KVContext.tables``), the experts
through the kernel set's ``moe_experts``. With the Triton kernels selected nothing in that forward waits on
the host, so :class:`GraphRunner` can capture it per shape (decode: tree size N = 1 per batch size; verify:
the speculation's tree size per batch size) and replay it after copying a step's inputs into the buffers. A
batch smaller than its shape is padded with dummy sequences that write to, and read only from, reserved
scratch blocks. Shapes that cannot be captured run the same static step eagerly, the reason kept per shape
(:meth:`~engine.worker.capture.CapturedGraphs.status`, which the runner puts in each step's coverage record; a capture
that fails in a job of several ranks stops the job instead: :func:`engine.worker.capture.raise_if_any_rank_failed`).

Off CUDA (this CPU box) nothing is captured: the static steps run eagerly and the tests check what a replay
relies on — padding, buffer reuse across steps, equality with the dynamic forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.blocks import scratch_table, token_slots
from engine.staging import copy_in
from engine.step import StepKind
from engine.worker.capture import CapturedGraphs, token_limit_blocker
from engine.worker.kv_cache import PagedKVCache
from model.batch import ForwardBatch, PagedTables
from model.transformer import CausalLM
from parallelism.deepep import before_graph_replay


@dataclass(frozen=True)
class StepShape:
    """``batch`` sequences of a ``tree_size``-node tree each (1: a decode's one token; more: a tree verify)."""

    batch: int
    tree_size: int

    @property
    def kind(self) -> StepKind:
        return StepKind.DECODE if self.tree_size == 1 else StepKind.VERIFY


@dataclass
class SeqLayout:
    """Where one sequence's share of a static step lives in the cache (host values): the KV ``write_slots`` of
    its tree's new tokens and a ``block_table`` covering ``context_len`` keys (the new ones last)."""

    write_slots: list[int]
    block_table: list[int]
    context_len: int


@dataclass
class StaticSeq(SeqLayout):
    """A :class:`SeqLayout` with its inputs, all on the host (copied into the buffers by ``StaticStep.load``):
    ``token_ids``/``positions`` of tree-size N entries and, for verify, ``tree_mask [N, N]`` bool."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    tree_mask: torch.Tensor | None = None


class TablesKV:
    """KVContext of a static step: writes at fixed slots, attention reads the cache through ``tables``."""

    padded = False

    def __init__(self, cache: PagedKVCache, write_slots: torch.Tensor, tables: PagedTables):
        self.cache, self.write, self.tables = cache, write_slots, tables

    def store(self, layer: int, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self.cache.write(layer, self.write, entries)

    def store_and_gather(self, layer, entries):
        raise NotImplementedError("a static step reads the cache through the paged kernels (tables)")

    def mask(self, seq):
        return None


class StaticStep:
    """The buffers and the forward of one :class:`StepShape` (see the module docstring).

    ``run()`` → logits ``[B*N, V]`` on every attention-TP rank and, with ``feature_layers`` (layer ids), the
    drafter features ``[B*N, len(feature_layers)*H]``; both are buffers that the next ``run()`` overwrites."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, shape: StepShape, max_blocks: int,
                 scratch_blocks: tuple[int, ...], feature_layers: tuple[int, ...] = ()):
        self.model, self.cache, self.shape, self.feature_layers = model, cache, shape, feature_layers
        self.max_blocks, self.scratch_blocks = max_blocks, scratch_blocks
        dev = cache.device
        t = shape.batch * shape.tree_size
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.write_slots = torch.zeros(t, dtype=torch.int64, device=dev)
        n = shape.tree_size
        tree = None if n == 1 else torch.zeros(shape.batch, n, n, dtype=torch.bool, device=dev)
        tables = PagedTables(torch.zeros(shape.batch, max_blocks, dtype=torch.int32, device=dev),
                             torch.zeros(shape.batch, dtype=torch.int32, device=dev), tree, cache.kv_block_size)
        self.tables = tables
        self.batch = ForwardBatch(self.input_ids, self.positions, [n] * shape.batch,
                                  TablesKV(cache, self.write_slots, tables))

    def padding_seq(self) -> StaticSeq:
        """A dummy sequence living entirely in the scratch blocks: positions 0..N-1, context N."""
        n, bs = self.shape.tree_size, self.cache.kv_block_size
        table = scratch_table(self.scratch_blocks, n, bs)
        slots = token_slots(table, 0, n, bs)
        mask = None if n == 1 else torch.ones(n, n, dtype=torch.bool).tril()
        return StaticSeq(slots, table, n, [0] * n, list(range(n)), mask)

    def load(self, seqs: list[StaticSeq]) -> None:
        """Copies ``seqs`` (at most ``batch``; none for an idle attention-DP rank) into the buffers, padding the
        rest with :meth:`padding_seq`."""
        seqs = self.load_layout(seqs)
        if any(len(s.token_ids) != self.shape.tree_size for s in seqs):
            raise ValueError(f"a sequence's token count does not fit shape {self.shape}")
        copy_in(self.input_ids, [v for s in seqs for v in s.token_ids])  # host → buffer copies, asynchronous
        copy_in(self.positions, [v for s in seqs for v in s.positions])
        if self.tables.tree_mask is not None:
            copy_in(self.tables.tree_mask, torch.stack([s.tree_mask for s in seqs]))

    def load_layout(self, seqs: list[SeqLayout]) -> list[SeqLayout]:
        """Copies ``seqs``' write slots, block tables and context lengths (padded with :meth:`padding_seq`) into
        the buffers; returns the padded list."""
        b, n = self.shape.batch, self.shape.tree_size
        if len(seqs) > b:
            raise ValueError(f"a {b}-sequence static step got {len(seqs)} sequences")
        seqs = seqs + [self.padding_seq()] * (b - len(seqs))
        for s in seqs:
            if len(s.write_slots) != n or len(s.block_table) > self.max_blocks:
                raise ValueError(f"sequence with {len(s.write_slots)} nodes / {len(s.block_table)} blocks does not "
                                 f"fit shape {self.shape} with {self.max_blocks} blocks")
        copy_in(self.write_slots, [v for s in seqs for v in s.write_slots])
        copy_in(self.tables.block_tables, [s.block_table + [0] * (self.max_blocks - len(s.block_table)) for s in seqs])
        copy_in(self.tables.context_lens, [s.context_len for s in seqs])
        return seqs

    def load_inputs(self, token_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None) -> None:
        """Copies the step's inputs for every row, padding included — ``token_ids, positions [B*N]``, ``tree_mask
        [B, N, N]`` (verify) — into the buffers: from the host, or on the device from the static draft's
        outputs (no host round trip between draft and verify)."""
        self.input_ids.copy_(token_ids)
        self.positions.copy_(positions)
        if self.tables.tree_mask is not None:
            self.tables.tree_mask.copy_(tree_mask)

    @torch.no_grad()
    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.feature_layers:
            hidden, feats = self.model(self.batch, capture=self.feature_layers)
        else:
            hidden, feats = self.model(self.batch), None
        return self.model.logits_everywhere(hidden), feats


class GraphRunner(CapturedGraphs):
    """Static steps per shape, captured as CUDA graphs where possible (see the module docstring).

    ``run(seqs, tree_size, batch)`` picks the smallest batch size ≥ ``max(len(seqs), batch)``, captures that shape
    on its first use, loads the inputs, replays (or runs eagerly; ``status(shape)`` says why) and returns the real
    rows' logits ``[len(seqs)*N, V]`` and features."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_blocks: int, scratch_blocks: tuple[int, ...],
                 batch_sizes: tuple[int, ...] = (1, 2, 4, 8), feature_layers: tuple[int, ...] = (),
                 blocker: str = ""):
        super().__init__(blocker, model.groups.control)
        self.model, self.cache, self.max_blocks, self.scratch_blocks = model, cache, max_blocks, scratch_blocks
        self.batch_sizes, self.feature_layers = tuple(sorted(batch_sizes)), feature_layers
        self.steps: dict[StepShape, StaticStep] = {}

    def shape_for(self, batch: int, tree_size: int) -> StepShape:
        fits = [b for b in self.batch_sizes if b >= batch]
        if not fits:
            raise ValueError(f"batch {batch} exceeds the largest static batch size {self.batch_sizes[-1]}")
        return StepShape(fits[0], tree_size)

    def step(self, shape: StepShape) -> StaticStep:
        if shape not in self.steps:
            self.steps[shape] = StaticStep(self.model, self.cache, shape, self.max_blocks, self.scratch_blocks,
                                           self.feature_layers)
        return self.steps[shape]

    def capture(self, shape: StepShape) -> str:
        """Captures ``shape``'s graph; returns "" or why it runs eagerly. The buffers hold a padding-only batch
        during capture, so the warm-up and capture launches touch just the scratch block."""
        step = self.step(shape)
        return self._capture(shape, self.cache.device, lambda: step.load([step.padding_seq()]),
                             step.run, lambda: token_limit_blocker(self.model, shape.batch * shape.tree_size))

    def run(self, seqs: list[StaticSeq], tree_size: int, batch: int = 0,
            fill: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``batch`` > ``len(seqs)`` pads to that shape (attention-DP ranks run one shape; an idle rank pads
        everything). ``fill(input_ids)`` runs after the host inputs are loaded: it sets ids that are still on the
        device (overlap: tokens the previous step sampled)."""
        shape = self.shape_for(max(len(seqs), batch, 1), tree_size)
        self.capture(shape)  # first use of a shape: capture it (or learn why not) before loading inputs
        self.step(shape).load(seqs)
        if fill is not None:
            fill(self.step(shape).input_ids)
        logits, feats = self._launch(shape)
        rows = len(seqs) * tree_size
        return logits[:rows], None if feats is None else feats[:rows]

    def load_tree_layout(self, seqs: list[SeqLayout], batch: int, tree_size: int) -> StepShape:
        """First half of a tree verify fed by a static draft: captures the ``(batch, tree_size)`` shape on its first
        use and loads ``seqs`` (the first rows; the rest pad) — the cache layout, all host values. ``batch``
        must be a static batch size (the draft's)."""
        shape = self.shape_for(batch, tree_size)
        if shape.batch != batch:
            raise ValueError(f"a tree batch of {batch} is not a static batch size {self.batch_sizes}")
        self.capture(shape)
        self.step(shape).load_layout(seqs)
        return shape

    def run_tree(self, shape: StepShape, token_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Second half, on the device: the trees' ``token_ids, positions [B*N]`` and ancestor masks ``tree_mask
        [B, N, N]`` (from the static draft's outputs, padding rows included); then the replay. Returns logits
        ``[B*N, V]``, features and the write slots ``[B, N]`` (buffers the next step overwrites)."""
        step = self.step(shape)
        step.load_inputs(token_ids, positions, tree_mask)
        logits, feats = self._launch(shape)
        return logits, feats, step.write_slots.view(shape.batch, shape.tree_size)

    def _launch(self, shape: StepShape) -> tuple[torch.Tensor, torch.Tensor | None]:
        if shape in self.captured:
            before_graph_replay()  # a replay cannot run the Python that cleans DeepEP's buffers after normal steps
        return self._replay_or_run(shape, self.step(shape).run)[1]
