"""The kernel sections of the GPU check: environment, kernel selection, AOT compile (CPU), each Triton kernel
against its torch reference, and (GPU) fused-MoE timings and achieved bandwidth against a device copy.

Off CUDA the kernels run under ``TRITON_INTERPRET=1``, which must be set before any kernel module is imported
(``scripts/gpu_check.py`` sets it before importing this module).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import REPO
from bench.gpu.harness import copy_bandwidth, cuda_time_s, matmul_peak
from bench.gpu.power import PowerMeter
from model import kernels
from model.kernel_select import select_kernels
from model.triton import attention, cases, moe, norm
from parallelism.dispatch import ExpertInput

CUDA = torch.cuda.is_available()
NO_GPU = "skipped: no CUDA device on this machine (torch.cuda.is_available() is False)"


def environment() -> dict:
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, cuda_available=CUDA,
                triton_interpret=os.environ.get("TRITON_INTERPRET", ""), git=_git_head())
    if CUDA:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def _git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def kernel_selection() -> dict:
    return select_kernels("cuda" if CUDA else "cpu").reasons


def aot_compile(mode: str) -> list[dict] | str:
    """``python -m model.triton.aot`` for sm_90 and sm_100 in a process without the interpreter switch."""
    if CUDA:
        return "skipped on a GPU: the kernels compile for this device at their first launch in correctness"
    if mode == "none":
        return "skipped: --aot none"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "model.triton.aot", "--arch", "90", "100", *(["--core"] if mode == "core" else [])]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode:
        rows.append(dict(kernel="model.triton.aot", ok=False, error=done.stderr[-2000:]))
    return [{k: r.get(k) for k in ("kernel", "arch", "ok", "shared_bytes", "seconds", "error")} for r in rows]



@dataclass(frozen=True)
class Check:
    """A kernel, its reference, and ``case(generator, dtype, device)`` → the keyword arguments of both."""

    name: str
    kernel: Callable
    reference: Callable
    case: Callable


def checks(tiny: bool) -> list[Check]:
    """Tiny shapes for the interpreter; model-like ones on a GPU (Qwen3-30B-A3B attention and experts per EP8
    rank, DeepSeek-V3 MLA per TP8 rank), where the lengths also make the default key splits kick in."""
    lens = [1, 7, 70, 150] if tiny else [1, 17, 300, 1000, 2047, 2048, 4000, 96]
    tree_lens = [5, 9, 75] if tiny else [64, 100, 1500, 3000]
    gqa = dict(heads=6, kv_heads=2, head_dim=24, block_size=4) if tiny else \
        dict(heads=32, kv_heads=4, head_dim=128, block_size=16)
    mla = dict(heads=4, latent=40, rope=8, block_size=4) if tiny else dict(heads=16, latent=512, rope=64, block_size=64)
    tree = 5 if tiny else 64
    expert = dict(rows=40, top_k=3, hidden=24, inter=20, local_experts=4) if tiny else \
        dict(rows=256, top_k=8, hidden=2048, inter=768, local_experts=16)
    rows, dim = (6, 40) if tiny else (512, 7168)
    out = [Check("rms_norm", norm.rms_norm, kernels.rms_norm,
                 lambda g, dt, dev: cases.norm_case(rows, dim, g, False, dt, dev)),
           Check("add_rms_norm", norm.add_rms_norm, kernels.add_rms_norm,
                 lambda g, dt, dev: cases.norm_case(rows, dim, g, True, dt, dev)),
           Check("paged_decode_gqa", attention.paged_decode_gqa, kernels.paged_decode_gqa,
                 lambda g, dt, dev: cases.gqa_case(lens, **gqa, gen=g, dtype=dt, device=dev)),
           Check("paged_decode_mla", attention.paged_decode_mla, kernels.paged_decode_mla,
                 lambda g, dt, dev: cases.mla_case(lens, **mla, gen=g, dtype=dt, device=dev)),
           Check("tree_verify_gqa", attention.tree_verify_gqa, kernels.tree_verify_gqa,
                 lambda g, dt, dev: cases.gqa_case(tree_lens, **gqa, gen=g, tree=tree, dtype=dt, device=dev)),
           Check("tree_verify_mla", attention.tree_verify_mla, kernels.tree_verify_mla,
                 lambda g, dt, dev: cases.mla_case(tree_lens, **mla, gen=g, tree=tree, dtype=dt, device=dev))]
    for routing in ("spread", "one_expert", "none_local"):
        out.append(Check(f"fused_moe ({routing})", moe.fused_moe, kernels.local_experts,
                         lambda g, dt, dev, r=routing: cases.expert_case(**expert, routing=r, gen=g, dtype=dt,
                                                                         device=dev)))
    if not tiny:  # the prefill path's rows (grouped_mm in bf16 on sm_90+, the prefill tiles in fp32)
        out.append(Check("fused_moe (prefill path)", moe.fused_moe, kernels.local_experts,
                         lambda g, dt, dev: cases.expert_case(**dict(expert, rows=moe.PREFILL_TOKENS), routing="spread",
                                                              gen=g, dtype=dt, device=dev)))
    counts, packed_rows = ([0, 7, 16, 3], 16) if tiny else ([0, 1, 16, 17, 64, 300, 512, 40], 512)
    out.append(Check("masked_moe (DeepEP packed)", cases.valid_rows_only(moe.fused_moe),
                     cases.valid_rows_only(kernels.local_experts),
                     lambda g, dt, dev: cases.packed_expert_case(counts, packed_rows, expert["hidden"], expert["inter"],
                                                                 g, dt, dev)))
    return out


def run_check(check: Check, seed: int, dtype: torch.dtype, device: str) -> dict:
    """One check on fresh inputs (:func:`model.triton.cases.compare` states the pass rule)."""
    case = check.case(torch.Generator().manual_seed(seed), dtype, device)
    first = next(iter(case.values()))
    shape = (first.hidden if isinstance(first, ExpertInput) else first).shape
    return dict(kernel=check.name, dtype=str(dtype).removeprefix("torch."), shape="x".join(map(str, shape)),
                **cases.compare(check.kernel, check.reference, case), seed=seed)


def correctness(budget_s: float = float("inf")) -> list[dict]:
    """GPU: bf16 and fp32 (fp32 at the fp32 tolerance: a TF32 ``tl.dot`` would fail it). CPU: fp32 and fp16 (the
    interpreter computes bf16 wrongly: triton-lang/triton#11584). Checks not started within ``budget_s``: rows
    with ``skipped``."""
    dtypes, device = ((torch.bfloat16, torch.float32), "cuda") if CUDA else ((torch.float32, torch.float16), "cpu")
    seed, t0 = int(time.time()) % 10_000, time.monotonic()  # fresh inputs every run; the seed is in the report
    all_checks = [(c, dt) for dt in dtypes for c in checks(tiny=not CUDA)]
    return [run_check(c, seed + i, dt, device) if time.monotonic() - t0 < budget_s else
            dict(kernel=c.name, dtype=str(dt).removeprefix("torch."), skipped="time budget")
            for i, (c, dt) in enumerate(all_checks)]



MOE_DIMS = dict(top_k=8, hidden=7168, inter=2048, local_experts=32)  # DeepSeek-V3 experts per EP8 rank
PREFILL_ROW_TOKENS = 16384


def moe_timing(power: PowerMeter) -> list[dict] | str:
    """DeepSeek-V3 experts per EP8 rank (32 local of 256, H 7168, I 2048, top-8), bf16: the fused kernels against
    the torch reference at 64 and 4096 tokens, the prefill path at 16384 (:func:`moe_prefill_row`), DeepEP's packed
    layout; each fused row also against its floor (:func:`moe_floor_s`)."""
    if not CUDA:
        return NO_GPU
    rows, machine = [], dict(copy_bw=copy_bandwidth("cuda"), peak=matmul_peak("cuda"))
    gen = torch.Generator().manual_seed(0)
    case = cases.expert_case(64, **MOE_DIMS, routing="spread", gen=gen, dtype=torch.bfloat16, device="cuda")
    for phase, tokens in (("decode", 64), ("prefill", 4096)):
        case = dict(case, inp=cases.routed_input(tokens, MOE_DIMS["top_k"], MOE_DIMS["hidden"],
                                                 MOE_DIMS["local_experts"], "spread", gen, torch.bfloat16, "cuda"))
        fused = cuda_time_s(lambda c=case: moe.fused_moe(**c))
        ref = cuda_time_s(lambda c=case: kernels.local_experts(**c), iters=5)
        power.measure(f"fused moe {phase}", lambda c=case: moe.fused_moe(**c))
        floor = moe_floor_s(**case, **machine)
        rows.append(dict(phase=phase, tokens=tokens, fused_ms=fused * 1e3, reference_ms=ref * 1e3,
                         speedup=ref / fused, floor_ms=floor * 1e3, fraction_of_floor=floor / fused))
    big = cases.routed_input(PREFILL_ROW_TOKENS, MOE_DIMS["top_k"], MOE_DIMS["hidden"], MOE_DIMS["local_experts"],
                             "spread", gen, torch.bfloat16, "cuda")
    rows.append(moe_prefill_row(dict(case, inp=big), power, **machine))
    del big
    # DeepEP low latency on the same experts: 64 tokens on each of 8 ranks, top-8 of 256 → 16 rows per local
    # expert on average, in a [32, 128 * 8, H] packed buffer; the masked GEMM vs sorting the buffer's rows
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 33, (32,), generator=gen).tolist()
    case = cases.packed_expert_case(counts, 128 * 8, 7168, 2048, gen, torch.bfloat16, "cuda")
    sorted_case = dict(case, inp=dataclasses.replace(case["inp"], packed_counts=None))
    masked = cuda_time_s(lambda: moe.fused_moe(**case))
    fused = cuda_time_s(lambda: moe.fused_moe(**sorted_case))
    ref = cuda_time_s(lambda: kernels.local_experts(**case), iters=5)
    power.measure("masked moe (DeepEP packed)", lambda: moe.fused_moe(**case))
    rows.append(dict(phase="decode, DeepEP packed", tokens=sum(counts), masked_ms=masked * 1e3, fused_ms=fused * 1e3,
                     reference_ms=ref * 1e3, speedup=ref / masked, masked_vs_sorted=fused / masked))
    return rows


def moe_floor_s(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor, copy_bw: float,
                peak: float) -> float:
    """The larger of two floors of one expert call: the weights of the distinct local experts ``inp`` touches
    over ``copy_bw`` (B/s, read + write, as the roofline counts it) and ``2 · pairs · 3 · H · I`` FLOPs over
    ``peak`` (FLOP/s, a dense matmul of the same run)."""
    local = inp.slots[inp.slots >= 0]
    expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * w_down.element_size()
    flops = 2 * local.numel() * (w_gate_up[0].numel() + w_down[0].numel())
    return max(local.unique().numel() * expert_bytes / copy_bw, flops / peak)


def moe_prefill_row(case: dict, power: PowerMeter, copy_bw: float, peak: float) -> dict:
    """A prefill chunk of ``PREFILL_ROW_TOKENS``: the path ``fused_moe`` picks (``moe.moe_path``) against the
    sorted kernels at their table tiles and a per-expert cuBLAS loop (``F.linear`` per hit expert over its
    rows, the sort and combine included), with the speedups over that loop, each against the floor, and the
    largest difference from the sorted kernels' output (which sum in fp32)."""
    inp, w_down = case["inp"], case["w_down"]
    (n, hidden), (experts, _, inter), dev = inp.hidden.shape, w_down.shape, inp.hidden.device
    tiles = moe.table_tiles(experts, inter, hidden, n, dev) or moe.default_tiles(inp.slots.numel(), hidden, inter)
    prefill = cuda_time_s(lambda: moe.fused_moe(**case), iters=10, device=dev)
    fused = cuda_time_s(lambda: moe.fused_moe(**case, tiles=tiles), iters=10, device=dev)
    loop = cuda_time_s(lambda: kernels.routed_sum(**case, mlp=kernels.per_expert_mlp), iters=5, device=dev)
    path = moe.moe_path(n, w_down)
    power.measure(f"moe prefill {n} tokens ({path})", lambda: moe.fused_moe(**case))
    diff = (moe.fused_moe(**case).float() - moe.fused_moe(**case, tiles=tiles).float()).abs().max().item()
    floor = moe_floor_s(**case, copy_bw=copy_bw, peak=peak)
    return dict(phase="prefill path", tokens=n, path=path, prefill_ms=prefill * 1e3, fused_ms=fused * 1e3,
                per_expert_ms=loop * 1e3, speedup_vs_per_expert=loop / prefill, fused_vs_per_expert=loop / fused,
                floor_ms=floor * 1e3, fraction_of_floor=floor / prefill, fused_fraction_of_floor=floor / fused,
                max_abs_diff_vs_sorted=diff, copy_gb_s=copy_bw / 1e9, bf16_tflop_s=peak / 1e12)


def _decode_inputs(kind: str, batch: int, ctx: int) -> tuple[dict, int]:
    """Memory-bound decode inputs on the GPU and the bytes the kernel must read (caches + q)."""
    block_size, gen = 16, torch.Generator().manual_seed(0)
    tables, lens, slots = cases.paged_tables([ctx] * batch, block_size, gen, "cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    if kind == "gqa":
        k, v = (torch.randn(slots, 8, 128, **bf) for _ in range(2))
        args = dict(q=torch.randn(batch, 64, 128, **bf), k_cache=k, v_cache=v)
        read = 2 * batch * ctx * 8 * 128 * 2
    else:
        args = dict(q_lat=torch.randn(batch, 16, 512, **bf), q_pe=torch.randn(batch, 16, 64, **bf),
                    latent_cache=torch.randn(slots, 512, **bf), rope_cache=torch.randn(slots, 64, **bf))
        read = batch * ctx * (512 + 64) * 2
    return dict(args, block_tables=tables, context_lens=lens, block_size=block_size, scale=0.1), read


def bandwidth(power: PowerMeter) -> dict | str:
    if not CUDA:
        return NO_GPU
    copy_bw = copy_bandwidth("cuda", power)
    rows = []
    # every cache is well above the 50-60 MiB L2 of H100/H200, so reads come from HBM
    for kind, batch, ctx in (("gqa", 64, 4096), ("mla", 64, 4096), ("gqa", 1, 32768), ("mla", 1, 131072)):
        args, read = _decode_inputs(kind, batch, ctx)
        fn = attention.paged_decode_gqa if kind == "gqa" else attention.paged_decode_mla
        seconds = cuda_time_s(lambda f=fn, a=args: f(**a))
        power.measure(f"paged_decode_{kind} b{batch} ctx{ctx}", lambda f=fn, a=args: f(**a))
        rows.append(dict(kernel=f"paged_decode_{kind}", batch=batch, context=ctx, mib_read=read / 2**20,
                         us=seconds * 1e6, gb_s=read / seconds / 1e9, fraction_of_copy=read / seconds / copy_bw))
        del args
        torch.cuda.empty_cache()
    return dict(copy_gb_s=copy_bw / 1e9, decode=rows, note="copy counts read + write bytes; decode counts the "
                "cache bytes it must read (K and V, or latent + rope key)")
