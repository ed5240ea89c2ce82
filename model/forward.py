"""Full causal forward of whole sequences under any layout, logits collected on world rank 0."""

from __future__ import annotations

import torch

from model.batch import ForwardBatch
from model.transformer import CausalLM


def dp_shard(num_items: int, dp_rank: int, dp_size: int) -> list[int]:
    """Indices of the items DP rank ``dp_rank`` owns (round robin: item i → rank i % dp_size)."""
    return list(range(dp_rank, num_items, dp_size))


def full_logits(model: CausalLM, seqs: list[list[int]]) -> list[torch.Tensor] | None:
    """Collective over all ranks. Sequences are spread over attention-DP ranks (ranks with none still
    enter every MoE collective with zero tokens). Returns ``[len_i, vocab]`` float32 per sequence on
    world rank 0, None elsewhere."""
    groups = model.groups
    c = groups.coords
    mine = dp_shard(len(seqs), c.attn_dp_rank, groups.layout.attn_dp)
    batch = ForwardBatch.from_sequences([seqs[i] for i in mine])
    logits = model.logits(model(batch))
    local = {}
    if logits is not None:
        for i, part in zip(mine, logits.split(batch.query_lens), strict=True):
            local[i] = part.float().contiguous()
    parts = groups.world.gather_objects(local)
    if parts is None:
        return None
    merged = {i: t for part in parts for i, t in part.items()}
    return [merged[i] for i in range(len(seqs))]
