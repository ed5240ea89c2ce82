"""Speculation injected into the engine: engine/ never imports spec_decode (arrows point down), so spec_decode
builds a :class:`Speculation` (``spec_decode.speculation.load_speculation``) and the runner calls what it holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.kv_cache import PagedKVCache
from model.transformer import CausalLM


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """``build(model, cache)`` → the rank's speculator (``spec_decode.speculator.Speculator``: ``capture``,
    ``propose``, ``verify_slots``, ``accept_rows``, ``add_context``, ``verify_inputs``, ``node_sampling``,
    ``walk_and_commit``); ``static_graphs(speculator, max_blocks, scratch_blocks, batch_sizes)`` → its static
    draft and commit holders (``CapturedGraphs`` with ``load``/``launch`` and ``prepare``/``run``/``warm_up``).
    ``num_nodes``: tree size, root included (the verify shape); ``scratch_slots``: KV slots per request that one
    speculative step writes; ``config``: what it was built from, for reports only."""

    build: Callable[[CausalLM, PagedKVCache], Any]
    static_graphs: Callable[[Any, int, tuple[int, ...], tuple[int, ...]], tuple[Any, Any]]
    num_nodes: int
    scratch_slots: int
    config: Any = None
