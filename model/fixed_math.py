"""``exp``, ``log`` and ``sigmoid`` from IEEE-754 basic arithmetic, one torch op at a time (float32).

A transcendental torch op on the CPU runs one vectorised routine over the body of a tensor and another (the scalar
libm call) over the last ``numel % (2 × vector width)`` elements, and the two may round differently: an element's
value then depends on where it sits in the tensor — which rows share the launch — and on the CPU's vector width.
Here every step is a multiply, add, floor or bit operation, each correctly rounded (or exact) in the vector and the
scalar path alike, and each a separate kernel (no fused multiply-add): an element's bits depend on its value alone,
on every CPU code path. Cephes' single-precision polynomials, accurate to about 2 ulp.
"""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split: k * _LN2_HI is exact for |k| < 2**15
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
_EXP_MIN, _EXP_MAX = -87.33, 88.0  # below: flushed to 0 (no subnormals); above: saturates at e**88 (~1.65e38)


def _horner(coeffs: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    acc = x * coeffs[0]
    for c in coeffs[1:-1]:
        acc.add_(c).mul_(x)
    return acc.add_(coeffs[-1])


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` elementwise, float32: NaN stays NaN, values below -87.33 (-inf too) give 0, values above 88 give
    e**88 (a deterministic saturation, not inf)."""
    x = x.float()
    r = x.clamp(_EXP_MIN, _EXP_MAX)
    k = (r * _LOG2E).add_(0.5).floor_()  # [-126, 127]
    r = r.sub(k * _LN2_HI).sub_(k * _LN2_LO)  # |r| <= ln2 / 2
    p = _horner(_EXP_POLY, r).mul_(r * r).add_(r).add_(1.0)
    scale = k.to(torch.int32).add_(127).bitwise_left_shift_(23).view(torch.float32)  # 2**k, exact
    return p.mul_(scale).masked_fill_(x < _EXP_MIN, 0.0)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log elementwise of positive normal float32 values (subnormals, 0, negatives, inf, NaN are outside
    its domain: the callers' values are in [2**-24, 2**24])."""
    x = x.float()
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 126  # x = m * 2**e, m in [0.5, 1)
    m = ((bits & 0x7FFFFF) | 0x3F000000).view(torch.float32)
    low = m < 0.70710678118654752440
    e = (e - low.to(torch.int32)).float()
    f = torch.where(low, (m + m) - 1.0, m - 1.0)  # in [sqrt(0.5) - 1, sqrt(2) - 1)
    z = f * f
    y = _horner(_LOG_POLY, f).mul_(f * z)
    y.add_(e * _LN2_LO).sub_(z * 0.5)
    return y.add_(f).add_(e * _LN2_HI)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + e**-x)`` elementwise, float32."""
    return 1.0 / (exp(-x) + 1.0)
