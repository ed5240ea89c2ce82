"""Triton kernels for the GPU path, each paired with a torch reference.

- :mod:`model.triton.reference`: the torch references and graph-safe torch helpers (no triton import).
- :mod:`model.triton.moe`: fused MoE grouped GEMM over locally held experts.
- :mod:`model.triton.attention`: paged decode and tree-verify attention, GQA and MLA (absorbed form).
- :mod:`model.triton.norm`: fused RMSNorm (+ residual add).
- :mod:`model.triton.aot`: ahead-of-time compile of every kernel for a GPU target (runs without a GPU).
- :mod:`model.triton.cases`: random inputs shared by the tests and ``scripts/gpu_check.py``.

Selection between a kernel and its reference happens in one place, :func:`model.kernel_select.select_kernels`.
This package's ``__init__`` imports nothing, so the references load where triton does not.
"""
