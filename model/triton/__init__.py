"""Triton kernels for the GPU path, each checked against its torch reference in :mod:`model.kernels`.

- :mod:`model.triton.moe`: fused MoE grouped GEMM over locally held experts.
- :mod:`model.triton.attention`: paged decode and tree-verify attention, GQA and MLA (absorbed form).
- :mod:`model.triton.norm`: fused RMSNorm (+ residual add).
- :mod:`model.triton.row_attention`: row-invariant paged attention for every step kind (``engine.batch_invariant``).
- :mod:`model.triton.precision`: the ``tl.dot`` precision per operand dtype.
- :mod:`model.triton.aot`: ahead-of-time compile of every kernel for a GPU target (runs without a GPU).
- :mod:`model.triton.cases`: random inputs shared by the tests and ``scripts/gpu_check.py``.

Selection between a kernel and its reference happens in one place, :func:`model.kernel_select.select_kernels`.
This package's ``__init__`` imports nothing, so importing the package does not import triton.
"""
