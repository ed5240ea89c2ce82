"""Attention layers: DeepSeek MLA (q/kv LoRA, decoupled rope key) and Qwen3 GQA (q/k norm).

Heads are split over the attention-TP group; with fewer KV heads than ranks, KV heads are replicated
(rank r holds KV head ``r // (attn_tp / kv_heads)``).
"""

from __future__ import annotations

import torch
from torch import nn

from model.batch import ForwardBatch, KVContext, PaddedContext
from model.config import ModelConfig
from model.kernel_select import KernelSet, reference_kernels
from model.kernels import attention
from model.layers import RMSNorm
from model.rope import Rotary
from parallelism.comm import Comm
from parallelism.layout import divide
from parallelism.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear


def _mla_keys(latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached MLA entries ``[B, M, L]``, ``[B, M, dr]`` → absorbed keys ``[B, M, 1, L+dr]``, values ``[B, M, 1, L]``."""
    return torch.cat([latent, k_pe], dim=-1)[:, :, None], latent[:, :, None]


def _gqa_keys(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


def every_row(kernels: KernelSet, batch: ForwardBatch, layer: int, q: torch.Tensor, entries: tuple[torch.Tensor, ...],
              keys, scale: float, dv: int) -> torch.Tensor:
    """Stores this step's ``entries`` and attends every query row ``q [T, H, Dk]`` over its sequence's visible
    entries through ``kernels.masked_attention`` (``keys``: entries ``[B, M, ...]`` → keys, values ``[B, M, G, D]``).
    The batch-invariant path for every KV context without paged tables. Returns ``[T, H, dv]``."""
    if batch.kv.padded:
        ctx = batch.kv.store_and_gather_padded(layer, entries)
        return ctx.unpad(kernels.masked_attention(ctx.pad_queries(q), *keys(*ctx.entries), ctx.mask, scale))
    outs, start = [], 0
    for i, seq in enumerate(batch.kv.store_and_gather(layer, entries)):
        n, m = batch.query_lens[i], seq[0].shape[0]
        mask = batch.kv.mask(i)
        if mask is None:  # causal, the queries last
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
        k, v = keys(*(e[None] for e in seq))
        outs.append(kernels.masked_attention(q[None, start:start + n], k, v, mask[None], scale)[0])
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], dv)


class MLAAttention(nn.Module):
    """Multi-head latent attention. The KV context stores the normed latent ``[T, kv_lora]`` and the
    roped key ``[T, rope_dim]`` once per token; per-head K/V are expanded from them with ``kv_b_proj``."""

    def __init__(self, cfg: ModelConfig, layer: int, comm: Comm, rotary: Rotary, dtype=torch.float32):
        super().__init__()
        m = cfg.mla
        self.layer, self.mla, self.rotary = layer, m, rotary
        self.heads = divide(cfg.num_heads, comm.size, "attention heads over attn_tp")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, cfg.num_heads * m.qk_head_dim, comm, dtype=dtype)
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, cfg.num_heads * m.qk_head_dim, comm, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.kv_lora_rank + m.qk_rope_head_dim, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                              comm, dtype=dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, h, comm, dtype=dtype)
        self.scale = m.qk_head_dim ** -0.5 * rotary.softmax_scale_multiplier()
        self.kernels: KernelSet = reference_kernels()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        m, t = self.mla, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self.rotary.apply(q_pe, cos, sin)], dim=-1)  # [T, h, dn+dr]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, L]
        k_pe = self.rotary.apply(k_pe[:, None, :], cos, sin)[:, 0]  # [T, dr]
        if batch.kv.tables is not None:
            o = self._paged_kernel(q, batch.kv.store(self.layer, (latent, k_pe)), batch.kv)
            return self.o_proj(o.reshape(t, self.heads * m.v_head_dim))
        if self.kernels.batch_invariant:
            return self.o_proj(self._every_row_absorbed(q, (latent, k_pe), batch).reshape(t, self.heads * m.v_head_dim))
        if batch.kv.padded:
            ctx = batch.kv.store_and_gather_padded(self.layer, (latent, k_pe))
            o = ctx.unpad(self._absorbed(ctx.pad_queries(q), ctx))
            return self.o_proj(o.reshape(t, self.heads * m.v_head_dim))
        outs, start = [], 0
        for i, (lat, kpe) in enumerate(batch.kv.store_and_gather(self.layer, (latent, k_pe))):
            n = batch.query_lens[i]
            kv = self.kv_b_proj(lat).view(lat.shape[0], self.heads, m.qk_nope_head_dim + m.v_head_dim)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            k = torch.cat([k_nope, kpe[:, None, :].expand(-1, self.heads, -1)], dim=-1)
            outs.append(attention(q[start:start + n], k, v, self.scale, batch.kv.mask(i)))
            start += n
        o = torch.cat(outs) if outs else q.new_zeros(0, self.heads, m.v_head_dim)
        return self.o_proj(o.reshape(t, self.heads * m.v_head_dim))

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk [h, dn, L]`` and ``W_uv [h, dv, L]``: views of this rank's ``kv_b_proj`` rows."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)

    def _paged_kernel(self, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], kv: KVContext
                      ) -> torch.Tensor:
        """The kernel path (``kv.tables``): ``q [B*N, h, dn+dr]`` → ``[B*N, h, dv]`` by the paged decode or
        tree-verify MLA kernel in absorbed form, reading the latent and rope-key caches in place."""
        m, tb = self.mla, kv.tables
        b, n = tb.context_lens.shape[0], tb.num_queries
        w_uk, w_uv = self._absorb_weights()
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_lat = self.kernels.head_matmul(q_nope, w_uk)  # [T, h, L]
        args = (*caches, tb.block_tables, tb.context_lens, tb.block_size, self.scale)
        if tb.tree_mask is None:
            out = self.kernels.paged_decode_mla(q_lat, q_pe, *args)
        else:
            out = self.kernels.tree_verify_mla(q_lat.view(b, n, self.heads, -1), q_pe.reshape(b, n, self.heads, -1),
                                               *args, tree_mask=tb.tree_mask).reshape(b * n, self.heads, -1)
        return self.kernels.head_matmul(out.to(q.dtype), w_uv.transpose(1, 2))

    def _every_row_absorbed(self, q: torch.Tensor, entries: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
                            ) -> torch.Tensor:
        """Batch-invariant kernels off the paged path (prefill, mixed and graphs-off steps): every row in the
        absorbed form the paged kernels use, so a token's arithmetic does not depend on the kind of step it is
        in. ``q [T, h, dn+dr]`` → ``[T, h, dv]``."""
        m = self.mla
        w_uk, w_uv = self._absorb_weights()
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q = torch.cat([self.kernels.head_matmul(q_nope, w_uk), q_pe], dim=-1)  # [T, h, L+dr]
        out = every_row(self.kernels, batch, self.layer, q, entries, _mla_keys, self.scale, m.kv_lora_rank)
        return self.kernels.head_matmul(out, w_uv.transpose(1, 2))

    def _absorbed(self, q: torch.Tensor, ctx: PaddedContext) -> torch.Tensor:
        """A few queries per sequence (decode, tree verify) against the cached latents, without expanding
        per-head K/V: ``q_nope`` is absorbed into latent space by ``W_uk`` and the output leaves it through
        ``W_uv``. q ``[B, N, h, dn+dr]``; returns ``[B, N, h, dv]``."""
        m = self.mla
        (latent, k_pe), mask = ctx.entries, ctx.mask  # [B, M, L], [B, M, dr], [B, N, M]
        b, n = mask.shape[:2]
        w_uk, w_uv = self._absorb_weights()
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("bnhd,hdl->bnhl", q_nope, w_uk).reshape(b, n * self.heads, m.kv_lora_rank)
        q_pe = q_pe.reshape(b, n * self.heads, m.qk_rope_head_dim)
        scores = torch.baddbmm(torch.bmm(q_pe, k_pe.transpose(1, 2)), q_lat, latent.transpose(1, 2))
        scores = (scores.view(b, n, self.heads, -1) * self.scale).masked_fill(~mask[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(b, n * self.heads, -1)
        out_lat = torch.bmm(probs, latent).view(b, n, self.heads, m.kv_lora_rank)
        return torch.einsum("bnhl,hvl->bnhv", out_lat, w_uv)


class GQAAttention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, layer: int, comm: Comm, rotary: Rotary, dtype=torch.float32):
        super().__init__()
        self.layer, self.rotary, self.head_dim = layer, rotary, cfg.head_dim
        self.heads = divide(cfg.num_heads, comm.size, "attention heads over attn_tp")
        if cfg.num_kv_heads >= comm.size:
            kv_shard, kv_shards = comm.rank, comm.size
        else:  # replicate: several ranks hold the same KV head
            kv_shard, kv_shards = comm.rank // divide(comm.size, cfg.num_kv_heads, "attn_tp over KV heads"), \
                cfg.num_kv_heads
        self.kv_heads = cfg.num_kv_heads // kv_shards
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, comm, dtype=dtype)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, comm, shard=kv_shard, num_shards=kv_shards,
                                           dtype=dtype)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, comm, shard=kv_shard, num_shards=kv_shards,
                                           dtype=dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, comm, dtype=dtype)
        self.scale = d ** -0.5
        self.kernels: KernelSet = reference_kernels()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.rotary.apply(self.q_norm(self.q_proj(x).view(t, self.heads, d)), cos, sin)
        k = self.rotary.apply(self.k_norm(self.k_proj(x).view(t, self.kv_heads, d)), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, d)
        groups = self.heads // self.kv_heads
        if batch.kv.tables is not None:
            return self.o_proj(self._paged_kernel(q, batch.kv.store(self.layer, (k, v)), batch.kv).reshape(t, -1))
        if self.kernels.batch_invariant:
            o = every_row(self.kernels, batch, self.layer, q, (k, v), _gqa_keys, self.scale, d)
            return self.o_proj(o.reshape(t, self.heads * d))
        if batch.kv.padded:
            ctx = batch.kv.store_and_gather_padded(self.layer, (k, v))
            (ks, vs), mask = ctx.entries, ctx.mask  # [B, M, kvh, d], [B, N, M]
            qg = ctx.pad_queries(q).view(*mask.shape[:2], self.kv_heads, groups, d)
            scores = torch.einsum("bnkgd,bmkd->bnkgm", qg, ks) * self.scale
            scores = scores.masked_fill(~mask[:, :, None, None, :], float("-inf"))
            o = torch.einsum("bnkgm,bmkd->bnkgd", torch.softmax(scores.float(), dim=-1).to(q.dtype), vs)
            return self.o_proj(ctx.unpad(o).reshape(t, self.heads * d))
        outs, start = [], 0
        for i, (ks, vs) in enumerate(batch.kv.store_and_gather(self.layer, (k, v))):
            n = batch.query_lens[i]
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
            outs.append(attention(q[start:start + n], ks, vs, self.scale, batch.kv.mask(i)))
            start += n
        o = torch.cat(outs) if outs else q.new_zeros(0, self.heads, d)
        return self.o_proj(o.reshape(t, self.heads * d))

    def _paged_kernel(self, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], kv: KVContext
                      ) -> torch.Tensor:
        """The kernel path (``kv.tables``): ``q [B*N, h, d]`` → ``[B*N, h, d]`` by the paged decode or
        tree-verify GQA kernel, reading the K/V caches in place."""
        tb = kv.tables
        b, n = tb.context_lens.shape[0], tb.num_queries
        args = (*caches, tb.block_tables, tb.context_lens, tb.block_size, self.scale)
        if tb.tree_mask is None:
            return self.kernels.paged_decode_gqa(q, *args).to(q.dtype)
        out = self.kernels.tree_verify_gqa(q.view(b, n, self.heads, -1), *args, tree_mask=tb.tree_mask)
        return out.reshape(b * n, self.heads, -1).to(q.dtype)
