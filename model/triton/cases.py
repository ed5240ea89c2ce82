"""Random kernel inputs shared by ``tests/model/test_triton_kernels.py`` and ``scripts/gpu_check.py``.

Each builder returns the keyword arguments of a kernel *and* of its reference (same signatures), so a check
is ``kernel(**case)`` against ``reference(**case)``: :func:`compare`. Block tables are drawn from a shuffled block pool:
non-contiguous and out of order, with unused entries set to −1 so that a read past a sequence's length
would index out of bounds instead of passing silently.
"""

from __future__ import annotations

import dataclasses

import torch

from parallelism.deepep import packed_to_expert_input
from parallelism.dispatch_base import ExpertInput


def paged_tables(lens: list[int], block_size: int, gen: torch.Generator,
                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """``block_tables [B, max_blocks]`` int32, ``context_lens [B]`` int32 and the cache's slot count."""
    need = [-(-n // block_size) for n in lens]
    pool = torch.randperm(sum(need) + 2, generator=gen)  # two spare blocks nobody owns
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = pool[start:start + n]
        start += n
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return tables.to(device), lens_t.to(device), pool.numel() * block_size


def random_parents(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, N]`` int64 trees, parents before children: node 0 is the root (−1), node i's parent < i."""
    if n == 1:
        return torch.full((batch, 1), -1, dtype=torch.long)
    upper = torch.arange(1, n).expand(batch, -1)
    rest = (torch.rand(batch, n - 1, generator=gen) * upper).long()
    return torch.cat([torch.full((batch, 1), -1, dtype=torch.long), rest], dim=1)


def _randn(shape, gen, dtype, device, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def gqa_case(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, gen: torch.Generator,
             tree: int = 0, dtype=torch.float32, device="cpu") -> dict:
    """Arguments of ``paged_decode_gqa`` (``tree=0``) or of ``tree_verify_gqa`` with ``tree`` nodes per
    sequence given as ``parents`` (every length must then be ≥ ``tree``)."""
    tables, context_lens, slots = paged_tables(lens, block_size, gen, device)
    q_shape = (len(lens), tree, heads, head_dim) if tree else (len(lens), heads, head_dim)
    case = dict(q=_randn(q_shape, gen, dtype, device), k_cache=_randn((slots, kv_heads, head_dim), gen, dtype, device),
                v_cache=_randn((slots, kv_heads, head_dim), gen, dtype, device), block_tables=tables,
                context_lens=context_lens, block_size=block_size, scale=head_dim ** -0.5)
    if tree:
        case["parents"] = random_parents(len(lens), tree, gen).to(device)
    return case


def mla_case(lens: list[int], heads: int, latent: int, rope: int, block_size: int, gen: torch.Generator,
             tree: int = 0, dtype=torch.float32, device="cpu") -> dict:
    """Arguments of ``paged_decode_mla`` (``tree=0``) or of ``tree_verify_mla`` (as :func:`gqa_case`)."""
    tables, context_lens, slots = paged_tables(lens, block_size, gen, device)
    lead = (len(lens), tree, heads) if tree else (len(lens), heads)
    case = dict(q_lat=_randn((*lead, latent), gen, dtype, device), q_pe=_randn((*lead, rope), gen, dtype, device),
                latent_cache=_randn((slots, latent), gen, dtype, device),
                rope_cache=_randn((slots, rope), gen, dtype, device), block_tables=tables,
                context_lens=context_lens, block_size=block_size, scale=(latent + rope) ** -0.5)
    if tree:
        case["parents"] = random_parents(len(lens), tree, gen).to(device)
    return case


def expert_case(rows: int, top_k: int, hidden: int, inter: int, local_experts: int, routing: str,
                gen: torch.Generator, dtype=torch.float32, device="cpu") -> dict:
    """Arguments ``inp, w_gate_up, w_down`` of ``fused_moe`` / ``model.kernels.local_experts``: ``inp`` from
    :func:`routed_input`, then the weights of ``local_experts`` experts."""
    inp = routed_input(rows, top_k, hidden, local_experts, routing, gen, dtype, device)
    return dict(inp=inp, w_gate_up=_randn((local_experts, 2 * inter, hidden), gen, dtype, device, hidden ** -0.5),
                w_down=_randn((local_experts, hidden, inter), gen, dtype, device, inter ** -0.5))


def routed_input(rows: int, top_k: int, hidden: int, local_experts: int, routing: str, gen: torch.Generator,
                 dtype=torch.float32, device="cpu") -> ExpertInput:
    """``rows`` hidden rows routed to ``top_k`` experts each.

    ``routing``: ``spread`` — each row picks ``top_k`` distinct experts among ``2 * local_experts`` (half of
    them on other ranks: slot −1), local expert 0 is never picked (an expert with zero tokens);
    ``one_expert`` — every row's first choice is local slot 0, the others are remote; ``none_local`` —
    every slot −1.
    """
    if routing == "spread":
        scores = torch.rand(rows, 2 * local_experts, generator=gen)
        scores[:, 0] = -1.0
        ids = scores.topk(top_k, dim=1).indices
        slots = torch.where(ids < local_experts, ids, -1)
    elif routing == "one_expert":
        slots = torch.full((rows, top_k), -1, dtype=torch.long)
        slots[:, 0] = 0
    elif routing == "none_local":
        slots = torch.full((rows, top_k), -1, dtype=torch.long)
    else:
        raise ValueError(f"routing must be spread, one_expert or none_local, got {routing!r}")
    return ExpertInput(_randn((rows, hidden), gen, dtype, device), slots.to(device),
                       torch.rand(rows, top_k, generator=gen).to(device))


def packed_expert_case(counts: list[int], rows_per_expert: int, hidden: int, inter: int, gen: torch.Generator,
                       dtype=torch.float32, device="cpu") -> dict:
    """Arguments ``inp, w_gate_up, w_down`` of ``fused_moe`` / ``model.kernels.local_experts`` in DeepEP's
    low-latency layout: ``len(counts)`` local experts × ``rows_per_expert`` rows, expert ``e``'s first
    ``counts[e]`` rows valid and every other row NaN (garbage that must never be read)."""
    experts = len(counts)
    packed = _randn((experts, rows_per_expert, hidden), gen, dtype, device)
    for e, n in enumerate(counts):
        packed[e, n:] = float("nan")
    inp = packed_to_expert_input(packed, torch.tensor(counts, dtype=torch.int32, device=device))
    return dict(inp=inp, w_gate_up=_randn((experts, 2 * inter, hidden), gen, dtype, device, hidden ** -0.5),
                w_down=_randn((experts, hidden, inter), gen, dtype, device, inter ** -0.5))


def valid_rows_only(experts):
    """``experts(inp, w_gate_up, w_down)`` with the rows no expert owns zeroed: outputs there are unspecified
    for the packed layout, so a comparison must not look at them."""
    def run(inp: ExpertInput, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return experts(inp, w_gate_up, w_down).masked_fill((inp.slots < 0).all(dim=1, keepdim=True), 0.0)
    return run


def norm_case(rows: int, dim: int, gen: torch.Generator, residual: bool, dtype=torch.float32, device="cpu") -> dict:
    """Arguments of ``rms_norm`` (``x, weight, eps``) or, with ``residual``, of ``add_rms_norm``."""
    case = dict(x=_randn((rows, dim), gen, dtype, device), weight=_randn((dim,), gen, dtype, device), eps=1e-6)
    if residual:
        case["residual"] = _randn((rows, dim), gen, dtype, device)
    return case


def _to_fp32(value):
    """Floating tensors (also inside an ExpertInput) as fp32 copies; everything else unchanged."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, ExpertInput):
        return dataclasses.replace(value, hidden=value.hidden.float())
    return value


def _main_output(out) -> torch.Tensor:
    """The compared output: the normed rows of ``add_rms_norm``'s pair, else the output itself."""
    return out[0] if isinstance(out, tuple) else out


def compare(kernel, reference, case: dict) -> dict:
    """Kernel and reference on ``case``, both measured against the reference on fp32 copies (the truth).

    fp32 outputs pass at ``max_err ≤ 1e-4 · max(1, scale)``; fp16/bf16 ones when the kernel is at most twice as
    far from the truth as the reference in the same dtype, or within 1 % of the output's scale.
    """
    got = _main_output(kernel(**case))
    truth = _main_output(reference(**{k: _to_fp32(v) for k, v in case.items()})).float()
    low_precision = got.dtype in (torch.float16, torch.bfloat16)
    ref_err = (_main_output(reference(**case)).float() - truth).abs().max().item() if low_precision else 0.0
    err = (got.float() - truth).abs().max().item()
    scale = truth.abs().max().item()
    tol = max(2 * ref_err, 1e-2 * scale) if low_precision else 1e-4 * max(1.0, scale)
    return dict(max_err=err, ref_err=ref_err, out_scale=scale, tol=tol, ok=bool(err <= tol))
