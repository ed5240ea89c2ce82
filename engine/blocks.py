"""Block arithmetic of the paged KV cache, written once: blocks for a token count, token positions → cache slots,
and the table of a padding sequence in the scratch blocks. The scheduler, the runner's static steps and
spec_decode's static draft and commit use these (and a KV-cache manager can adopt them)."""

from __future__ import annotations

import torch

from model.batch import paged_slots


def blocks_for(tokens: int, kv_block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens (ceil division)."""
    return -(-tokens // kv_block_size)


def token_slot_tensor(block_table: list[int], start: int, end: int, kv_block_size: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Cache slots of token positions ``[start, end)`` of a sequence (:func:`model.batch.paged_slots`), int64
    ``[end - start]`` on ``device``, computed there (long contexts: no per-token host loop)."""
    table = torch.tensor(block_table[:blocks_for(end, kv_block_size)], dtype=torch.int64, device=device)
    return paged_slots(table, torch.arange(start, end, device=device), kv_block_size)


def token_slots(block_table: list[int], start: int, end: int, kv_block_size: int) -> list[int]:
    """:func:`token_slot_tensor` as host ints (step planning)."""
    return token_slot_tensor(block_table, start, end, kv_block_size).tolist()


def scratch_table(scratch_blocks: tuple[int, ...], tokens: int, kv_block_size: int) -> list[int]:
    """The block table of a padding sequence of ``tokens`` positions (0 ..) living only in ``scratch_blocks``:
    static steps pad their batches with such sequences, which write and read nothing else. Raises ValueError
    when the scratch blocks are too few."""
    need = blocks_for(tokens, kv_block_size)
    if need > len(scratch_blocks):
        raise ValueError(f"{tokens} padding tokens need {need} scratch blocks of {kv_block_size} slots, "
                         f"{len(scratch_blocks)} reserved")
    return list(scratch_blocks[:need])
