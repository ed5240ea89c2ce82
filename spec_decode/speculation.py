"""The engine's :class:`engine.speculation.Speculation` built from a :class:`SpecConfig`: how the runner gets
its speculator and static draft/commit graphs without engine/ importing spec_decode."""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache import PagedKVCache
from engine.speculation import Speculation
from model.transformer import CausalLM
from spec_decode.config import SpecConfig
from spec_decode.dflash import DFlashDrafter
from spec_decode.speculator import Speculator
from spec_decode.static_commit import CommitGraphs
from spec_decode.static_draft import DraftGraphs


def static_graphs(spec: Speculator, max_blocks: int, scratch_blocks: tuple[int, ...],
                  batch_sizes: tuple[int, ...]) -> tuple[DraftGraphs, CommitGraphs]:
    """``spec``'s static draft per batch size and static commit per verify shape."""
    return DraftGraphs(spec, max_blocks, scratch_blocks, batch_sizes), CommitGraphs(spec, scratch_blocks)


def speculation_from(spec: SpecConfig, build: Callable[[CausalLM, PagedKVCache], Speculator]) -> Speculation:
    """A Speculation whose speculators come from ``build(model, cache)``, shaped by ``spec``."""
    return Speculation(build=build, static_graphs=static_graphs, num_nodes=spec.num_nodes,
                       scratch_slots=spec.scratch_slots, config=spec)


def load_speculation(spec: SpecConfig, model: CausalLM) -> Speculation | None:
    """``spec``'s Speculation for ``model`` (None when speculative decoding is off): loads the DFlash drafter once,
    on ``model.device``; every runner built with it shares the drafter."""
    if not spec.enabled:
        return None
    drafter = DFlashDrafter.load(spec.drafter_path).place(model.device)
    return speculation_from(spec, lambda target, cache: Speculator(target, drafter, spec, cache))
