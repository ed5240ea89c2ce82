"""DDTree projected onto the Kimi-K2-shaped slice of ``bench.gpu.roofline`` (EP8 routing): its
plain decode step, and per tree budget B its draft step and its tree-verify step (B + 1 nodes), at batch 1 and one
context, graph-replayed where capture works.

The projection (:func:`project`) is ``τ × decode step / (draft step + verify step)``: τ, the committed tokens per
verify step, comes from the trained tiny_kimi pair (the slice has random weights, so it has no τ of its own); the
step times are the slice's. It leaves out the commit step (walk + KV compaction) and sampling, and the drafter is
a random 2-layer DFlash drafter at the slice's hidden size in fp32, as the engine loads DFlash checkpoints.
"""

from __future__ import annotations

import time

import torch

from bench.gpu.fixtures import random_model, random_seqs
from bench.gpu.harness import cuda_time_s
from bench.gpu.roofline import KIMI_SLICE, TINY_SLICE, SliceShape, install_routing
from engine.blocks import blocks_for
from engine.step import SeqWork
from engine.worker.cuda_graphs import GraphRunner, StepShape
from engine.worker.kv_cache import KVSpec, PagedKVCache
from model.kernel_select import select_kernels
from model.transformer import CausalLM
from spec_decode.config import SpecConfig
from spec_decode.decoder import SpeculativeDecoder
from spec_decode.dflash import DFlashConfig, DFlashDrafter
from spec_decode.static_draft import DraftGraphs

DRAFTER_BLOCK = 16


def project(tau: float, decode_ms: float, draft_ms: float, verify_ms: float) -> float:
    """Speedup of one DDTree step over plain decoding: ``tau`` tokens per (draft + verify) against one token per
    decode step."""
    return tau * decode_ms / (draft_ms + verify_ms)


def slice_model(device: torch.device, shape: SliceShape, dtype: torch.dtype) -> CausalLM:
    """The slice with random weights drawn on ``device``, routed as an EP8 rank sees it
    (:func:`bench.gpu.roofline.install_routing`), calling the kernels selected there."""
    model = random_model(device, dtype, **shape.overrides())
    model.use_kernels(select_kernels(device))
    install_routing(model, shape, "ep8", device, dtype)
    return model


def slice_drafter(model: CausalLM) -> DFlashDrafter:
    """A random 2-layer DFlash drafter (fp32) at ``model``'s hidden size, on its device, fed by its first and last
    layers (``bench.gpu.fixtures.random_speculator``'s sizes; drawn on the device)."""
    h = model.cfg.hidden_size
    cfg = DFlashConfig(hidden_size=h, num_layers=2, num_heads=max(1, h // 128), num_kv_heads=max(1, h // 512),
                       head_dim=min(128, h), intermediate_size=2 * h, target_layer_ids=(0, model.cfg.num_layers - 1),
                       mask_token_id=1, block_size=DRAFTER_BLOCK)
    with torch.device(model.device):  # nn.Linear's init of ~0.9 G weights takes half a minute on a host core
        drafter = DFlashDrafter(cfg).place(model.device)
    gen = torch.Generator(device=model.device).manual_seed(1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return drafter.eval().requires_grad_(False)


def _draft_work(spec: SpeculativeDecoder, context: int, first_block: int, gen: torch.Generator) -> SeqWork:
    """One request of ``context`` tokens (random drafter context) about to draft its next tree."""
    per_seq = blocks_for(context + spec.cfg.spec_reserve_slots, spec.cache.kv_block_size)
    w = SeqWork(request_id="0", token_ids=[2], start=context, sample=True, params=None, seed=0, num_generated=1,
                block_table=list(range(first_block, first_block + per_seq)), decode=True, spec=True)
    width = len(spec.feature_layers) * spec.model.cfg.hidden_size
    spec.add_context(w, torch.randn(context, width, generator=gen).to(spec.context.device), 0)
    return w


def measure(device: torch.device | str, budgets: tuple[int, ...], budget_s: float, context: int = 4096,
            shape: SliceShape | None = None) -> dict:
    """The slice's decode step, and per budget its draft and verify steps (ms, batch 1, ``context`` cached
    tokens), until ``budget_s`` has passed (the rest: ``skipped``). ``shape`` None: :data:`KIMI_SLICE` on CUDA,
    :data:`TINY_SLICE` elsewhere."""
    t0, device = time.time(), torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = shape or (KIMI_SLICE if device.type == "cuda" else TINY_SLICE)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = slice_model(device, shape, dtype)
    drafter, gen = slice_drafter(model), torch.Generator().manual_seed(0)
    bs, most = shape.block_size, max(max(budgets) + 1, DRAFTER_BLOCK)
    scratch, per_seq = tuple(range(blocks_for(most, bs))), blocks_for(context + most, bs)
    cache = PagedKVCache(KVSpec.for_model(model), len(scratch) + per_seq, bs, device=device)
    layers = tuple(drafter.c.target_layer_ids)
    plain = GraphRunner(model, cache, per_seq, scratch, (1,))
    spec_runner = GraphRunner(model, cache, per_seq, scratch, (1,), feature_layers=layers)
    seqs = random_seqs(StepShape(1, 1), context, cache, gen, model.cfg.vocab_size, len(scratch))
    decode_reason = plain.capture(StepShape(1, 1))
    decode_ms = 1e3 * cuda_time_s(lambda: plain.run(seqs, 1), device=device)
    out = dict(slice=f"KIMI_SLICE (hidden {shape.hidden}, {shape.dense_layers} dense + {shape.moe_layers} MoE layers, "
               f"EP{shape.ep} routing: {shape.experts // shape.ep} local experts)" if shape == KIMI_SLICE else
               "TINY_SLICE (CPU dry run)", dtype=str(dtype).removeprefix("torch."), batch=1, context=context,
               drafter="random 2-layer DFlash, fp32, block 16",
               decode_ms=decode_ms, decode_eager_reason=decode_reason, rows=[])
    for budget in budgets:
        if time.time() - t0 > budget_s:
            out["rows"].append(dict(budget=budget, skipped="time budget"))
            continue
        try:
            cfg = SpecConfig("ddtree", budget=budget, block_size=DRAFTER_BLOCK, drafter_path="random",
                             tree_temperature=0.33)
            spec = SpeculativeDecoder(model, drafter, cfg, cache)
            graphs = DraftGraphs(spec, per_seq, scratch, (1,))
            work = _draft_work(spec, context, len(scratch), gen)
            draft_reason = graphs.capture(1)
            tree = StepShape(1, cfg.tree_size)
            tree_seqs = random_seqs(tree, context, cache, gen, model.cfg.vocab_size, len(scratch))
            verify_reason = spec_runner.capture(tree)
            draft_s = cuda_time_s(lambda g=graphs, w=work: g.run([w]), device=device)
            verify_s = cuda_time_s(lambda s=tree_seqs, n=cfg.tree_size: spec_runner.run(s, n), device=device)
            out["rows"].append(dict(budget=budget, draft_ms=1e3 * draft_s, draft_eager_reason=draft_reason,
                                    verify_ms=1e3 * verify_s, verify_eager_reason=verify_reason))
            del spec, graphs
        except Exception as exc:  # noqa: BLE001 - recorded in the report, the next budget still runs
            out["rows"].append(dict(budget=budget, error=f"{type(exc).__name__}: {exc}"[:500]))
    return out


def run(device: torch.device | str, taus: dict[int, float], budget_s: float, context: int = 4096) -> dict:
    """:func:`measure` at the budgets of ``taus`` (budget → τ of the pair), each row with its projected speedup
    (:func:`project`); what could not be measured says so."""
    out = measure(device, tuple(sorted(taus)), budget_s, context)
    for row in out["rows"]:
        if "draft_ms" in row:
            row["tau_from_pair"] = taus[row["budget"]]
            row["projected_speedup"] = project(taus[row["budget"]], out["decode_ms"], row["draft_ms"],
                                               row["verify_ms"])
    out["rule"] = "projected speedup = τ (tiny_kimi pair, batch 1, greedy) × decode_ms / (draft_ms + verify_ms)"
    out["missing"] = "the commit step (walk + KV compaction) and sampling are not in the denominator"
    return out
