"""Sampling rows from host lists, for tests of the pure sampling functions (the engine gathers its rows from the
ranks' sampling state instead: ``engine.sampling.logits_processors.SamplingState``)."""

from __future__ import annotations

import dataclasses

import torch

from engine.params import SamplingParams
from engine.sampling.sampler import SamplingBatch, host_flags, top_k_of


def sampling_batch(params: list[SamplingParams], seeds: list[int], num_generated: list[int]) -> SamplingBatch:
    """Rows of ``params`` with effective ``seeds`` and output indices ``num_generated`` (equal lengths)."""
    if not len(seeds) == len(num_generated) == len(params):
        raise ValueError(f"params, seeds, num_generated must have equal lengths, got {len(params)}, {len(seeds)}, "
                         f"{len(num_generated)}")
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    bits = [s & ((1 << 64) - 1) for s in seeds]
    wrapped = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # a seed's 64 bits as the sampler's int64
    return SamplingBatch(temperature=f32([p.temperature for p in params]), top_k=i64([top_k_of(p) for p in params]),
                         top_p=f32([p.top_p for p in params]), min_p=f32([p.min_p for p in params]),
                         seed=i64(wrapped), num_generated=i64(num_generated), **host_flags(params))


def advanced(batch: SamplingBatch, by: torch.Tensor) -> SamplingBatch:
    """``batch``'s rows ``by [B]`` output tokens later (tree nodes at those depths)."""
    return dataclasses.replace(batch, num_generated=batch.num_generated + by)
