"""The quantized kernels on the GPU (gpu_check section ``quant``): right, and how fast against the machine.

- which implementation each quantized op gets on this device, and why (W8A8 on sm ≥ 89);
- every quantized Triton op against its torch reference in bf16 at model-like sizes
  (:func:`model.triton.cases.compare`; the interpreter cannot check bf16);
- Kimi K2.6 routed experts per EP8 rank (48 of 384 local, H 7168, I 2048, INT4 group 32, top-8) at decode, sorted
  and DeepEP-packed: weight bytes of the hit experts per second as a fraction of the device copy rate measured in
  the same run; the FP8 dense GEMM (DeepSeek-V3 ``o_proj`` at TP8, 4096 tokens) against a bf16 ``F.linear`` of the
  same shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.gpu.harness import copy_bandwidth, cuda_time_s
from bench.gpu.row_cases import fp8_weight, int4_weight
from model.kernel_select import QUANT_OPS, select_kernels
from model.quant import reference as R

NO_GPU = "skipped: no CUDA device"


def _expert_input(tokens, experts, packed: bool, g):
    from model.triton import cases

    if packed:
        counts = torch.randint(0, 33, (experts,), generator=g).tolist()
        return cases.packed_expert_case(counts, 128 * 8, 7168, 64, g, torch.bfloat16, "cuda")["inp"]
    return cases.expert_case(tokens, 8, 7168, 64, experts, "spread", g, torch.bfloat16, "cuda")["inp"]


def _positional(fn):
    return lambda **kw: fn(*kw.values())


def correctness(ks) -> list[dict]:
    from model.triton import cases

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2048, generator=g).to(torch.bfloat16).cuda()
    packed, scale = int4_weight((7168, 2048), g, "cuda")
    w, s = fp8_weight((7168, 2048), g, "cuda")
    inp = cases.expert_case(64, 8, 2048, 512, 8, "spread", g, torch.bfloat16, "cuda")["inp"]
    m13, n13 = int4_weight((8, 1024, 2048), g, "cuda")
    m2, n2 = int4_weight((8, 2048, 512), g, "cuda")
    f13, t13 = fp8_weight((8, 1024, 2048), g, "cuda")
    f2, t2 = fp8_weight((8, 2048, 512), g, "cuda")
    checks = [("w4a16_linear", (x, packed, scale, 32)), ("fp8_linear", (x, w, s, (128, 128))),
              ("w4a16_moe", (inp, m13, n13, m2, n2, 32)), ("fp8_moe", (inp, f13, t13, f2, t2, (128, 128)))]
    refs = dict(w4a16_linear=R.w4a16_linear, w4a16_moe=R.w4a16_moe,
                fp8_linear=R.w8a8_linear if "W8A8" in ks.reasons["fp8_linear"] else R.w8a16_linear,
                fp8_moe=R.w8a8_moe if "W8A8" in ks.reasons["fp8_moe"] else R.w8a16_moe)
    out = []
    for op, args in checks:
        case = {str(i): a for i, a in enumerate(args)}
        result = cases.compare(_positional(getattr(ks, op)), _positional(refs[op]), case)
        out.append(dict(op=op, **result))
    return out


def timing(ks) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    copy_rate = copy_bandwidth("cuda")
    experts, hidden, inter = 48, 7168, 2048
    w13, s13 = int4_weight((experts, 2 * inter, hidden), g, "cuda")
    w2, s2 = int4_weight((experts, hidden, inter), g, "cuda")
    per_expert = (w13[0].numel() + w2[0].numel()) * 4 + (s13[0].numel() + s2[0].numel()) * 2
    rows = []
    for layout, packed in (("sorted", False), ("DeepEP packed", True)):
        inp = _expert_input(64, experts, packed, g)
        hit = int((torch.bincount(inp.slots[inp.slots >= 0].flatten(), minlength=experts) > 0).sum())
        t = cuda_time_s(lambda inp=inp: ks.w4a16_moe(inp, w13, s13, w2, s2, 32))
        rate = hit * per_expert / t
        rows.append(dict(op="w4a16_moe decode", layout=layout, ms=t * 1e3, hit_experts=hit, weight_gb_s=rate / 1e9,
                         of_copy_rate=rate / copy_rate))
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    w, s = fp8_weight((7168, 2048), g, "cuda")
    dense = torch.randn(7168, 2048, device="cuda", dtype=torch.bfloat16)
    t_fp8 = cuda_time_s(lambda: ks.fp8_linear(x, w, s, (128, 128)))
    t_bf16 = cuda_time_s(lambda: F.linear(x, dense))
    flops = 2 * 4096 * 7168 * 2048
    rows.append(dict(op="fp8_linear 4096x2048->7168", scheme=ks.reasons["fp8_linear"], ms=t_fp8 * 1e3,
                     tflop_s=flops / t_fp8 / 1e12, bf16_linear_tflop_s=flops / t_bf16 / 1e12))
    return [dict(copy_gb_s=copy_rate / 1e9)] + rows


def run(budget_s: float) -> dict:
    """The section: kernel choice everywhere; correctness and timing on CUDA only (each recorded on failure)."""
    cuda = torch.cuda.is_available()
    ks = select_kernels("cuda" if cuda else "cpu")
    report: dict = dict(kernel_select={op: ks.reasons[op] for op in QUANT_OPS})
    for name, section in (("correctness", correctness), ("timing", timing)):
        try:
            report[name] = section(ks) if cuda else NO_GPU
        except Exception as exc:  # noqa: BLE001 - recorded; the other part still runs
            report[name] = f"failed: {type(exc).__name__}: {exc}"
    return report
