"""The ``tl.dot`` precision the Triton kernels (and their ahead-of-time compile) pass for each operand dtype."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: ``"ieee"`` for fp32 (Triton's default on NVIDIA is
    TF32, about 1e-3 off the fp32 references, and the interpreter ignores the setting, so CPU tests could not
    see it); Triton's default ``"tf32"`` otherwise (it only affects fp32 operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"
