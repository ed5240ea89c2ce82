"""Fused RMSNorm, optionally with the residual add in front, one row per program.

HF semantics as :func:`model.kernels.rms_norm`: normalise in fp32, cast back to the input dtype, then scale
by the weight in the promoted dtype. With a residual, ``x + residual`` is formed in the input dtype, stored
as the new residual and normalised, in one pass over the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, dim, eps, stride_x, stride_res, stride_y,
                     BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Grid ``(T,)``: row t of ``x [T, D]`` (+ ``res [T, D]``) → ``y [T, D]`` (and ``res_out [T, D]``, which
    shares x's row stride)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + d, mask=ok, other=0.0)
        tl.store(res_out_ptr + row * stride_x + d, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + d, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape, dim = x.shape, x.shape[-1]
    x2 = x.reshape(-1, dim).contiguous()
    res2 = None if residual is None else residual.reshape(-1, dim).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = None if residual is None else torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if res2 is None else res2, weight.contiguous(), y, x2 if res_out is None else res_out, dim, eps,
            x2.stride(0), x2.stride(0) if res2 is None else res2.stride(0), y.stride(0),
            BLOCK_D=block, HAS_RESIDUAL=residual is not None, num_warps=max(1, min(16, block // 256)))
    return y.view(shape), None if res_out is None else res_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]``, ``weight [D]`` → ``[..., D]`` in the promoted dtype. Reference:
    :func:`model.kernels.rms_norm`."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [..., D]`` (same dtype) → ``(rms_norm(x + residual), x + residual)``. Reference:
    :func:`model.kernels.add_rms_norm`."""
    return _launch(x, residual, weight, eps)
