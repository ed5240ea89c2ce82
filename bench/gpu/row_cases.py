"""One row alone against the same row inside launches of many, for every op of a kernel set (gpu_check section
``invariance``; docs/batch_invariance.md).

:data:`ROW_CASES` maps an op name (a :class:`model.kernel_select.KernelSet` field) to a builder of its arguments
over R rows — tokens for the dense ops and the experts, sequences for attention — reusing
:mod:`model.triton.cases` where it has one. :func:`row_mismatches` runs rows ``lo..hi`` of every per-row argument
(:data:`ROW_ARGS`) in one launch and compares each probed row alone with itself inside 2, 9, 17, ... rows,
bit for bit. An op with no builder here is reported as not covered, never silently passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.kernel_select import QUANT_OPS, KernelSet
from model.triton import cases
from parallelism.dispatch_base import ExpertInput

# arguments with one entry per row (dim 0); everything else (weights, caches, scalars) is shared by the rows
ROW_ARGS = frozenset({"x", "residual", "inp", "gate_up", "q", "q_lat", "q_pe", "k", "v", "mask", "block_tables",
                      "context_lens", "parents"})
BF16_ONLY = frozenset(QUANT_OPS)  # the quantized ops take bf16 activations


@dataclass(frozen=True, kw_only=True)
class Dims:
    """Widths of the row cases: ``tiny`` for the CPU test, :data:`MODEL` on a GPU (DeepSeek-V3 / Qwen3-MoE-like)."""

    hidden: int
    inter: int
    out: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    latent: int
    rope: int
    block_size: int
    max_context: int
    tree: int


MODEL = Dims(hidden=2048, inter=768, out=1024, experts=16, top_k=8, heads=16, kv_heads=4, head_dim=128, latent=512,
             rope=64, block_size=16, max_context=600, tree=9)
TINY = Dims(hidden=128, inter=64, out=48, experts=4, top_k=2, heads=4, kv_heads=2, head_dim=16, latent=32, rope=8,
            block_size=4, max_context=40, tree=5)


@dataclass(frozen=True)
class RowCase:
    """An op's arguments over ``rows`` rows, in its reference's order and names; ``positional``: call them by
    position (the quantized ops' implementations name their weights differently)."""

    args: dict
    rows: int
    positional: bool = False

    def call(self, kernel: Callable, lo: int, hi: int):
        """``kernel`` on rows ``lo..hi-1`` in one launch."""
        args = {name: _take(v, lo, hi) if name in ROW_ARGS else v for name, v in self.args.items()}
        return kernel(*args.values()) if self.positional else kernel(**args)


def _take(value, lo: int, hi: int):
    if isinstance(value, ExpertInput):
        return dataclasses.replace(value, hidden=value.hidden[lo:hi], slots=value.slots[lo:hi],
                                   weights=value.weights[lo:hi])
    return value[lo:hi]


def _randn(shape, gen, dtype, device, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def int4_weight(shape: tuple[int, ...], gen: torch.Generator, device, group: int = 32):
    """Random INT4 weights ``[..., N, K]`` packed 8 per int32 → ``(packed [..., N, K/8], scale [..., N, K/group])``."""
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int32)
    packed = ((q + 8).view(*shape[:-1], shape[-1] // 8, 8) << (torch.arange(8, dtype=torch.int32) * 4)).sum(-1)
    scale = torch.rand(*shape[:-1], shape[-1] // group, generator=gen) * shape[-1] ** -0.5 / 4
    return packed.to(device=device, dtype=torch.int32), scale.to(device=device, dtype=torch.bfloat16)


def fp8_weight(shape: tuple[int, ...], gen: torch.Generator, device, block: int = 128):
    """Random e4m3 weights ``[..., N, K]`` and their fp32 ``block × block`` inverse scales."""
    w = (torch.randn(*shape, generator=gen) * 64).to(torch.float8_e4m3fn).to(device)
    grid = (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
    return w, (torch.rand(*grid, generator=gen) * shape[-1] ** -0.5 / 64).to(device)


def _masked_attention(rows, d, gen, dtype, device) -> RowCase:
    """``q [R, 4, H, D]`` over ``k, v [R, 3·D, G, D]`` with a random visible set (key 0 always visible)."""
    n, m = 4, 3 * d.head_dim
    mask = torch.rand(rows, n, m, generator=gen) < 0.7
    mask[..., 0] = True
    return RowCase(dict(q=_randn((rows, n, d.heads, d.head_dim), gen, dtype, device),
                        k=_randn((rows, m, d.kv_heads, d.head_dim), gen, dtype, device),
                        v=_randn((rows, m, d.kv_heads, d.head_dim), gen, dtype, device), mask=mask.to(device),
                        scale=d.head_dim ** -0.5), rows)


def _w4a16_linear(rows, d, gen, dtype, device) -> RowCase:
    packed, scale = int4_weight((d.out, d.hidden), gen, device)
    x = _randn((rows, d.hidden), gen, dtype, device)
    return RowCase(dict(x=x, packed=packed, scale=scale, group_size=32), rows, positional=True)


def _fp8_linear(rows, d, gen, dtype, device) -> RowCase:
    weight, scale_inv = fp8_weight((d.out, d.hidden), gen, device)
    x = _randn((rows, d.hidden), gen, dtype, device)
    return RowCase(dict(x=x, weight=weight, scale_inv=scale_inv, block=(128, 128)), rows, positional=True)


def _quant_moe(weight: Callable, last) -> Callable[..., RowCase]:
    """A quantized MoE op's builder: ``weight`` makes ``(w, scale)`` per weight (:func:`int4_weight` or
    :func:`fp8_weight`), ``last`` is the group size or block."""
    def build(rows, d, gen, dtype, device) -> RowCase:
        w13, s13 = weight((d.experts, 2 * d.inter, d.hidden), gen, device)
        w2, s2 = weight((d.experts, d.hidden, d.inter), gen, device)
        inp = cases.expert_case(rows, d.top_k, d.hidden, d.inter, d.experts, "spread", gen, dtype, device)["inp"]
        return RowCase(dict(inp=inp, w13=w13, s13=s13, w2=w2, s2=s2, last=last), rows, positional=True)
    return build


def _paged(builder: Callable, gqa: bool, tree: bool) -> Callable[..., RowCase]:
    """A paged attention op's builder over :func:`model.triton.cases.gqa_case` / ``mla_case``: one row per
    sequence, random context lengths (at least the tree's size)."""
    def build(rows, d, gen, dtype, device) -> RowCase:
        lens = torch.randint(d.tree if tree else 1, d.max_context + 1, (rows,), generator=gen).tolist()
        widths = (d.heads, d.kv_heads, d.head_dim) if gqa else (d.heads, d.latent, d.rope)
        return RowCase(builder(lens, *widths, d.block_size, gen, tree=d.tree if tree else 0, dtype=dtype,
                               device=device), rows)
    return build


Builder = Callable[[int, Dims, torch.Generator, torch.dtype, str], RowCase]

ROW_CASES: dict[str, Builder] = {
    "rms_norm": lambda r, d, g, dt, dev: RowCase(cases.norm_case(r, d.hidden, g, False, dt, dev), r),
    "add_rms_norm": lambda r, d, g, dt, dev: RowCase(cases.norm_case(r, d.hidden, g, True, dt, dev), r),
    "moe_experts": lambda r, d, g, dt, dev: RowCase(
        cases.expert_case(r, d.top_k, d.hidden, d.inter, d.experts, "spread", g, dt, dev), r),
    "paged_decode_gqa": _paged(cases.gqa_case, gqa=True, tree=False),
    "paged_decode_mla": _paged(cases.mla_case, gqa=False, tree=False),
    "tree_verify_gqa": _paged(cases.gqa_case, gqa=True, tree=True),
    "tree_verify_mla": _paged(cases.mla_case, gqa=False, tree=True),
    "linear": lambda r, d, g, dt, dev: RowCase(dict(
        x=_randn((r, d.hidden), g, dt, dev), weight=_randn((d.out, d.hidden), g, dt, dev, d.hidden ** -0.5),
        bias=_randn((d.out,), g, dt, dev)), r),
    "head_matmul": lambda r, d, g, dt, dev: RowCase(dict(
        x=_randn((r, d.heads, d.head_dim), g, dt, dev),
        w=_randn((d.heads, d.head_dim, d.latent), g, dt, dev, d.head_dim ** -0.5)), r),
    "silu_and_mul": lambda r, d, g, dt, dev: RowCase(dict(gate_up=_randn((r, 2 * d.inter), g, dt, dev)), r),
    "sigmoid": lambda r, d, g, dt, dev: RowCase(dict(x=_randn((r, d.experts), g, dt, dev)), r, positional=True),
    "masked_attention": _masked_attention,
    "w4a16_linear": _w4a16_linear,
    "fp8_linear": _fp8_linear,
    "w4a16_moe": _quant_moe(int4_weight, 32),
    "fp8_moe": _quant_moe(fp8_weight, (128, 128)),
}


def kernel_ops(kernels: KernelSet) -> list[str]:
    """Every op of ``kernels``: its callable fields, in declaration order (a new op is listed without edits here)."""
    return [f.name for f in dataclasses.fields(kernels) if callable(getattr(kernels, f.name))]


def probes(n: int) -> list[int]:
    """The rows of an n-row launch that are compared: first, second, middle, last."""
    return sorted({0, 1, n // 2, n - 1})


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def row_mismatches(kernel: Callable, case: RowCase, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(n, r)`` for each probed row r whose output alone differs (``torch.equal``, every output of a tuple) from
    row r of the launch over rows ``0..n-1``, for each n in ``sizes`` (each ≤ ``case.rows``)."""
    bad = []
    for n in sizes:
        full = _outputs(case.call(kernel, 0, n))
        for r in probes(n):
            alone = _outputs(case.call(kernel, r, r + 1))
            if not all(torch.equal(a[0], f[r]) for a, f in zip(alone, full, strict=True)):
                bad.append((n, r))
    return bad
