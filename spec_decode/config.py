"""Speculative decoding settings (hydra group ``spec_decode/``: none, dflash, ddtree)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "dflash", "ddtree")
DRAFT_HEAD_DTYPES = ("auto", "target", "bfloat16")


class SpecConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SpecConfig:
    """The ``spec_decode`` keys as users type them (``docs/GLOSSARY.md``: internally ``block_size`` is the draft
    block size, the tree has ``tree_size`` nodes). ``dflash``: chain of the drafter's argmax at each of
    ``block_size - 1`` depths. ``ddtree``: the ``budget`` most probable prefixes over those depths.
    ``drafter_path``: a z-lab-layout DFlash checkpoint.
    ``tree_temperature``: DDTree ranks prefixes by the drafter's log-probs divided by it (below 1 sharpens them,
    so the tree goes deeper and narrower); it only chooses which candidates are verified, never what is
    accepted, so any value is lossless. ``draft_head_dtype``: the precision of the LM-head matmul over the
    drafter's rows — ``target`` (the target's weight as is), ``bfloat16`` (a bf16 copy when the target is
    wider), ``auto`` (bf16 where the device multiplies bf16 natively: CUDA, or a CPU with AVX512-BF16 / AMX);
    drafting only, so lossless either way. ``prune_drafts``: a constrained request's tree holds only tokens its
    grammar allows (each node's children are the drafter's best allowed tokens); off, the tree is the plain one
    and the grammar only masks the verify (lossless either way; the bench compares the two). ``coupled``: a sampled
    request's drafts are ranked with its own temperature, filters and logits processors plus the sampler's noise
    for the output index each depth proposes, so a drafter that agrees with the target proposes the target's
    draw (off: the drafter's most probable tokens whatever the temperature; lossless either way;
    ``docs/sampling.md``). ``coupled_tree_temperature``: what ``tree_temperature`` is for greedy rows, for a
    coupled tree (prefixes ranked by ``log_softmax(coupled scores × T / it)``). ``adaptive``: rank 0 runs a plain
    decode step instead of a speculative one where its measured acceptance does not pay for a verify step's measured
    cost at that batch size, and tries again now and then (``engine.core.spec_policy``; lossless either way)."""

    method: str = "none"
    budget: int = 16
    block_size: int = 16
    drafter_path: str | None = None
    tree_temperature: float = 1.0
    draft_head_dtype: str = "auto"
    prune_drafts: bool = True
    coupled: bool = True
    coupled_tree_temperature: float = 1.0
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecConfigError(f"spec_decode.method must be one of {METHODS}, got {self.method!r}")
        if self.block_size < 2:
            raise SpecConfigError(f"spec_decode.block_size must be >= 2, got {self.block_size}")
        if self.budget < 1:
            raise SpecConfigError(f"spec_decode.budget must be >= 1, got {self.budget}")
        if not self.tree_temperature > 0:
            raise SpecConfigError(f"spec_decode.tree_temperature must be > 0, got {self.tree_temperature}")
        if not self.coupled_tree_temperature > 0:
            raise SpecConfigError(f"spec_decode.coupled_tree_temperature must be > 0, got "
                                  f"{self.coupled_tree_temperature}")
        if self.draft_head_dtype not in DRAFT_HEAD_DTYPES:
            raise SpecConfigError(f"spec_decode.draft_head_dtype must be one of {DRAFT_HEAD_DTYPES}, "
                                  f"got {self.draft_head_dtype!r}")
        if self.enabled and not self.drafter_path:
            raise SpecConfigError(f"spec_decode={self.method} needs spec_decode.drafter_path (a DFlash checkpoint)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def depth(self) -> int:
        return self.block_size - 1

    @property
    def draft_rows(self) -> int:
        """Block rows whose draft distribution is used: every depth for the chain; for a ``budget``-node tree
        at most ``budget`` (a node at depth d needs its d - 1 ancestors in the tree too)."""
        return self.depth if self.method == "dflash" else min(self.depth, self.budget)

    @property
    def coupled_candidates(self) -> int:
        """Tokens per drafter row among which coupled drafting looks for the filters' cut (top-k, top-p; past them
        every token counts as kept): four times the tokens a depth of the tree can hold, at least 64."""
        return max(64, 4 * (1 if self.method == "dflash" else self.budget))

    @property
    def tree_size(self) -> int:
        """Nodes per tree, root included: ``budget + 1`` for DDTree, ``block_size`` for the DFlash chain."""
        return 1 + (self.depth if self.method == "dflash" else self.budget)

    @property
    def spec_reserve_slots(self) -> int:
        """KV slots from a request's next position on that one speculative step writes: the tree's nodes (target
        KV) and the drafter's block (static drafting stores the block's drafter K/V at its own positions)."""
        return max(self.tree_size, self.block_size)
