"""Rotary position embeddings: default and YaRN (with mscale), rotate-half or interleaved pairs."""

from __future__ import annotations

import math

import torch

from model.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    dim, base = cfg.dim, cfg.theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    return (1.0 / (cfg.factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight


class Rotary:
    """cos/sin tables for one model; ``apply`` rotates ``[T, heads, dim]`` at ``positions [T]``."""

    def __init__(self, cfg: RopeConfig):
        self.cfg = cfg
        if cfg.kind == "yarn":
            self.inv_freq = _yarn_inv_freq(cfg)
            if cfg.attention_factor is not None:
                self.attention_factor = float(cfg.attention_factor)
            elif cfg.mscale and cfg.mscale_all_dim:
                ratio = yarn_mscale(cfg.factor, cfg.mscale) / yarn_mscale(cfg.factor, cfg.mscale_all_dim)
                self.attention_factor = ratio
            else:
                self.attention_factor = yarn_mscale(cfg.factor)
        else:
            self.inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, cfg.dim, 2, dtype=torch.float32) / cfg.dim))
            self.attention_factor = 1.0

    def softmax_scale_multiplier(self) -> float:
        """DeepSeek's extra softmax scale under YaRN: ``mscale(factor, mscale_all_dim)**2``."""
        if self.cfg.kind == "yarn" and self.cfg.mscale_all_dim:
            m = yarn_mscale(self.cfg.factor, self.cfg.mscale_all_dim)
            return m * m
        return 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` → cos, sin ``[T, 1, dim/2]`` scaled by the attention factor."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, dim]`` → rotated. Interleaved input pairs come out de-interleaved
        (evens then odds), identically for q and k, so q·k is unchanged."""
        if self.cfg.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
