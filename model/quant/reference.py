"""Torch reference kernels for quantized weights: dequantize, then matmul (the definition every faster kernel
is checked against).

Formats (shapes per rank, after sharding):

- INT4 (compressed-tensors ``pack-quantized``, symmetric): ``packed [.., out, in/8]`` int32, eight 4-bit values
  per word, the first in the lowest bits, each stored as ``q + 8``; ``scale [.., out, in/G]``;
  ``w = q * scale[:, j // G]``.
- FP8 block: ``weight [.., out, in]`` float8_e4m3fn, ``scale_inv [.., ⌈out/Bo⌉, ⌈in/Bi⌉]`` fp32;
  ``w = weight * scale_inv[i // Bo, j // Bi]``. W8A8 also quantizes activations per token in ``1 × Bi``
  groups (DeepSeek-V3 ``act_quant``: ``s = amax / 448``, ``x_q = fp8(x / s)``) and multiplies the
  dequantized values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.kernels import silu_and_mul
from parallelism.dispatch_base import ExpertInput

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[.., out, in/8]`` int32 → ``[.., out, in]`` int8 in ``[-8, 7]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [.., out, in/8, 8]
    return (nibbles.flatten(-2) - 8).to(torch.int8)


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """``packed [.., out, in/8]``, ``scale [.., out, in/G]`` → ``[.., out, in]`` in ``dtype`` (product in fp32)."""
    q = unpack_int4(packed).float()
    return (q * scale.float().repeat_interleave(group_size, dim=-1)).to(dtype)


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """``scale [.., ⌈rows/Bo⌉, ⌈cols/Bi⌉]`` → per element ``[.., rows, cols]``."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def dequant_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                dtype=torch.float32) -> torch.Tensor:
    """``weight [.., out, in]`` e4m3, ``scale_inv [.., ⌈out/Bo⌉, ⌈in/Bi⌉]`` → ``[.., out, in]`` in ``dtype``."""
    rows, cols = weight.shape[-2:]
    return (weight.float() * expand_blocks(scale_inv.float(), rows, cols, block)).to(dtype)


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantization in ``1 × group`` groups: ``x [T, K]`` → ``(x_q [T, K]`` e4m3, ``scale [T,
    ⌈K/group⌉]`` fp32) with ``x ≈ x_q * scale`` (``scale = amax / 448``; an all-zero group gets scale 1)."""
    t, k = x.shape
    pad = -k % group
    xg = F.pad(x.float(), (0, pad)).view(t, (k + pad) // group, group)
    amax = xg.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (xg / scale[..., None]).to(torch.float8_e4m3fn).view(t, k + pad)[:, :k]
    return xq, scale


def act_qdq(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` quantized by :func:`act_quant` and dequantized again, in x's dtype."""
    xq, scale = act_quant(x, group)
    return (xq.float() * scale.repeat_interleave(group, dim=-1)[:, : x.shape[1]]).to(x.dtype)


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                 linear: Callable = F.linear) -> torch.Tensor:
    """``x [T, in]`` @ dequantized ``[out, in]``ᵀ → ``[T, out]``; ``linear``: the matmul (``model.invariant``'s in
    batch-invariant mode)."""
    return linear(x, dequant_int4(packed, scale, group_size, x.dtype))


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 linear: Callable = F.linear) -> torch.Tensor:
    """FP8 weights, unquantized activations (devices without FP8, sm < 89; the CPU)."""
    return linear(x, dequant_fp8(weight, scale_inv, block, x.dtype))


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                linear: Callable = F.linear) -> torch.Tensor:
    """FP8 weights and per-token ``1 × block[1]`` FP8 activations (DeepSeek-V3's inference scheme)."""
    return linear(act_qdq(x, block[1]), dequant_fp8(weight, scale_inv, block, x.dtype))


Expert = Callable[[int, torch.Tensor], torch.Tensor]  # (expert e, its rows [n, H]) -> its MLP's output [n, H]


def _experts(inp: ExpertInput, expert: Expert) -> torch.Tensor:
    """Weighted sum over each row's local experts, added expert by expert (``index_add_``). Returns ``[N, H]``."""
    x = inp.hidden
    out = torch.zeros_like(x)
    for e in torch.unique(inp.slots[inp.slots >= 0]).tolist():
        rows, choice = (inp.slots == e).nonzero(as_tuple=True)
        w = inp.weights[rows, choice].to(x.dtype)[:, None]
        out.index_add_(0, rows, expert(e, x[rows]) * w)
    return out


def int4_mlp(gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor, down_packed: torch.Tensor,
             down_scale: torch.Tensor, group_size: int, dtype: torch.dtype, linear: Callable = F.linear,
             act: Callable = silu_and_mul) -> Expert:
    """Each expert's SiLU-gated MLP on its INT4 weights (shapes as :func:`w4a16_moe`), dequantized to ``dtype``;
    ``linear``, ``act``: the matmul and the activation."""
    def expert(e: int, xr: torch.Tensor) -> torch.Tensor:
        h = act(linear(xr, dequant_int4(gate_up_packed[e], gate_up_scale[e], group_size, dtype)))
        return linear(h, dequant_int4(down_packed[e], down_scale[e], group_size, dtype))
    return expert


def fp8_mlp(gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
            block: tuple[int, int], dtype: torch.dtype, quantize_acts: bool, linear: Callable = F.linear,
            act: Callable = silu_and_mul) -> Expert:
    """Each expert's SiLU-gated MLP on its FP8 block weights (shapes as :func:`fp8_moe`); ``quantize_acts``: both
    GEMM inputs quantized per token (W8A8)."""
    qdq = (lambda t: act_qdq(t, block[1])) if quantize_acts else (lambda t: t)

    def expert(e: int, xr: torch.Tensor) -> torch.Tensor:
        h = act(linear(qdq(xr), dequant_fp8(gate_up[e], gate_up_scale[e], block, dtype)))
        return linear(qdq(h), dequant_fp8(down[e], down_scale[e], block, dtype))
    return expert


def w4a16_moe(inp: ExpertInput, gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor,
              down_packed: torch.Tensor, down_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Routed experts with INT4 weights: ``gate_up_packed [E, 2I, H/8]``, ``gate_up_scale [E, 2I, H/G]`` (gate |
    up rows), ``down_packed [E, H, I/8]``, ``down_scale [E, H, I/G]``; ``inp`` as ``LocalExperts.forward``
    (sorted rows or DeepEP's packed layout, read through ``slots``). Returns ``[N, H]``."""
    return _experts(inp, int4_mlp(gate_up_packed, gate_up_scale, down_packed, down_scale, group_size,
                                  inp.hidden.dtype))


def fp8_moe(inp: ExpertInput, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
            down_scale: torch.Tensor, block: tuple[int, int], quantize_acts: bool) -> torch.Tensor:
    """Routed experts with FP8 block weights: ``gate_up [E, 2I, H]``, ``gate_up_scale [E, 2I/Bo, ⌈H/Bi⌉]``,
    ``down [E, H, I]``, ``down_scale [E, ⌈H/Bo⌉, I/Bi]``. ``quantize_acts``: W8A8 (both GEMM inputs quantized
    per token), else W8A16. Returns ``[N, H]``."""
    return _experts(inp, fp8_mlp(gate_up, gate_up_scale, down, down_scale, block, inp.hidden.dtype, quantize_acts))


def w8a16_moe(inp, gate_up, gate_up_scale, down, down_scale, block):
    """:func:`fp8_moe` without activation quantization."""
    return fp8_moe(inp, gate_up, gate_up_scale, down, down_scale, block, quantize_acts=False)


def w8a8_moe(inp, gate_up, gate_up_scale, down, down_scale, block):
    """:func:`fp8_moe` with per-token ``1 × Bi`` activation quantization."""
    return fp8_moe(inp, gate_up, gate_up_scale, down, down_scale, block, quantize_acts=True)
