"""Decode step vs the HBM floor on a Kimi-K2-shaped rank: graph-replayed steps, their floor, power, op classes.

``run(device, budget_s) -> dict`` builds a random bf16 per-rank slice on the device (:data:`KIMI_SLICE`: hidden
7168, MLA 64 heads, 1 dense + 2 MoE layers, the LM head of a TP8 rank), routes it as an EP8 rank sees it (top-8
of 384, 48 local experts of I 2048) and as a TP8 rank sees it (all 384 experts, each I/8), and for batch 1, 8,
32, 64 over contexts 4096 and 32768 times the graph-replayed decode step. The floor is the bytes the step must
read (:func:`bench.cost.floors.floor_bytes`, the bench verdict's arithmetic too) — every weight but the embedding
table, routed experts counted as the distinct experts the batch actually touched (counted by
:class:`model.expert_tally.ExpertTally` in an eager step of the same inputs), the KV cache of every sequence —
over the device's copy bandwidth measured in the same run. Also per row: mean NVML power while the step repeats,
and the share of device time per op class from ``torch.profiler`` on the eager static step (the kernels the graph
replays).
On CPU (the dry run of the tests) everything runs eagerly at tiny sizes, without NVML.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.cost.floors import floor_bytes
from bench.gpu.fixtures import random_model, random_seqs
from bench.gpu.harness import copy_bandwidth, cuda_time_s
from bench.gpu.power import PowerMeter
from engine.blocks import blocks_for
from engine.worker.cuda_graphs import GraphRunner, StepShape
from engine.worker.kv_cache import KVSpec, PagedKVCache
from model.expert_tally import ExpertTally
from model.kernel_select import select_kernels

ROUTINGS = ("ep8", "tp8")
OP_CLASSES = (  # first match wins: (class, substrings of a kernel or aten op name, lower case)
    ("attention", ("_mla_kernel", "_gqa_kernel", "_merge_kernel", "attention", "sdpa", "flash")),
    ("moe", ("_gate_up_kernel", "_down_kernel", "_align_kernel", "_masked", "moe", "grouped_mm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "addmm", "bmm", "aten::mm", "linear", "einsum")),
    ("norm", ("rms_norm", "norm", "rsqrt", "aten::pow", "aten::mean")),
    ("routing", ("topk", "sort", "sigmoid", "softmax")),
    ("copy/elementwise", ("copy", "elementwise", "fill", "cat", "index", "gather", "scatter", "add", "mul", "div",
                          "sum", "where", "silu", "aten::to", "reduce")),
    ("views/alloc (host only)", ("as_strided", "select", "view", "slice", "permute", "squeeze", "reshape",
                                 "expand", "empty", "arange", "transpose", "aten::t", "split", "chunk")),
)


@dataclass(frozen=True, kw_only=True)
class SliceShape:
    """One rank's slice: MLA attention (all ``heads``), ``dense_layers`` dense then ``moe_layers`` MoE layers
    (``experts`` routed, top ``top_k``, ``shared`` shared experts), and the LM head of one TP rank
    (``vocab // tp`` rows). EP routing keeps ``experts // ep`` whole experts; TP routing keeps all experts at
    ``moe_inter // tp``."""

    hidden: int = 7168
    heads: int = 64
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v: int = 128
    dense_layers: int = 1
    moe_layers: int = 2
    dense_inter: int = 18432
    moe_inter: int = 2048
    experts: int = 384
    top_k: int = 8
    shared: int = 1
    vocab: int = 163840
    ep: int = 8
    tp: int = 8
    block_size: int = 16

    def overrides(self) -> dict:
        """``random_model`` overrides of the tiny_kimi config: the EP-routed slice (local experts only)."""
        return dict(hidden_size=self.hidden, num_attention_heads=self.heads, num_key_value_heads=self.heads,
                    q_lora_rank=self.q_lora, kv_lora_rank=self.kv_lora, qk_rope_head_dim=self.rope,
                    qk_nope_head_dim=self.nope, qk_head_dim=self.nope + self.rope, v_head_dim=self.v,
                    head_dim=self.rope, num_hidden_layers=self.dense_layers + self.moe_layers,
                    first_k_dense_replace=self.dense_layers, intermediate_size=self.dense_inter,
                    moe_intermediate_size=self.moe_inter, n_routed_experts=self.experts // self.ep,
                    num_experts_per_tok=self.top_k, n_shared_experts=self.shared, n_group=1, topk_group=1,
                    vocab_size=self.vocab // self.tp, max_position_embeddings=1 << 17)


KIMI_SLICE = SliceShape()
TINY_SLICE = SliceShape(hidden=64, heads=4, q_lora=32, kv_lora=32, rope=16, nope=16, v=16, dense_inter=96,
                        moe_inter=32, experts=32, top_k=4, vocab=1024, ep=8, tp=8)


def op_class(name: str) -> str:
    """The op class of a kernel or aten op name (:data:`OP_CLASSES`), else ``other``."""
    low = name.lower()
    return next((cls for cls, keys in OP_CLASSES if any(k in low for k in keys)), "other")


def breakdown(times_us: dict[str, float]) -> dict[str, float]:
    """``{op name: self time}`` → share of the total per op class (fractions summing to 1, largest first)."""
    total = sum(times_us.values()) or 1.0
    shares: dict[str, float] = {}
    for name, t in times_us.items():
        shares[op_class(name)] = shares.get(op_class(name), 0.0) + t / total
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def markdown(rows: list[dict]) -> str:
    """The report table: one line per (routing, batch, context)."""
    lines = ["| routing | batch | context | graph | step ms | floor ms | fraction of floor | experts touched | "
             "tok/s | W | device time by op class |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['routing']} | {r['batch']} | {r['context']} | {r.get('error', r.get('skipped'))} "
                         "| | | | | | | |")
            continue
        ops = ", ".join(f"{k} {100 * v:.0f} %" for k, v in list(r["op_classes"].items())[:4])
        watts = "-" if r["power_w"] is None else f"{r['power_w']:.0f}"
        lines.append(f"| {r['routing']} | {r['batch']} | {r['context']} | {'replay' if r['captured'] else 'eager'} | "
                     f"{r['step_ms']:.3f} | {r['floor_ms']:.3f} | {r['fraction']:.2f} | "
                     f"{'/'.join(map(str, r['experts_touched']))} | {r['tok_s']:.0f} | {watts} | {ops} |")
    return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _moe_layers(model) -> list:
    from model.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def install_routing(model, shape: SliceShape, routing: str, device: torch.device, dtype: torch.dtype) -> None:
    """Routes every MoE layer as one rank sees it: a random router over all ``shape.experts``; ``ep8`` keeps the
    first ``experts // ep`` whole experts local (the rest are remote: slot −1), ``tp8`` holds every expert at
    ``moe_inter // tp`` (new random weights). World size stays 1: no collective runs."""
    from model.moe import LocalExperts, Router
    from parallelism.layout import ExpertPlacement

    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in _moe_layers(model):
        if layer.dispatcher.name != "allreduce":  # the only one whose dispatch is the slot lookup alone
            raise ValueError(f"routing emulation needs the allreduce dispatcher, got {layer.dispatcher.name!r}")
        cfg = dataclasses.replace(layer.gate.cfg, num_experts=shape.experts)
        gate = Router(shape.hidden, cfg).to(device)
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen, device=device) * shape.hidden ** -0.5)
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.zero_()
        layer.gate = gate
        if routing == "tp8":
            placement = ExpertPlacement(shape.experts, moe_ep=1, moe_tp=shape.tp)
            experts = LocalExperts(shape.hidden, cfg, placement, 0, 0, dtype).to(device)
            for p in (experts.w_gate_up, experts.w_down):
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * p.shape[-1] ** -0.5)
            layer.experts = experts
            local = torch.arange(shape.experts, device=device)
        else:
            n = layer.experts.w_gate_up.shape[0]
            local = torch.where(torch.arange(shape.experts, device=device) < n,
                                torch.arange(shape.experts, device=device), -1)
        layer.dispatcher.local_slot = local
        layer.dispatcher.log2phy = torch.arange(shape.experts, device=device)[:, None]  # slot e holds expert e
        layer.dispatcher.replica_count = torch.ones(shape.experts, dtype=torch.int64, device=device)
    model.use_kernels(model.kernels)  # the new modules get the model's kernel set


def weight_bytes(model) -> tuple[int, list[int]]:
    """(bytes of every weight but the embedding table and the routed experts, bytes of one routed expert per
    MoE layer)."""
    routed = {id(p) for m in _moe_layers(model) for p in (m.experts.w_gate_up, m.experts.w_down)}
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if "embed_tokens" not in name and id(p) not in routed)
    per_expert = [(m.experts.w_gate_up[0].numel() + m.experts.w_down[0].numel()) * m.experts.w_down.element_size()
                  for m in _moe_layers(model)]
    return dense, per_expert


def _touched(model, run: Callable[[], object]) -> list[int]:
    """Distinct local experts each MoE layer's experts receive during one eager ``run()``."""
    tally = ExpertTally(model)
    try:
        run()
    finally:
        tally.remove()
    return tally.snapshot()["experts"]


def _profile(run: Callable[[], object], device: torch.device) -> dict[str, float]:
    """Self time per op name over 3 calls: device kernels on CUDA, CPU ops otherwise."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    run()
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(3):
            run()
        _sync(device)
    times = {}
    for e in prof.key_averages():
        if cuda and e.device_type == DeviceType.CUDA:
            times[e.key] = e.self_device_time_total
        elif not cuda and e.self_cpu_time_total > 0 and e.key.startswith("aten::"):
            times[e.key] = e.self_cpu_time_total
    return times


def _watts(power: PowerMeter | None, name: str, fn: Callable[[], object]) -> float | None:
    """Mean watts (NVML energy counter) while ``fn`` repeats for ``power.seconds``; None without NVML."""
    row = None if power is None else power.measure(name, fn)
    return None if row is None else row.get("mean_w")


def _row(model, cache, runner, routing: str, batch: int, context: int, seqs, bw: float, power: PowerMeter | None,
         kv_per_token: int, device: torch.device) -> dict:
    from engine.worker.cuda_graphs import StepShape

    shape = StepShape(batch, 1)
    step = runner.step(shape)
    step.load(seqs)
    touched = _touched(model, step.run)
    breakdown_us = _profile(lambda: (step.load(seqs), step.run()), device)
    reason = runner.capture(shape)
    seconds = cuda_time_s(lambda: runner.run(seqs, 1), device=device)
    dense, per_expert = weight_bytes(model)
    need = floor_bytes({"dense": dense}, per_expert, touched, kv_per_token, [context] * batch)
    need["total"] = sum(need.values())
    floor_s = need["total"] / bw
    return dict(routing=routing, batch=batch, context=context, captured=not reason, eager_reason=reason,
                step_ms=1e3 * seconds, floor_ms=1e3 * floor_s, fraction=floor_s / seconds,
                bytes=need, experts_touched=touched,
                tok_s=batch / seconds, power_w=_watts(power, f"roofline {routing} b{batch} ctx{context}",
                                                      lambda: runner.run(seqs, 1)),
                op_classes={k: round(v, 4) for k, v in breakdown(breakdown_us).items()})


def run(device: torch.device | str, budget_s: float, shape: SliceShape | None = None,
        batches: tuple[int, ...] = (1, 8, 32, 64), contexts: tuple[int, ...] = (4096, 32768),
        routings: tuple[str, ...] = ROUTINGS) -> dict:
    """The roofline rows (see the module docstring) until ``budget_s`` has passed (the rest: ``skipped``).
    ``shape`` None: :data:`KIMI_SLICE` on CUDA, :data:`TINY_SLICE` elsewhere (the CPU dry run)."""

    t0, device = time.time(), torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = shape or (KIMI_SLICE if device.type == "cuda" else TINY_SLICE)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(device, dtype, **shape.overrides())
    model.use_kernels(select_kernels(device))
    bw, gen = copy_bandwidth(device), torch.Generator().manual_seed(0)
    power = PowerMeter(seconds=1.0, device=device.index) if device.type == "cuda" else None
    power_note = "not a CUDA device" if power is None else power.why_not or "NVML energy counter"
    spec = KVSpec.for_model(model)
    rows: list[dict] = []
    try:
        for routing in routings:
            install_routing(model, shape, routing, device, dtype)
            for context in contexts:
                per_seq = blocks_for(context + 1, shape.block_size)
                scratch = (0,)
                cache = PagedKVCache(spec, len(scratch) + max(batches) * per_seq, shape.block_size, device=device)
                runner = GraphRunner(model, cache, max_blocks=per_seq, scratch_blocks=scratch,
                                     batch_sizes=tuple(sorted(batches)))
                for batch in batches:
                    case = dict(routing=routing, batch=batch, context=context)
                    if time.time() - t0 > budget_s:
                        rows.append({**case, "skipped": "time budget"})
                        continue
                    try:
                        seqs = random_seqs(StepShape(batch, 1), context, cache, gen, model.cfg.vocab_size, len(scratch))
                        rows.append(_row(model, cache, runner, routing, batch, context, seqs, bw, power,
                                         spec.bytes_per_token(), device))
                    except Exception as exc:  # noqa: BLE001 - recorded in the report, the next row still runs
                        rows.append({**case, "error": f"{type(exc).__name__}: {exc}"[:500]})
                del runner, cache
    finally:
        if power is not None:
            power.summary()  # closes the backend (nvmlShutdown)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    return dict(model=dataclasses.asdict(shape), dtype=str(dtype), weights_gib=round(weights_gib, 2),
                kernels=model.kernels.reasons, copy_gb_s=bw / 1e9, power=power_note,
                floor_rule="bytes to read (bench.cost.floors.floor_bytes: weights but the embedding table; routed "
                           "experts = distinct experts the batch touched; KV of every sequence incl. this step's "
                           "token) / copy bandwidth (read + write) of this run",
                rows=rows, table=markdown(rows))
