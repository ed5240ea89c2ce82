"""The DFlash drafter: a small Qwen3-style stack fed by the target's hidden states (block diffusion drafting).

Weight and config names follow z-lab DFlash checkpoints (``fc``, ``hidden_norm``, ``layers.{i}.self_attn.
{q,k,v,o}_proj / q_norm / k_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``; ``dflash_config:
{target_layer_ids, mask_token_id, block_size}``). No embedding or LM head of its own: the target's are used.

One draft round for a request whose committed tokens end at position ``p - 1`` and whose next token
(the bonus) is ``b``: the block ``[b, MASK × (B-1)]`` at positions ``p .. p+B-1`` attends (non-causally)
to itself and to the context — the target's hidden states at ``target_layer_ids`` of positions ``< p``,
concatenated → ``fc`` → ``hidden_norm``, then each layer's k/v projections. Block rows ``1..B-1`` give the
draft distributions of positions ``p+1 .. p+B-1``.

Every projection and the MLP activation go through a kernel set (``kernels=``, :class:`model.kernel_select.KernelSet`):
the speculator passes the target's, so with ``engine.batch_invariant`` a request's draft does not depend on what
shares its launch; without one (training) they are plain ``F.linear`` and ``F.silu``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from model.checkpoint_errors import check_checkpoint_files
from model.config import RopeConfig
from model.kernel_select import KernelSet, reference_kernels
from model.rope import Rotary

PLAIN = reference_kernels("the drafter's own forward (training): F.linear, F.silu, SDPA")


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_target_layers: int = 0

    @staticmethod
    def from_hf(raw: dict) -> DFlashConfig:
        d = raw.get("dflash_config", {})
        rope = raw.get("rope_parameters") or {}
        return DFlashConfig(
            hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"], target_layer_ids=tuple(d["target_layer_ids"]),
            mask_token_id=int(d["mask_token_id"]), block_size=int(d.get("block_size", raw.get("block_size", 16))),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            num_target_layers=raw.get("num_target_layers", 0),
        )

    def to_hf(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}, "block_size": self.block_size,
            "num_target_layers": self.num_target_layers, "is_causal": False, "attention_bias": False,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
        }


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A draft layer's attention: ``(q [N, h, d], block k [N, kvh, d], block v [N, kvh, d]) → [N, h, d]``."""


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.q_norm = nn.Parameter(torch.ones(d))
        self.k_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary, kernels: KernelSet = PLAIN):
        """``x [N, H]`` → roped K ``[N, kvh, d]`` and V ``[N, kvh, d]``."""
        c, linear = self.c, kernels.linear
        k = rms(linear(x, self.k_proj.weight).view(-1, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_norm_eps)
        return rotary.apply(k, cos, sin), linear(x, self.v_proj.weight).view(-1, c.num_kv_heads, c.head_dim)

    def forward(self, x, cos, sin, rotary, attend: Attend, kernels: KernelSet = PLAIN):
        """Block rows ``x [N, H]`` → ``[N, H]``; ``attend`` is the block's attention over its context and itself
        (:data:`Attend`); projections and activation through ``kernels``."""
        c, linear = self.c, kernels.linear
        hx = rms(x, self.input_layernorm, c.rms_norm_eps)
        q = linear(hx, self.q_proj.weight).view(-1, c.num_heads, c.head_dim)
        q = rotary.apply(rms(q, self.q_norm, c.rms_norm_eps), cos, sin)
        o = attend(q, *self.kv(hx, cos, sin, rotary, kernels))
        x = x + linear(o.reshape(x.shape[0], -1), self.o_proj.weight)
        hx = rms(x, self.post_attention_layernorm, c.rms_norm_eps)
        gate_up = torch.cat([linear(hx, self.gate_proj.weight), linear(hx, self.up_proj.weight)], dim=-1)  # [N, 2I]
        return x + linear(kernels.silu_and_mul(gate_up), self.down_proj.weight)


def dense_attend(ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor | None) -> Attend:
    """Attention over context K/V ``[S, kvh, d]`` held as tensors, then the block's own keys; ``mask
    [N, S+N]`` bool (None: every row sees every key)."""
    def attend(q, bk, bv):
        k, v = torch.cat([ctx_k, bk]).transpose(0, 1), torch.cat([ctx_v, bv]).transpose(0, 1)  # [kvh, S+N, d]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                              attn_mask=None if mask is None else mask[None, None],
                                              enable_gqa=True)[0].transpose(0, 1)  # [N, h, d]
    return attend


def block_sequences(visible: torch.Tensor | None, blocks: int, block_rows: int, context_rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each draft block as its own sequence: its visible context rows in order, then its own block rows.
    ``visible [J, S]`` bool (None: one block that sees all ``S`` rows) → ``index [J, M]`` into
    ``cat([context K/V [S], block K/V [J*B]])`` and ``mask [J, B, M]`` bool, every row a visible prefix (the form
    the Triton row kernel takes: :func:`model.triton.row_attention.masked_attention`). Reads the longest
    context on the host when ``J > 1`` (the dynamic draft path only)."""
    s, b = context_rows, block_rows
    if visible is None:
        return torch.arange(s + b)[None], torch.ones(1, b, s + b, dtype=torch.bool)
    device = visible.device
    counts = visible.sum(1)  # [J]
    width = int(counts.max()) + b
    col = torch.arange(width, device=device)
    ctx = F.pad(torch.argsort((~visible).to(torch.int8), dim=1, stable=True)[:, :width - b], (0, b))  # [J, M]
    own = s + torch.arange(blocks, device=device)[:, None] * b + (col - counts[:, None])
    index = torch.where(col < counts[:, None], ctx, torch.where(col < counts[:, None] + b, own, 0))
    return index, (col < counts[:, None] + b)[:, None, :].expand(blocks, b, width)


def row_attend(ctx_k: torch.Tensor, ctx_v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
               kernels: KernelSet) -> Attend:
    """:func:`dense_attend` through ``kernels.masked_attention`` (the batch-invariant set's: each row over its
    visible keys in order, so a block's rows do not depend on the other blocks beside it), each block as its own
    sequence: ``index [J, M]``, ``mask [J, B, M]`` from :func:`block_sequences`."""
    def attend(q, bk, bv):
        k, v = torch.cat([ctx_k, bk])[index], torch.cat([ctx_v, bv])[index]  # [J, M, kvh, d]
        out = kernels.masked_attention(q.view(*mask.shape[:2], *q.shape[1:]), k, v, mask, q.shape[-1] ** -0.5)
        return out.reshape(q.shape[0], *out.shape[2:])
    return attend


class DFlashDrafter(nn.Module):
    """Trainable drafter (plain ``nn.Linear`` weights, fp32)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        # positions are the target's: the speculator reserves its target's reach (SpeculativeDecoder)
        self.rotary = Rotary(RopeConfig(dim=c.head_dim, theta=c.rope_theta), num_positions=4096)

    def place(self, device: torch.device | str) -> DFlashDrafter:
        """Moves the weights and the rope table to ``device`` (a table left behind would be copied over on every
        call, which a CUDA-graph capture refuses)."""
        self.to(device)
        self.rotary.place(device)
        return self

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor,
                   kernels: KernelSet = PLAIN) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features ``[S, k*H]`` at ``positions [S]`` → per layer (K, V) ``[S, kvh, d]`` (cacheable)."""
        ctx = rms(kernels.linear(feats, self.fc.weight), self.hidden_norm, self.c.rms_norm_eps)
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [layer.kv(ctx, cos, sin, self.rotary, kernels) for layer in self.layers]

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, ctx_kv,
                ctx_visible: torch.Tensor | None = None, kernels: KernelSet = PLAIN) -> torch.Tensor:
        """J blocks at once: ``block_emb [J, B, H]`` (the target's embeddings of ``[bonus, MASK...]``),
        ``block_pos [J, B]``, shared context K/V (``context_kv``) of S rows, ``ctx_visible [J, S]`` bool
        (which context rows block j sees; None: one block that sees all of them, attention runs unmasked).
        Returns normed hidden states ``[J, B, H]``; rows 1..B-1 feed the target's LM head. Attention is
        non-causal inside a block; blocks do not see each other. A batch-invariant ``kernels`` set attends
        row by row (:func:`row_attend`), else SDPA (:func:`dense_attend`)."""
        j, b, h = block_emb.shape
        if ctx_visible is None and j != 1:
            raise ValueError(f"{j} draft blocks need ctx_visible: blocks must not see each other's context")
        if kernels.batch_invariant:
            index, seen = (t.to(block_emb.device) for t in block_sequences(ctx_visible, j, b, ctx_kv[0][0].shape[0]))
            attends = [row_attend(ck, cv, index, seen, kernels) for ck, cv in ctx_kv]
        else:
            mask = None
            if ctx_visible is not None:
                own = torch.block_diag(*[torch.ones(b, b, dtype=torch.bool, device=block_emb.device)] * j)
                mask = torch.cat([ctx_visible.repeat_interleave(b, dim=0), own], dim=1)  # [J*B, S + J*B]
            attends = [dense_attend(ck, cv, mask) for ck, cv in ctx_kv]
        return self.run_blocks(block_emb.reshape(j * b, h), block_pos.reshape(-1), attends, kernels).view(j, b, h)

    def run_blocks(self, x: torch.Tensor, positions: torch.Tensor, attends: list[Attend],
                   kernels: KernelSet = PLAIN) -> torch.Tensor:
        """Block rows ``x [N, H]`` at ``positions [N]`` through every layer, layer i attending by ``attends[i]``
        (how the context is held is the caller's: tensors, :func:`dense_attend`; a paged store,
        ``spec_decode.static_draft``). Returns the normed hidden states ``[N, H]``."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, attend in zip(self.layers, attends, strict=True):
            x = layer(x, cos, sin, self.rotary, attend, kernels)
        return rms(x, self.norm, self.c.rms_norm_eps)

    # ---- z-lab checkpoint layout -----------------------------------------------------------------
    _RENAMES = {"input_layernorm": "input_layernorm.weight", "post_attention_layernorm":
                "post_attention_layernorm.weight", "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight", "q_proj.weight": "self_attn.q_proj.weight",
                "k_proj.weight": "self_attn.k_proj.weight", "v_proj.weight": "self_attn.v_proj.weight",
                "o_proj.weight": "self_attn.o_proj.weight", "gate_proj.weight": "mlp.gate_proj.weight",
                "up_proj.weight": "mlp.up_proj.weight", "down_proj.weight": "mlp.down_proj.weight"}

    def _hf_name(self, name: str) -> str:
        if name in ("hidden_norm", "norm"):
            return f"{name}.weight"
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            return f"layers.{i}.{self._RENAMES[rest]}"
        return name

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {self._hf_name(n): p.detach().contiguous() for n, p in self.named_parameters()}
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(self.c.to_hf(), indent=2))

    @staticmethod
    def load(ckpt_dir: str | Path) -> DFlashDrafter:
        """Loads a z-lab-layout DFlash checkpoint, one file or sharded with ``model.safetensors.index.json``; a
        missing or misshapen tensor names the tensor and the directory."""
        ckpt = Path(ckpt_dir)
        drafter = DFlashDrafter(DFlashConfig.from_hf(json.loads((ckpt / "config.json").read_text())))
        tensors = {}
        for file in sorted(set(check_checkpoint_files(ckpt).values())):
            tensors |= load_file(ckpt / file)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                key = drafter._hf_name(name)
                if key not in tensors:
                    raise ValueError(f"drafter tensor {key!r} missing from {ckpt}")
                if tuple(tensors[key].shape) != tuple(p.shape):
                    raise ValueError(f"drafter tensor {key!r} in {ckpt} has shape {list(tensors[key].shape)}, "
                                     f"expected {list(p.shape)}")
                p.copy_(tensors[key])
        return drafter.eval().requires_grad_(False)
