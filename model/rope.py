"""Rotary position embeddings: default and YaRN (with mscale), rotate-half or interleaved pairs.

cos/sin come from a table of positions built once, in fixed chunks of :data:`CHUNK` positions, each chunk
computed by itself: a position's entry depends on the position alone — not on which positions share a step (a
vectorised ``cos`` rounds the tail of a tensor with another routine than its body) nor on how far the table reaches.
"""

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


CHUNK = 1024  # positions per table chunk


class Rotary:
    """cos/sin tables for one model; ``apply`` rotates ``[T, heads, dim]`` at ``positions [T]``."""

    def __init__(self, cfg: RopeConfig, num_positions: int = 0):
        """The table covers positions ``[0, num_positions)`` (rounded up to whole chunks); :meth:`reserve` extends
        it."""
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
        self.device = torch.device("cpu")
        self.cos = self.sin = torch.empty(0, cfg.dim // 2)  # [positions, dim/2] fp32, on self.device
        self.reserve(num_positions)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def reserve(self, num_positions: int) -> None:
        """Extends the tables to cover ``[0, num_positions)``, whole chunks at a time (entries already there stay
        as they are). Call before any CUDA-graph capture: ``cos_sin`` only gathers."""
        if num_positions <= self.num_positions:
            return
        cos, sin = [self.cos.cpu()], [self.sin.cpu()]
        for start in range(self.num_positions, num_positions, CHUNK):
            freqs = torch.arange(start, start + CHUNK, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            cos.append(freqs.cos() * self.attention_factor)
            sin.append(freqs.sin() * self.attention_factor)
        self.cos, self.sin = torch.cat(cos).to(self.device), torch.cat(sin).to(self.device)

    def place(self, device: torch.device | str) -> Rotary:
        """Moves the tables to ``device`` (a table left behind would be copied over on every call, which a
        CUDA-graph capture refuses)."""
        self.device = torch.device(device)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def softmax_scale_multiplier(self) -> float:
        """DeepSeek's extra softmax scale under YaRN: ``mscale(factor, mscale_all_dim)**2``."""
        if self.cfg.kind == "yarn" and self.cfg.mscale_all_dim:
            m = yarn_mscale(self.cfg.factor, self.cfg.mscale_all_dim)
            return m * m
        return 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` int64 (below :attr:`num_positions`) → cos, sin ``[T, 1, dim/2]`` scaled by the
        attention factor, from the tables."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, dim]`` → rotated. Interleaved input pairs come out de-interleaved
        (evens then odds), identically for q and k, so q·k is unchanged."""
        if self.cfg.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
