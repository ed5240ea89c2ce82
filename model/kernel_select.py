"""Choose, once per device, between the Triton kernels and their torch references.

:func:`select_kernels` returns a :class:`KernelSet`: one callable per op, with the reference's call
signature, and ``reasons[op]`` saying which implementation was chosen and why. Triton is chosen on a CUDA
device of compute capability ≥ 8.0 when ``triton`` imports; anything else gets the references. The Triton
modules are imported only then, so this module loads (and the references run) where triton is absent.

Ops and their references (signatures in :mod:`model.kernels`):

============================  ===============================================================
``rms_norm``                  ``(x, weight, eps)`` → :func:`model.kernels.rms_norm`
``add_rms_norm``              ``(x, residual, weight, eps)`` → ``(normed, new_residual)``
``moe_experts``               ``(inp: ExpertInput, w_gate_up, w_down)`` → ``LocalExperts.forward``
``paged_decode_gqa``          ``(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)``
``paged_decode_mla``          ``(q_lat, q_pe, latent_cache, rope_cache, block_tables, context_lens, block_size, scale)``
``tree_verify_gqa``           ``paged_decode_gqa``'s arguments with ``q [B, N, H, D]``, + ``tree_mask=`` or ``parents=``
``tree_verify_mla``           ``paged_decode_mla``'s arguments with a node dim, + ``tree_mask=`` or ``parents=``
``w4a16_linear``              ``(x, packed, scale, group_size)`` → :func:`model.quant.reference.w4a16_linear`
``fp8_linear``                ``(x, weight, scale_inv, block)`` → ``w8a8_linear`` (FP8 device) or ``w8a16_linear``
``w4a16_moe``                 ``(inp, w13, w13_scale, w2, w2_scale, group_size)`` → ``quant.reference.w4a16_moe``
``fp8_moe``                   ``(inp, w13, w13_scale, w2, w2_scale, block)`` → ``w8a8_moe`` or ``w8a16_moe``
``linear``                    ``(x, weight, bias=None)`` → ``F.linear`` (every parallel linear, router, LM head)
``head_matmul``               ``(x [T, h, K], w [h, K, N])`` → :func:`model.kernels.head_matmul` (MLA absorption)
``silu_and_mul``              ``(gate_up)`` → :func:`model.kernels.silu_and_mul`
``masked_attention``          ``(q, k, v, mask, scale)`` → :func:`model.kernels.masked_attention` (invariant mode's
                              dynamic path: every attention row goes through it)
``sigmoid``                   ``(logits)`` → ``torch.sigmoid`` (the DeepSeek router's scores)
============================  ===============================================================

:func:`batch_invariant_kernels` turns a set into its batch-invariant variant (``engine.batch_invariant``): each row's
result independent of what shares its launch (:mod:`model.invariant`, docs/batch_invariance.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model import invariant, kernels
from model.quant import reference as qref

OPS = ("rms_norm", "add_rms_norm", "moe_experts", "paged_decode_gqa", "paged_decode_mla", "tree_verify_gqa",
       "tree_verify_mla", "linear", "head_matmul", "silu_and_mul", "masked_attention", "sigmoid")
BACKENDS = ("auto", "triton", "torch")
QUANT_OPS = ("w4a16_linear", "fp8_linear", "w4a16_moe", "fp8_moe")
MIN_CAPABILITY = (8, 0)  # bf16 tl.dot
FP8_CAPABILITY = (8, 9)  # e4m3 tensor cores (Ada, Hopper, Blackwell)


@dataclass(frozen=True)
class KernelSet:
    """One implementation per op (see the module docstring for signatures) and why each was chosen."""

    rms_norm: Callable
    add_rms_norm: Callable
    moe_experts: Callable
    paged_decode_gqa: Callable
    paged_decode_mla: Callable
    tree_verify_gqa: Callable
    tree_verify_mla: Callable
    linear: Callable = F.linear
    head_matmul: Callable = kernels.head_matmul
    silu_and_mul: Callable = kernels.silu_and_mul
    masked_attention: Callable = kernels.masked_attention
    sigmoid: Callable = torch.sigmoid  # the DeepSeek router's scores
    reasons: dict[str, str] = field(default_factory=dict)
    graph_safe: bool = False  # no host synchronisation in any op: the Triton set (the references read lengths/counts)
    w4a16_linear: Callable = qref.w4a16_linear
    fp8_linear: Callable = qref.w8a16_linear
    w4a16_moe: Callable = qref.w4a16_moe
    fp8_moe: Callable = qref.w8a16_moe
    batch_invariant: bool = False  # every op row-invariant; attention layers send every row through the same path
    invariant_of: KernelSet | None = None  # the set a batch-invariant one was made from (:func:`launch_kernels`)
    backend: str = "torch"  # "triton" for the Triton set


def native_bf16_matmul(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 natively (faster than fp32): any CUDA device, or a CPU whose flags
    (Linux ``/proc/cpuinfo``) include ``avx512_bf16`` or ``amx_bf16``; False where that cannot be read."""
    if torch.device(device).type == "cuda":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def triton_unavailable(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"no CUDA device ({device.type})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton does not import ({exc})"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    return None


def reference_kernels(reason: str = "default (no kernel set chosen)", fp8_acts: bool = False) -> KernelSet:
    """The torch references for every op (what a model uses until :meth:`CausalLM.use_kernels`); ``fp8_acts``:
    FP8 layers quantize their activations (W8A8) as an FP8 device does, else W8A16."""
    return _reference_set(reason, fp8_acts)


def _reference_set(reason: str, fp8_acts: bool = False) -> KernelSet:
    """``fp8_acts``: the FP8 ops quantize activations (W8A8, what an FP8 device runs), else W8A16."""
    reasons = dict.fromkeys(OPS + QUANT_OPS, f"torch reference: {reason}")
    scheme = "W8A8, per-token 1xB activations" if fp8_acts else "W8A16, activations unquantized"
    for op in ("fp8_linear", "fp8_moe"):
        reasons[op] += f" ({scheme})"
    return KernelSet(kernels.rms_norm, kernels.add_rms_norm, kernels.local_experts, kernels.paged_decode_gqa,
                     kernels.paged_decode_mla, kernels.tree_verify_gqa, kernels.tree_verify_mla, reasons=reasons,
                     fp8_linear=qref.w8a8_linear if fp8_acts else qref.w8a16_linear,
                     fp8_moe=qref.w8a8_moe if fp8_acts else qref.w8a16_moe)


def fp8_scheme(capability: tuple[int, int]) -> tuple[bool, str]:
    """Whether FP8 layers run W8A8 (per-token FP8 activations on FP8 tensor cores) on a device of
    ``capability``, and why; W8A16 (weights dequantized in registers) where the device lacks FP8."""
    sm = f"sm_{capability[0]}{capability[1]}"
    if capability >= FP8_CAPABILITY:
        return True, f"{sm} has FP8 tensor cores: W8A8, activations quantized per token in 1xB groups"
    return False, f"{sm} < sm_89 has no FP8 tensor cores: W8A16, activations unquantized"


def _triton_set(device: torch.device) -> KernelSet:
    import triton

    from model.triton import attention, moe, norm, quant_gemm, quant_moe

    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    reason = f"triton {triton.__version__}: {name} (sm_{major}{minor})"
    w8a8, why = fp8_scheme((major, minor))
    reasons = dict.fromkeys(OPS + QUANT_OPS, reason)
    reasons["fp8_linear"] = reasons["fp8_moe"] = f"{reason}; {why}"
    return KernelSet(norm.rms_norm, norm.add_rms_norm, moe.fused_moe, attention.paged_decode_gqa,
                     attention.paged_decode_mla, attention.tree_verify_gqa, attention.tree_verify_mla,
                     reasons=reasons, graph_safe=True, w4a16_linear=quant_gemm.w4a16_linear,
                     fp8_linear=quant_gemm.w8a8_linear if w8a8 else quant_gemm.w8a16_linear,
                     w4a16_moe=quant_moe.w4a16_moe, fp8_moe=quant_moe.w8a8_moe if w8a8 else quant_moe.w8a16_moe,
                     backend="triton")


def check_unsummed(inp, kernels: KernelSet) -> None:
    """Only the batch-invariant MoE kernels return unsummed pairs (``ExpertInput.unsummed``): a dispatcher asks for
    them under ``engine.batch_invariant``, which selects those kernels; anything else is a wiring error."""
    if inp.unsummed and not kernels.batch_invariant:
        raise ValueError("the dispatcher asked for unsummed expert outputs (engine.batch_invariant's placement-"
                         f"invariant combine) but the kernel set {kernels.backend!r} is not batch-invariant")


INVARIANT_ATTENTION_OPS = ("paged_decode_gqa", "paged_decode_mla", "tree_verify_gqa", "tree_verify_mla",
                           "masked_attention")


def batch_invariant_kernels(base: KernelSet) -> KernelSet:
    """``base`` with every op replaced by its batch-invariant version (:mod:`model.invariant`), the quantized ones
    included (:func:`_invariant_quant`); RMSNorm keeps ``base``'s (row-local by construction, measured:
    tests/e2e/test_batch_invariance.py). Idempotent. On a Triton ``base`` the GEMMs, MoE and attention are Triton
    kernels and the set stays graph-safe (no op reads a length on the host); the torch set is not."""
    if base.batch_invariant:
        return base
    ops = dict(moe_experts=invariant.moe_experts, linear=invariant.linear, head_matmul=invariant.head_matmul,
               silu_and_mul=invariant.silu_and_mul, sigmoid=invariant.sigmoid,
               **{op: getattr(invariant, op) for op in INVARIANT_ATTENTION_OPS})
    reasons = {**base.reasons, **dict.fromkeys(ops, "batch-invariant torch (model.invariant)")}
    on_triton = base.backend == "triton"
    if on_triton:  # fixed-tile GEMMs, the ordered MoE combine, the row-invariant attention; SiLU·mul stays torch
        from model.triton import invariant_matmul as tim
        from model.triton import row_attention

        gemms = dict(linear=tim.linear, head_matmul=tim.head_matmul, moe_experts=tim.moe_experts)
        attention = {op: getattr(row_attention, op) for op in INVARIANT_ATTENTION_OPS}
        ops.update(gemms, **attention)
        reasons.update(dict.fromkeys(gemms, "batch-invariant triton (model.triton.invariant_matmul)"))
        reasons.update(dict.fromkeys(attention, "batch-invariant triton (model.triton.row_attention)"))
    quant, quant_reasons = _invariant_quant(base)
    ops.update(quant)
    reasons.update(quant_reasons)
    return dataclasses.replace(base, **ops, reasons=reasons, graph_safe=on_triton and base.graph_safe,
                               batch_invariant=True, invariant_of=base)


def _invariant_quant(base: KernelSet) -> tuple[dict[str, Callable], dict[str, str]]:
    """The batch-invariant version of each of ``base``'s quantized ops, looked up by identity (torch references →
    :data:`model.invariant.QUANT`, Triton kernels → their modules' ``INVARIANT``) so the W8A8/W8A16 choice ``base``
    made for its device is kept; and each one's reason. An op with no invariant version is an error."""
    table = {fn: (inv, "torch (model.invariant)") for fn, inv in invariant.QUANT.items()}
    if base.backend == "triton":
        from model.triton import quant_gemm, quant_moe

        for module in (quant_gemm, quant_moe):
            table.update({fn: (inv, "triton (fixed tiles, ordered MoE combine)")
                          for fn, inv in module.INVARIANT.items()})
    missing = [op for op in QUANT_OPS if getattr(base, op) not in table]
    if missing:
        raise ValueError(f"no batch-invariant version of {missing} ({[getattr(base, op) for op in missing]})")
    chosen = {op: table[getattr(base, op)] for op in QUANT_OPS}
    return ({op: inv for op, (inv, _) in chosen.items()},
            {op: f"batch-invariant {where}; base: {base.reasons.get(op, '')}" for op, (_, where) in chosen.items()})


def launch_kernels(current: KernelSet, batch_invariant: bool) -> KernelSet:
    """The set an engine runs (``engine.batch_invariant``): ``current``'s batch-invariant variant, or with the flag
    off the set it was made from — a model another engine switched gets its own kernels back."""
    if batch_invariant:
        return batch_invariant_kernels(current)
    return current.invariant_of if current.invariant_of is not None else current


def select_kernels(device: torch.device | str, backend: str = "auto") -> KernelSet:
    """The kernels for ``device``. ``backend``: ``auto`` (Triton where :func:`triton_unavailable` is None,
    else the references), ``torch`` (the references), ``triton`` (raises, naming the reason and the
    fallback, where Triton cannot run)."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return _reference_set("requested (backend='torch')")
    why_not = triton_unavailable(device)
    if why_not is None:
        return _triton_set(torch.device(device))
    if backend == "triton":
        raise RuntimeError(f"Triton kernels requested but unavailable: {why_not}; use backend='auto' or 'torch' "
                           "for the torch references")
    return _reference_set(why_not)
