"""Does a model fit a layout? Every divisibility the sharded layers will ``divide()`` at construction, checked
from ``config.json`` alone, so a launcher refuses a bad layout before it starts a rank."""

from __future__ import annotations

from model.config import ModelConfig
from model.quant.layout import check_layout
from parallelism.layout import Layout, LayoutError


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def layout_problems(cfg: ModelConfig, layout: Layout) -> list[str]:
    """What does not divide, each naming the ``config.json`` field and the ``parallel.*`` degree; empty if it fits.
    The vocabulary needs no check: vocab-parallel layers pad the last shard."""
    tp, ep, etp = layout.attn_tp, layout.moe_ep, layout.moe_tp
    out = []
    if cfg.num_heads % tp:
        out.append(f"num_attention_heads={cfg.num_heads} is not divisible by parallel.attn_tp={tp} "
                   f"(attn_tp must divide it: {_divisors(cfg.num_heads)})")
    if cfg.mla is None and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        out.append(f"num_key_value_heads={cfg.num_kv_heads} and parallel.attn_tp={tp}: one must divide the other")
    if any(cfg.moe_layers):
        out += _expert_slot_problems(cfg, layout)
        if cfg.moe.num_experts % ep and layout.expert_slots is None:
            field = "n_routed_experts" if cfg.model_type == "deepseek_v3" else "num_experts"
            out.append(f"{field}={cfg.moe.num_experts} is not divisible by parallel.moe_ep={ep} "
                       f"(moe_ep must divide it: {_divisors(cfg.moe.num_experts)})")
        if cfg.moe.intermediate_size % etp:
            out.append(f"moe_intermediate_size={cfg.moe.intermediate_size} is not divisible by parallel.moe_tp={etp}")
        shared = cfg.moe.intermediate_size * cfg.moe.num_shared_experts
        if shared % tp:
            out.append(f"shared experts' intermediate size {shared} is not divisible by parallel.attn_tp={tp}")
    if not all(cfg.moe_layers) and cfg.intermediate_size % tp:
        out.append(f"intermediate_size={cfg.intermediate_size} (dense layers) is not divisible by "
                   f"parallel.attn_tp={tp}")
    return out


def _expert_slot_problems(cfg: ModelConfig, layout: Layout) -> list[str]:
    """An EPLB placement (``layout.expert_slots``) against the model: one row per MoE layer, valid expert ids."""
    if layout.expert_slots is None:
        return []
    moe_layers = sum(cfg.moe_layers)
    if len(layout.expert_slots) != moe_layers:
        return [f"the expert placement has {len(layout.expert_slots)} MoE layers, config.json {moe_layers}"]
    out = []
    for i in range(moe_layers):
        try:
            layout.expert_placement(cfg.moe.num_experts, i)
        except LayoutError as e:
            out.append(f"MoE layer {i}: {e}")
    return out


def check_layout_fits(cfg: ModelConfig, layout: Layout, source: str = "config.json") -> None:
    """Raises :class:`LayoutError` listing every problem of :func:`layout_problems` in one line."""
    problems = layout_problems(cfg, layout)
    if problems:
        raise LayoutError(f"{source} does not fit {layout.describe()}: {'; '.join(problems)}")
    check_layout(cfg, layout)  # a quantized checkpoint: no shard boundary inside a group or block
