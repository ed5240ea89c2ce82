"""Random models, drafters and inputs the GPU checks run on: no checkpoint and no transformers on the GPU box."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from bench import REPO
from engine.blocks import blocks_for, token_slots
from engine.worker.cuda_graphs import StaticSeq, StepShape
from engine.worker.kv_cache import KVSpec, PagedKVCache
from model.config import parse_config
from model.kernel_select import select_kernels
from model.transformer import CausalLM
from model.tree_mask import ancestor_mask
from parallelism.comm import build_groups
from parallelism.layout import Layout
from spec_decode.config import SpecConfig
from spec_decode.decoder import SpeculativeDecoder
from spec_decode.dflash import DFlashConfig, DFlashDrafter

# the speculative checks' cases: batch 1 at every budget the issue names, and one batched case
GPU_CHECK_CASES = [{"batch": 1, "budget": b} for b in (8, 16, 32, 64, 128, 256)] + [{"batch": 8, "budget": 16}]


def random_model(device: torch.device, dtype: torch.dtype, **overrides) -> CausalLM:
    """The committed tiny_kimi target's architecture (``overrides`` rescale it) with random weights drawn on
    ``device`` (a 10 GiB slice drawn on the host takes minutes): no checkpoint and no transformers needed on the
    GPU box."""
    raw = json.loads((REPO / "model/zoo/tiny_kimi/target/config.json").read_text())
    model = CausalLM(parse_config({**raw, **overrides}), build_groups(Layout()), dtype).place(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "e_score_correction_bias" in name:
                p.zero_()
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return model


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random n-node tree (root 0, parents before children): its ancestor mask ``[n, n]`` and depths ``[n]``."""
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    depth = torch.zeros(n, dtype=torch.int64)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return ancestor_mask(parents, n), depth


def random_seqs(shape: StepShape, ctx: int, cache: PagedKVCache, gen: torch.Generator, vocab: int, first: int
                ) -> list[StaticSeq]:
    """``shape.batch`` sequences of ``ctx`` cached keys + N new, on disjoint blocks after the ``first`` ones."""
    bs, n = cache.kv_block_size, shape.tree_size
    per_seq = blocks_for(ctx + n, bs)
    seqs = []
    for b in range(shape.batch):
        table = list(range(first + b * per_seq, first + (b + 1) * per_seq))
        slots = token_slots(table, ctx, ctx + n, bs)
        ancestors, depth = random_tree(n, gen)
        mask = None if n == 1 else ancestors
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        seqs.append(StaticSeq(slots, table, ctx + n, ids, (ctx + depth).tolist(), mask))
    return seqs


@dataclass(frozen=True, kw_only=True)
class CheckSetup:
    """What the GPU checks run on: a random bf16 model with the selected kernels, a cache with ``scratch``
    blocks (enough for a 257-node tree) and room for 8 sequences of ``context`` cached keys + 257 new ones
    (``blocks_per_seq`` blocks each, after the scratch blocks)."""

    model: CausalLM
    cache: PagedKVCache
    scratch: tuple[int, ...]
    context: int
    blocks_per_seq: int


def check_setup(device: torch.device, context: int = 1024, block_size: int = 16) -> CheckSetup:
    """The GPU checks' :class:`CheckSetup` on ``device``."""
    model = random_model(device, torch.bfloat16, hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048,
                         n_routed_experts=32, kv_lora_rank=256, q_lora_rank=512, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
    model.use_kernels(select_kernels(device))
    scratch = tuple(range(blocks_for(257, block_size)))
    per_seq = blocks_for(context + 257, block_size)
    cache = PagedKVCache(KVSpec.for_model(model), len(scratch) + 8 * per_seq, block_size, device=device)
    return CheckSetup(model=model, cache=cache, scratch=scratch, context=context, blocks_per_seq=per_seq)


def random_speculator(model, cache, budget: int, block_size: int = 16, **drafter_overrides) -> SpeculativeDecoder:
    """A DDTree SpeculativeDecoder with a random DFlash drafter sized for ``model`` (2 layers; ``drafter_overrides``
    change the config): no checkpoint needed on the GPU box."""
    h = model.cfg.hidden_size
    fields = dict(hidden_size=h, num_layers=2, num_heads=max(1, h // 128), num_kv_heads=max(1, h // 512),
                  head_dim=min(128, h), intermediate_size=2 * h, target_layer_ids=(0, model.cfg.num_layers - 1),
                  mask_token_id=1, block_size=block_size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig(**{**fields, **drafter_overrides}))
    for name, p in drafter.named_parameters():
        p.data.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)
    drafter = drafter.place(cache.device).eval().requires_grad_(False)
    cfg = SpecConfig("ddtree", budget=budget, block_size=block_size, drafter_path="random", tree_temperature=0.33)
    return SpeculativeDecoder(model, drafter, cfg, cache)
