"""Model shapes of the cost model: the dimensions that decide bytes, FLOPs and message sizes."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide bytes, FLOPs and message sizes. MLA when ``kv_lora_rank > 0``, else GQA.

    Bytes per element: ``weight_bytes`` for attention, dense MLP, shared experts, embedding and LM head;
    ``expert_weight_bytes`` for routed experts (INT4 checkpoints: ~0.5625 = 4 bits + a bf16 scale per 32);
    ``router_bytes`` for the gate (fp32 in this engine); ``kv_bytes`` per cached element; ``act_bytes`` per
    activation element on the wire (hidden states and logits).
    """

    name: str
    num_layers: int
    num_dense_layers: int
    hidden: int
    num_heads: int
    vocab: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    num_shared_experts: int
    dense_intermediate: int
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_kv_heads: int = 0  # GQA only
    head_dim: int = 0      # GQA only
    weight_bytes: float = 2.0
    expert_weight_bytes: float = 2.0
    router_bytes: float = 4.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attn_params(self) -> tuple[int, int]:
        """Per layer: (params replicated over attention-TP, params split over attention-TP)."""
        h, n = self.hidden, self.num_heads
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            o = n * self.v_head_dim * h
            if self.q_lora_rank:
                return h * self.q_lora_rank + kv_a, self.q_lora_rank * n * qk + kv_b + o
            return kv_a, h * n * qk + kv_b + o
        d = self.head_dim
        return 0, h * n * d * 2 + 2 * h * self.num_kv_heads * d

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def kv_elems_per_token_layer(self) -> int:
        """Cached elements per token per layer for the whole model (MLA: latent + rope key; GQA: K and V)."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def total_params(self) -> int:
        repl, shard = self.attn_params
        per_moe = self.num_experts * self.expert_params + self.num_shared_experts * self.expert_params
        per_moe += self.num_experts * self.hidden
        return (self.num_layers * (repl + shard) + self.num_dense_layers * 3 * self.hidden * self.dense_intermediate
                + self.num_moe_layers * per_moe + 2 * self.vocab * self.hidden)

    def active_params(self) -> int:
        """Params one token touches: attention, dense MLP, shared + top-k routed experts, router, LM head."""
        repl, shard = self.attn_params
        per_moe = (self.top_k + self.num_shared_experts) * self.expert_params + self.num_experts * self.hidden
        return (self.num_layers * (repl + shard) + self.num_dense_layers * 3 * self.hidden * self.dense_intermediate
                + self.num_moe_layers * per_moe + self.vocab * self.hidden)

    @staticmethod
    def from_config(cfg, name: str = "", **bytes_per_element) -> ModelShape:
        """From a :class:`model.config.ModelConfig`; ``bytes_per_element`` overrides the ``*_bytes`` fields."""
        m, moe = cfg.mla, cfg.moe
        dense = sum(1 for x in cfg.moe_layers if not x)
        kw = dict(name=name or cfg.model_type, num_layers=cfg.num_layers, num_dense_layers=dense,
                  hidden=cfg.hidden_size, num_heads=cfg.num_heads, vocab=cfg.vocab_size, num_experts=moe.num_experts,
                  top_k=moe.top_k, moe_intermediate=moe.intermediate_size, num_shared_experts=moe.num_shared_experts,
                  dense_intermediate=cfg.intermediate_size)
        if m is not None:
            kw.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                      qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim)
        else:
            kw.update(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        return ModelShape(**kw, **bytes_per_element)


# Kimi K2 text model (K2.5/K2.6 wrap the same text_config). Dims from the public config.json
# (docs/records/field_notes.md,
# "Models"; qk_nope 128, v_head 128, dense intermediate 18432, as DeepSeek-V3).
KIMI_K2 = ModelShape(
    name="Kimi-K2 (bf16)", num_layers=61, num_dense_layers=1, hidden=7168, num_heads=64, vocab=163840,
    num_experts=384, top_k=8, moe_intermediate=2048, num_shared_experts=1, dense_intermediate=18432,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
# Kimi K2.5/K2.6 as deployed: INT4 routed experts (compressed-tensors, group 32, bf16 scales: 4.5 bits; an
# assumption from the public checkpoint config, not verified here), everything else bf16.
KIMI_K2_INT4 = replace(KIMI_K2, name="Kimi-K2.x (INT4 experts)", expert_weight_bytes=0.5625)
