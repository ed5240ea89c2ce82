"""The batch-invariant Triton kernels (``model.triton.invariant_matmul``, the ordered MoE combine) on CPU under
``TRITON_INTERPRET=1``, at tiny widths: one row computed alone and inside launches of 2, 9, 17, 64 and 257 rows is
bit-identical, fp16 and fp32 (fp16 standing in for bf16, which the interpreter computes wrongly:
triton-lang/triton#11584); and each kernel is close to its torch reference. (The interpreter runs ``tl.dot`` as
a numpy matmul of each fixed-shape tile: what is proven here is that no row's arithmetic depends on M through
the tiling, the K walk or the combine — the GPU's own MMA order is gpu_check's.)"""


import dataclasses

import pytest
import torch
import triton

import tests.support.interpret_triton as interpret_triton  # sets TRITON_INTERPRET before triton is imported
from model import invariant, kernels
from model.triton.precision import dot_precision
from parallelism.comm import ordered_sum
from tests.e2e.test_batch_invariance import assert_rows_invariant, moe_rows_case, quant_rows, randn

interpret_triton.require()

DTYPES = (torch.float16, torch.float32)
moe = interpret_triton.module("model.triton.moe")
tim = interpret_triton.module("model.triton.invariant_matmul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_rows(dtype):
    """K = 150: three K steps of 64, the last partial; N = 80: two column tiles; with and without bias."""
    x, w, b = randn(257, 150, dtype=dtype), randn(80, 150, dtype=dtype, seed=1, scale=0.1), randn(80, dtype=dtype)
    assert_rows_invariant(lambda lo, hi: tim.linear(x[lo:hi], w))
    assert_rows_invariant(lambda lo, hi: tim.linear(x[lo:hi], w, b))
    torch.testing.assert_close(tim.linear(x, w, b).float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               rtol=1e-2, atol=1e-2)


def planted_linear(x, w, block_k: int, splits: int = 1):
    """``tim``'s GEMM launched with ``block_k`` and its K range cut into ``splits`` partial GEMMs added in turn: what a
    shape-tuned launch does when it picks them from the row count. Written in fp32 (an fp16 output would round the
    accumulator's last bits away)."""
    (m, k), n = x.shape, w.shape[0]
    y = torch.zeros(m, n, dtype=torch.float32)
    for part in torch.arange(k).tensor_split(splits):
        xs, ws = x[:, part].contiguous(), w[:, part].contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        tim._linear_kernel[(triton.cdiv(m, tim.BLOCK_M), triton.cdiv(n, tim.BLOCK_N))](
            xs, ws, ws, out, m, n, len(part), xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
            HAS_BIAS=False, BLOCK_M=tim.BLOCK_M, BLOCK_N=tim.BLOCK_N, BLOCK_K=block_k, DOT=dot_precision(x.dtype))
        y += out
    return y


PLANTED = {"BLOCK_K by rows": lambda rows: dict(block_k=32 if rows < 16 else 64),
           "split-K by rows": lambda rows: dict(block_k=64, splits=1 if rows < 16 else 2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plant", PLANTED)
def test_a_kernel_whose_k_walk_follows_the_row_count_fails(plant, dtype):
    """The check has teeth under the interpreter's fixed-order ``tl.dot``: a GEMM whose K steps or split-K follow
    M (as a tuned table's do) rounds a row differently alone and inside a launch, on every host."""
    x, w = randn(257, 150, dtype=dtype), randn(80, 150, dtype=dtype, seed=1, scale=0.1)
    with pytest.raises(AssertionError):
        assert_rows_invariant(lambda lo, hi: planted_linear(x[lo:hi], w, **PLANTED[plant](hi - lo)))
    assert_rows_invariant(lambda lo, hi: planted_linear(x[lo:hi], w, **PLANTED[plant](1)))  # fixed: invariant


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_head_matmul_rows(dtype):
    x, w = randn(257, 3, 40, dtype=dtype, seed=2), randn(3, 40, 24, dtype=dtype, seed=3, scale=0.2)
    assert_rows_invariant(lambda lo, hi: tim.head_matmul(x[lo:hi], w))
    torch.testing.assert_close(tim.head_matmul(x, w).float(), kernels.head_matmul(x.float(), w.float()),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_ordered_combine_rows(dtype):
    """Fixed tiles and per-pair rows summed in top-k order; slots −1 (other ranks) and one expert hit by all."""
    run = moe_rows_case(tim.moe_experts, dtype)
    assert_rows_invariant(run)
    torch.testing.assert_close(run(0, 257).float(), run.reference, rtol=3e-2, atol=3e-2)
    atomic = moe.fused_moe(*run.full)  # the default combine: close, not bit-exact
    torch.testing.assert_close(run(0, 257).float(), atomic.float(), rtol=2e-2, atol=2e-2)



@pytest.mark.parametrize("experts", [tim.moe_experts, invariant.moe_experts], ids=("triton", "torch"))
def test_unsummed_pairs_are_the_summed_outputs_parts(experts):
    """What the placement-invariant combine receives (``ExpertInput.unsummed``): each (row, choice)'s weighted output
    ``[N, k, H]``, zeros where the expert is on another rank, whose top-k-order sum is the summed call bit for bit."""
    inp, wgu, wd = moe_rows_case(experts, torch.float16).full
    pairs = experts(dataclasses.replace(inp, unsummed=True), wgu, wd)
    assert pairs.shape == (*inp.slots.shape, inp.hidden.shape[1])
    assert not pairs[inp.slots < 0].any() and pairs[inp.slots >= 0].abs().sum(dim=1).min() > 0
    assert torch.equal(ordered_sum(pairs, 1).to(inp.hidden.dtype), experts(inp, wgu, wd))


quant_gemm = interpret_triton.module("model.triton.quant_gemm")
quant_moe = interpret_triton.module("model.triton.quant_moe")
QUANT = {**quant_gemm.INVARIANT, **quant_moe.INVARIANT}  # base kernel -> its batch-invariant version


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", QUANT, ids=lambda f: f.__name__)
def test_quant_kernels_rows(base, dtype):
    """Fixed tiles for every M (the quant GEMMs, W8A8 on e4m3 tiles) and the quant MoE's per-pair store summed in
    top-k order; close to the base kernel (atomics, M-dependent tiles)."""
    op = base.__name__.replace("w8a8", "fp8").replace("w8a16", "fp8")  # the KernelSet op it implements
    run = quant_rows(QUANT[base], op, dtype)
    assert_rows_invariant(run)
    torch.testing.assert_close(run(0, 257), quant_rows(base, op, dtype)(0, 257), rtol=2e-2, atol=2e-2)

AOT = """
import json, torch
from model.triton import invariant_matmul as tim, moe
from model.triton.aot import Spec, compile_spec
from model.triton.precision import dot_precision
from parallelism.comm import ordered_sum
tiles = dict(BLOCK_M=tim.BLOCK_M, BLOCK_N=tim.BLOCK_N, BLOCK_K=tim.BLOCK_K)
t = tim.MOE_TILES
bf16, fp32 = dot_precision(torch.bfloat16), dot_precision(torch.float32)
specs = [Spec(f"invariant linear bias={b}", tim._linear_kernel, dict(tiles, HAS_BIAS=b, DOT=bf16))
         for b in (False, True)]
specs.append(Spec("invariant linear fp32", tim._linear_kernel, dict(tiles, HAS_BIAS=False, DOT=fp32),
                  dict(x_ptr="fp32", w_ptr="fp32", b_ptr="fp32", y_ptr="fp32")))
specs.append(Spec("moe down per pair", moe._down_kernel,
                  dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT=dot_precision(torch.bfloat16),
                       PER_PAIR=True),
                  dict(sorted_ptr="i32", expert_ptr="i32", num_post_ptr="i32", out_ptr="fp32", weight_ptr="fp32"),
                  t.num_warps))
for s in specs:
    print(json.dumps(compile_spec(s, 90)))
"""


def test_invariant_kernels_compile_for_sm90():
    """The real compiler and ptxas (as ``tests/model/test_triton_kernels.py`` does for the rest): the fixed-tile GEMM in
    bf16 (with and without bias) and fp32, and the MoE down kernel's per-pair store."""
    rows = interpret_triton.compile_rows(AOT)
    assert len(rows) == 4 and [r for r in rows if not r["ok"]] == [], rows
