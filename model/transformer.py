"""The decoder stack shared by DeepSeek-V3/Kimi and Qwen3-MoE; module names mirror HF checkpoint names."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from model.attention import GQAAttention, MLAAttention
from model.batch import ForwardBatch
from model.config import ModelConfig
from model.kernel_select import KernelSet, reference_kernels
from model.layers import GatedMLP, RMSNorm
from model.layout_fit import check_layout_fits
from model.moe import MoE
from model.quant.layout import quantize_modules
from model.rope import Rotary
from parallelism.comm import ParallelGroups
from parallelism.dispatch import make_dispatcher
from parallelism.linear import CheckpointTensor, ParallelLMHead, ShardedModule, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, groups: ParallelGroups, rotary: Rotary, dtype):
        super().__init__()
        attn_cls = MLAAttention if cfg.mla is not None else GQAAttention
        self.self_attn = attn_cls(cfg, layer, groups.attn_tp, rotary, dtype)
        if cfg.moe_layers[layer]:
            placement = groups.layout.expert_placement(cfg.moe.num_experts, sum(cfg.moe_layers[:layer]))
            self.mlp = MoE(cfg, groups, placement, make_dispatcher(groups, placement), dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, groups.attn_tp, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, cos, sin)
        normed, x = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm
        return x + self.mlp(normed)


ROPE_HEADROOM = 1024  # rope positions past max_position_embeddings: deeper than any draft tree


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype):
        super().__init__()
        # past the context: a tree verified at the last position reaches a few positions further
        self.rotary = Rotary(cfg.rope, cfg.max_position_embeddings + ROPE_HEADROOM)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, groups.attn_tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, groups, self.rotary, dtype)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """``forward(batch)`` → final hidden states ``[T, H]``; ``logits(hidden)`` → ``[T, vocab]`` on
    attention-TP rank 0 (None on the other ranks of the group)."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype=torch.float32):
        super().__init__()
        check_layout_fits(cfg, groups.layout)  # what preflight checks before ranks start, for direct callers
        self.cfg, self.groups = cfg, groups
        self.model = Backbone(cfg, groups, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, groups.attn_tp, dtype)
        if cfg.quant is not None:
            quantize_modules(self, cfg)
        self.kernels: KernelSet = reference_kernels()  # the set every module calls (use_kernels), for callers

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and activations') dtype."""
        return self.model.norm.weight.dtype

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, capture: tuple[int, ...] = ()):
        """Final hidden states ``[T, H]``; with ``capture`` (layer ids) also the concatenated outputs of
        those layers ``[T, len(capture)*H]`` (HF ``hidden_states[i + 1]``; the DFlash drafter's input)."""
        m = self.model
        x = m.embed_tokens(batch.input_ids)
        cos, sin = m.rotary.cos_sin(batch.positions, x.dtype)
        captured = []
        for i, layer in enumerate(m.layers):
            x = layer(x, batch, cos, sin)
            if i in capture:
                captured.append(x)
        hidden = m.norm(x)
        return (hidden, torch.cat(captured, dim=-1)) if capture else hidden

    def place(self, device: torch.device | str) -> CausalLM:
        """Moves weights, the rope table and the dispatchers' routing tables to ``device``."""
        self.to(device)
        self.model.rotary.place(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.dispatcher.to(device)
        return self

    def use_kernels(self, kernels: KernelSet) -> CausalLM:
        """Every attention, expert, MLP and norm module calls ``kernels`` from now on, every projection
        ``kernels.linear`` (see ``model.kernel_select``); a batch-invariant set also makes this rank's reductions
        over ranks sum in rank order (``parallelism.comm.CommMode``)."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels
            if isinstance(module, ShardedModule):
                module.matmul = kernels.linear
        self.kernels = kernels
        self.groups.mode.ordered = kernels.batch_invariant
        return self

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    @torch.no_grad()
    def logits_everywhere(self, hidden: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocab logits on every attention-TP rank (speculative steps: every rank walks the tree);
        ``head_weight``: this rank's LM-head shard in another dtype (drafting)."""
        return self.lm_head.forward_all(hidden, head_weight)

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def checkpoint_plan(self) -> Iterator[tuple[str, CheckpointTensor]]:
        """Every checkpoint tensor this rank needs, by full HF name."""
        for path, module in self.named_modules():
            if not isinstance(module, ShardedModule):
                continue
            prefix = path.rsplit(".", 1)[0] if getattr(module, "names_relative_to_parent", False) else path
            for ct in module.checkpoint_tensors():
                name = f"{prefix}.{ct.suffix}"
                if path == "lm_head" and self.cfg.tie_word_embeddings:
                    name = "model.embed_tokens.weight"
                yield name, ct
