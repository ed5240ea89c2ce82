"""The bytes one decode step must read: the one floor arithmetic of the bench's verdict (``bench.cost.formulas.
step_bytes``, from a model's dimensions) and of the GPU roofline (``bench/gpu/roofline.py``, from a built model's
parameters). Divided by the memory (or measured copy) bandwidth it is the step's memory floor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def floor_bytes(dense: Mapping[str, float], expert_bytes: Sequence[float], touched: Sequence[float],
                kv_bytes_per_token: float, contexts: Sequence[int], new_tokens: int = 1) -> dict[str, float]:
    """Bytes read by part: the ``dense`` parts as given (every weight read once: all but the embedding table and
    the routed experts), ``routed_experts`` — per MoE layer ``touched[l]`` distinct experts of
    ``expert_bytes[l]`` each — and ``kv_cache``: ``kv_bytes_per_token`` (all layers) × (context + ``new_tokens``)
    of each sequence, this step's tokens included. The step's floor is the sum of the parts."""
    experts = sum(n * b for n, b in zip(touched, expert_bytes, strict=True))
    kv = kv_bytes_per_token * sum(c + new_tokens for c in contexts)
    return {**dense, "routed_experts": experts, "kv_cache": kv}
