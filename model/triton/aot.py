"""Ahead-of-time compile of every kernel, at production shapes, for a GPU architecture — no GPU needed.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute; it does not check that they
compile: ``tl.dot`` shape rules, dtype agreement, loop-carried types and shared-memory budgets only show up
in the real compiler. Triton ships its NVIDIA toolchain (LLVM, ptxas), so ``triton.compile`` with an explicit
``GPUTarget`` lowers each kernel to a cubin on a CPU box. Launch-time behaviour (registers actually
allocated, speed) still needs a GPU: ``scripts/gpu_check.py``.

    python -m model.triton.aot --arch 90 100 [--core]   # one JSON line per compiled configuration

Run it in a process without ``TRITON_INTERPRET`` (under the interpreter ``triton.jit`` returns
interpreted functions, which do not compile).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model.triton import attention, moe, norm
from model.triton.precision import dot_precision

SHARED_LIMIT = 232448  # bytes of shared memory one block may opt into on sm_90 and sm_100
FLOAT_ARGS = ("scale", "eps")


@dataclass(frozen=True)
class Spec:
    """One kernel configuration: pointer dtypes by argument name (default ``bf16``), constexprs, warps, stages.
    ``core``: part of the smallest set that reaches every code path (what the tests compile)."""

    name: str
    kernel: object
    constexprs: dict
    pointers: dict = field(default_factory=dict)
    num_warps: int = 4
    core: bool = False
    num_stages: int = 3


def _attention_pointers(split_out: bool) -> dict:
    out = "fp32" if split_out else "bf16"
    return dict(o_ptr=out, lse_ptr="fp32", bt_ptr="i32", lens_ptr="i32", mask_ptr="i8")


def _launch_spec(name: str, kernel, meta: dict, pointers: dict, core: bool) -> Spec:
    """A Spec from a kernel module's meta dict (constexprs plus ``num_warps`` / ``num_stages``)."""
    meta = dict(meta)
    return Spec(name, kernel, meta, pointers, meta.pop("num_warps"), core, meta.pop("num_stages"))


def _attention_specs() -> list[Spec]:
    """Qwen3-235B at TP8 (8 query heads on 1 replicated KV head, D = 128) and DeepSeek-V3 at TP8 (16 heads,
    latent 512, rope 64), 16-slot KV blocks: decode writing its output directly (one split in the grid) and
    as split partials, tree verify at budget 64; MLA also with 64-slot blocks (one block-table load per tile:
    the block is wider than the tile); the split merge for both."""
    specs = []
    for n, split_out, tree, block, kind in ((1, False, False, 16, "decode"), (1, True, False, 16, "decode split"),
                                            (64, True, True, 16, "tree64 split"),
                                            (1, True, False, 64, "decode split block64")):
        core = True  # direct output, split partials, tree masks and both tile-lookup forms are separate paths
        gqa = dict(attention.gqa_meta(n, 8, 128, tree, torch.bfloat16, block), SPLIT_OUT=split_out)
        mla = dict(attention.mla_meta(n, 16, 512, 64, tree, torch.bfloat16, block), SPLIT_OUT=split_out)
        if block == 16:
            specs.append(_launch_spec(f"gqa {kind}", attention._gqa_kernel, gqa, _attention_pointers(split_out), core))
        specs.append(_launch_spec(f"mla {kind}", attention._mla_kernel, mla, _attention_pointers(split_out), core))
    for name, rows, ncol in (("gqa", 8, 128), ("mla", 16, 512)):
        specs.append(_launch_spec(f"{name} split merge", attention._merge_kernel, attention.merge_meta(rows, ncol),
                                  dict(o_ptr="fp32", lse_ptr="fp32", lens_ptr="i32"), name == "mla"))
    return specs


def _moe_specs() -> list[Spec]:
    """DeepSeek-V3 experts (H = 7168, I = 2048) with the decode, the prefill and the large prefill-path tiles
    (grouped launch order), the masked GEMM on DeepEP's low-latency layout, and the align-block-size kernel for
    384 experts."""
    specs = []
    for kind, t in (("decode", moe.default_tiles(64 * 8, 7168, 2048)),
                    ("prefill", moe.default_tiles(4096 * 8, 7168, 2048)),
                    ("prefill path", moe.prefill_tiles(torch.bfloat16))):
        tiles = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                     DOT=dot_precision(torch.bfloat16))
        ids = dict(sorted_ptr="i32", expert_ptr="i32", num_post_ptr="i32")
        core = kind == "decode"
        specs.append(Spec(f"moe gate_up {kind}", moe._gate_up_kernel, tiles, ids, t.num_warps, core, t.num_stages))
        specs.append(Spec(f"moe down {kind}", moe._down_kernel, tiles,
                          dict(ids, out_ptr="fp32", weight_ptr="fp32"), t.num_warps, core, t.num_stages))
    t = moe.prefill_tiles(torch.float32)  # the largest shared-memory need: three fp32 tiles per stage
    specs.append(Spec("moe gate_up prefill path fp32", moe._gate_up_kernel,
                      dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                           DOT=dot_precision(torch.float32)),
                      dict(x_ptr="fp32", w_ptr="fp32", h_ptr="fp32", sorted_ptr="i32", expert_ptr="i32",
                           num_post_ptr="i32"), t.num_warps, False, t.num_stages))
    t = moe.default_tiles(128 * 8, 7168, 2048)  # DeepEP low latency: 128 tokens per rank × 8 ranks per expert
    tiles = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT=dot_precision(torch.bfloat16))
    specs.append(Spec("moe masked gate_up", moe._masked_gate_up_kernel, tiles, dict(counts_ptr="i32"), t.num_warps,
                      True))
    specs.append(Spec("moe masked down", moe._masked_down_kernel, tiles, dict(counts_ptr="i32"), t.num_warps, True))
    fp32 = dict(x_ptr="fp32", w_ptr="fp32", h_ptr="fp32", counts_ptr="i32")  # fp32 operands: IEEE dot, not TF32
    specs.append(Spec("moe masked gate_up fp32", moe._masked_gate_up_kernel,
                      dict(tiles, DOT=dot_precision(torch.float32)), fp32, t.num_warps, True))
    align = dict(E_PAD=512, BLOCK=128, BLOCK_B=16)  # as moe_align_block_size launches it for 384 experts
    specs.append(Spec("moe align_block_size", moe._align_kernel, align,
                      dict(slots_ptr="i32", sorted_ptr="i32", expert_ids_ptr="i32", num_post_ptr="i32",
                           cursor_ptr="i32"), 4, True))
    return specs


def _norm_specs() -> list[Spec]:
    block = triton.next_power_of_2(7168)
    return [Spec(f"rms_norm residual={res}", norm._rms_norm_kernel, dict(BLOCK_D=block, HAS_RESIDUAL=res),
                 num_warps=16, core=res) for res in (False, True)]


def specs() -> list[Spec]:
    return _attention_specs() + _moe_specs() + _norm_specs()


def _signature(spec: Spec) -> dict:
    """Argument types by name: constexprs, pointers (``*dtype``), ``fp32`` for scale/eps, ``i32`` otherwise."""
    sig = {}
    for name in spec.kernel.arg_names:
        if name in spec.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + spec.pointers.get(name, "bf16")
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return sig


def compile_spec(spec: Spec, arch: int) -> dict:
    """Compile one configuration for ``sm_{arch}``; never raises: failures come back as ``error``."""
    start = time.perf_counter()
    row = dict(kernel=spec.name, arch=f"sm_{arch}", constexprs=spec.constexprs, num_warps=spec.num_warps,
               num_stages=spec.num_stages)
    try:
        src = ASTSource(spec.kernel, _signature(spec), spec.constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=spec.num_warps,
                                                                                  num_stages=spec.num_stages))
    except Exception as exc:  # noqa: BLE001 - a compiler error is the result being reported
        return dict(row, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                    seconds=round(time.perf_counter() - start, 2))
    shared = compiled.metadata.shared
    row["tf32_mma"] = ".tf32" in compiled.asm.get("ptx", "")  # fp32 operands rounded to TF32 in the tensor cores
    return dict(row, ok=shared <= SHARED_LIMIT, shared_bytes=shared, seconds=round(time.perf_counter() - start, 2),
                error=None if shared <= SHARED_LIMIT else f"needs {shared} B of shared memory > {SHARED_LIMIT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="SM versions, e.g. 90 (H100/H200) 100")
    parser.add_argument("--core", action="store_true", help="only the configurations that reach every code path")
    args = parser.parse_args()
    if triton.knobs.runtime.interpret:
        raise SystemExit("model.triton.aot: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    for arch in args.arch:
        for spec in specs():
            if spec.core or not args.core:
                print(json.dumps(compile_spec(spec, arch)), flush=True)


if __name__ == "__main__":
    main()
