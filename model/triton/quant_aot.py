"""Ahead-of-time compile of the quantized kernels (:mod:`model.triton.quant_gemm`, :mod:`model.triton.quant_moe`)
at production shapes for a GPU architecture, no GPU needed — :mod:`model.triton.aot`'s machinery, own list.

    python -m model.triton.quant_aot --arch 90 100 [--core]   # one JSON line per configuration

Shapes: Kimi K2.6 routed experts in INT4 (H 7168, I 2048, group 32, bf16 scales), DeepSeek-V3 FP8 (128×128
blocks) experts and dense projections (W8A16 and W8A8), decode and prefill tiles.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from model.triton import moe, quant_gemm, quant_moe
from model.triton.aot import Spec, compile_spec
from model.triton.precision import dot_precision

INT4 = dict(INT4=True, S_ROWS=1, S_COLS=32)
FP8 = dict(INT4=False, S_ROWS=128, S_COLS=128)
PTR_INT4 = dict(w_ptr="i32", s_ptr="bf16")
PTR_FP8 = dict(w_ptr="fp8e4nv", s_ptr="fp32")


def specs() -> list[Spec]:
    out = []
    dot = dot_precision(torch.bfloat16)
    for kind, rows in (("decode", 16), ("prefill", 4096)):
        bm, bn, bk, warps = quant_gemm._tiles(rows, 7168, 2048)
        tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT=dot)
        out.append(Spec(f"w4a16_linear {kind}", quant_gemm._dequant_matmul_kernel, dict(INT4, **tiles), PTR_INT4,
                        warps))
        out.append(Spec(f"w8a16_linear {kind}", quant_gemm._dequant_matmul_kernel, dict(FP8, **tiles), PTR_FP8, warps))
        out.append(Spec(f"w8a8_linear {kind}", quant_gemm._w8a8_kernel,
                        dict(S_ROWS=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128),
                        dict(PTR_FP8, xq_ptr="fp8e4nv", xs_ptr="fp32"), warps))
        t = moe.default_tiles(64 * 8 if kind == "decode" else 4096 * 8, 7168, 2048)
        mt = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT=dot)
        ids = dict(sorted_ptr="i32", expert_ptr="i32", num_post_ptr="i32")
        a8 = dict(x_ptr="fp8e4nv", xs_ptr="fp32", h_ptr="fp8e4nv", hs_ptr="fp32")
        for name, fmt, ptrs, acts in (("w4a16", INT4, PTR_INT4, {}), ("w8a16", FP8, PTR_FP8, {}),
                                      ("w8a8", FP8, PTR_FP8, a8)):
            c = dict(fmt, **mt, A_FP8=bool(acts))
            if acts:
                c["BLOCK_K"] = 128
            out.append(Spec(f"{name}_moe gate_up {kind}", quant_moe._q_gate_up_kernel, c,
                            {**ids, **ptrs, **acts, "h_ptr": "bf16"}, t.num_warps))
            out.append(Spec(f"{name}_moe down {kind}", quant_moe._q_down_kernel, c,
                            dict(ids, **ptrs, **acts, out_ptr="fp32", weight_ptr="fp32"), t.num_warps))
    t = moe.default_tiles(128 * 8, 7168, 2048)  # DeepEP low latency: 128 tokens per rank × 8 ranks per expert
    for name, fmt, ptrs, acts in (("w4a16", INT4, PTR_INT4, {}), ("w8a8", FP8, PTR_FP8, a8)):
        c = dict(fmt, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=128 if acts else t.block_k, DOT=dot,
                 A_FP8=bool(acts))
        p = {**ptrs, **acts, "counts_ptr": "i32"}
        out.append(Spec(f"{name}_moe masked gate_up", quant_moe._q_masked_gate_up_kernel, c, {**p, "h_ptr": "bf16"},
                        t.num_warps))
        out.append(Spec(f"{name}_moe masked down", quant_moe._q_masked_down_kernel, c, {**p, "out_ptr": "bf16"},
                        t.num_warps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    parser.add_argument("--core", action="store_true",
                        help="skip the prefill tiles (the decode tiles reach every code path)")
    args = parser.parse_args()
    if triton.knobs.runtime.interpret:
        raise SystemExit("model.triton.quant_aot: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for arch in args.arch:
        for spec in specs():
            if not (args.core and "prefill" in spec.name):
                print(json.dumps(compile_spec(spec, arch)), flush=True)


if __name__ == "__main__":
    main()
