"""Which layers a quantized checkpoint quantizes, whether a layout cuts through a group or block, and the
swap of a built model's linear layers and experts for their quantized forms.

:func:`check_layout` is pure config math (no processes, no weights): scripts call it before any rank starts
and ``CausalLM`` calls it again before it reads a byte.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from model.config import ConfigError, ModelConfig
from model.moe import LocalExperts, Router
from model.quant.config import FP8, INT4, QuantConfig
from model.quant.experts import QuantExperts
from model.quant.linear import InSplit, Part, QuantLinear
from parallelism.layout import Layout, LayoutError
from parallelism.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear


def _cuts(cfg: ModelConfig, layout: Layout) -> Iterator[tuple[str, str, int, int, str]]:
    """Every cut a layout makes in a linear layer of ``cfg``: ``(HF module name, "out"|"in", local extent,
    shards, degree name)``; expert names use ``*`` for the expert id."""
    t = layout.attn_tp
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}"
        if cfg.mla is not None:
            m = cfg.mla
            q = "q_proj" if m.q_lora_rank is None else "q_b_proj"
            yield f"{pre}.self_attn.{q}", "out", cfg.num_heads * m.qk_head_dim // t, t, "attn_tp"
            yield (f"{pre}.self_attn.kv_b_proj", "out", cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim) // t, t,
                   "attn_tp")
            yield f"{pre}.self_attn.o_proj", "in", cfg.num_heads * m.v_head_dim // t, t, "attn_tp"
        else:
            kv_shards = min(t, cfg.num_kv_heads)
            yield f"{pre}.self_attn.q_proj", "out", cfg.num_heads * cfg.head_dim // t, t, "attn_tp"
            for kv in ("k_proj", "v_proj"):
                yield (f"{pre}.self_attn.{kv}", "out", cfg.num_kv_heads * cfg.head_dim // kv_shards, kv_shards,
                       "attn_tp")
            yield f"{pre}.self_attn.o_proj", "in", cfg.num_heads * cfg.head_dim // t, t, "attn_tp"
        mlps = []
        if cfg.moe_layers[i]:
            e = cfg.moe
            mlps.append((f"{pre}.mlp.experts.*", e.intermediate_size // layout.moe_tp, layout.moe_tp, "moe_tp"))
            if e.num_shared_experts:
                shared = e.intermediate_size * e.num_shared_experts
                mlps.append((f"{pre}.mlp.shared_experts", shared // t, t, "attn_tp"))
        else:
            mlps.append((f"{pre}.mlp", cfg.intermediate_size // t, t, "attn_tp"))
        for name, inter, shards, degree in mlps:
            yield f"{name}.gate_proj", "out", inter, shards, degree
            yield f"{name}.up_proj", "out", inter, shards, degree
            yield f"{name}.down_proj", "in", inter, shards, degree


def check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """Raises LayoutError naming the tensor and the degree where ``layout`` cuts a quantized layer's rows or
    columns off a group (INT4: columns in groups of ``group_size``) or block (FP8: ``block`` rows × columns),
    or where FP8 gate/up rows, stacked into one GEMM, would share a block."""
    q = cfg.quant
    if q is None:
        return
    for name, dim, local, shards, degree in _cuts(cfg, layout):
        stacked = q.method == FP8 and name.endswith(("gate_proj", "up_proj"))  # gate | up rows share one scale grid
        if (shards == 1 and not stacked) or not q.quantizes(name.replace("*", "0")):
            continue
        if shards == 1 and local % q.block[0]:
            raise LayoutError(f"{name}.weight has {local} rows, not a multiple of the FP8 block of {q.block[0]} rows: "
                              "gate_proj and up_proj are stacked and must each fill whole blocks")
        if q.method == INT4:
            unit, what = (1, "") if dim == "out" else (q.group_size, f"INT4 group of {q.group_size} columns")
        else:
            unit, what = (q.block[0], f"FP8 block of {q.block[0]} rows") if dim == "out" else \
                (q.block[1], f"FP8 block of {q.block[1]} columns")
        if local % unit:
            tensor = f"{name}.{'weight' if q.method == FP8 else 'weight_packed'}"
            raise LayoutError(f"{degree}={getattr(layout, degree)} cuts {tensor} through a quantization group: "
                              f"{shards} shards of {local} "
                              f"{'rows' if dim == 'out' else 'columns'} each, not a multiple of the {what}")


def _linear_parts(module: nn.Module) -> tuple[list[Part], InSplit, object, bool]:
    """The sharding of an unquantized parallel linear, as QuantLinear describes it."""
    out, k = module.weight.shape
    if isinstance(module, MergedColumnParallelLinear):
        parts = [Part(n, f, lo, module.shard) for n, f, lo in zip(module.names, module.full_outs, module.local_outs,
                                                                   strict=True)]
        return parts, InSplit(k, k, 0), None, False
    if isinstance(module, ColumnParallelLinear):
        return [Part("", module.full_out, out, module.shard)], InSplit(k, k, 0), None, False
    if isinstance(module, RowParallelLinear):
        c = module.comm
        return [Part("", out, out, 0)], InSplit(k * c.size, k, c.rank), c, module.reduce
    return [Part("", out, out, 0)], InSplit(k, k, 0), None, False


def _hf_names(path: str, module: nn.Module) -> list[str]:
    if isinstance(module, MergedColumnParallelLinear):
        parent = path.rsplit(".", 1)[0]
        return [f"{parent}.{n}" for n in module.names]
    return [path]


def _decide(q: QuantConfig, names: list[str], what: str) -> bool:
    flags = {n: q.quantizes(n) for n in names}
    if len(set(flags.values())) > 1:
        raise ConfigError(f"quantization_config quantizes some but not all of {what}: "
                          f"{sorted(n for n, f in flags.items() if f)} but not "
                          f"{sorted(n for n, f in flags.items() if not f)}")
    return all(flags.values())


def quantize_modules(model: nn.Module, cfg: ModelConfig) -> None:
    """Replaces, in a just-built model, every linear layer and expert block that ``cfg.quant`` quantizes by its
    quantized form (same sharding); nothing has been loaded yet."""
    q = cfg.quant
    linear_types = (ReplicatedLinear, ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
    for path, module in list(model.named_modules()):
        new = None
        if isinstance(module, linear_types):
            if _decide(q, _hf_names(path, module), path):
                if getattr(module, "bias", None) is not None:
                    raise ConfigError(f"quantized {path} has a bias: not supported")
                parts, split, comm, reduce = _linear_parts(module)
                new = QuantLinear(q, parts, split, comm, reduce, dtype=module.weight.dtype,
                                  names_relative_to_parent=isinstance(module, MergedColumnParallelLinear))
        elif isinstance(module, LocalExperts):
            names = [f"{path}.{e}.{p}" for e in range(cfg.moe.num_experts)
                     for p in ("gate_proj", "up_proj", "down_proj")]
            if _decide(q, names, f"{path} (routed experts)"):
                new = QuantExperts(q, module.global_ids, module.hidden, module.full_inter, module.inter, module.tp_rank,
                                   dtype=module.w_down.dtype)
        elif isinstance(module, Router) and cfg.model_type == "qwen3_moe" and q.method == INT4 and q.quantizes(path):
            raise ConfigError(f"quantization_config quantizes the router {path}: not supported (add it to ignore)")
        if new is not None:
            parent_path, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_path), child, new)
