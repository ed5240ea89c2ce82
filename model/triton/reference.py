"""Former home of the torch references, now :mod:`model.kernels`; these names stay only for
``scripts/gpu_check.py`` (owned by the bench refactor). Delete this module once it imports ``model.kernels``."""

from model.kernels import (
    add_rms_norm,
    local_experts,
    paged_decode_gqa,
    paged_decode_mla,
    tree_verify_gqa,
    tree_verify_mla,
)

__all__ = ["add_rms_norm", "local_experts", "paged_decode_gqa", "paged_decode_mla", "tree_verify_gqa",
           "tree_verify_mla"]
