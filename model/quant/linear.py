"""Quantized parallel linear layers: packed weights and their scales, sharded together on load.

A :class:`QuantLinear` takes the place of a Replicated/Column/MergedColumn/RowParallel linear and keeps its
sharding: output rows ``[shard * out_local, (shard + 1) * out_local)`` of each part (merged gate | up), input
columns ``[shard_in * in_local, ...)`` (row-parallel). A shard boundary must fall on a group (INT4) or block
(FP8) boundary — :mod:`model.quant.layout` checks that before any weight is read — so this rank's slice of
the scales is the matching slice of the scale grid.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from model.kernel_select import KernelSet, reference_kernels
from model.quant.config import INT4, QuantConfig
from model.quant.reference import dequant_fp8, dequant_int4
from parallelism.comm import Comm
from parallelism.linear import CheckpointTensor, ShardedModule, TensorSource, copy_into


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_shape(rows: int, cols: int):
    """Loader of a compressed-tensors ``weight_shape``: it must say ``[rows, cols]``."""
    def fn(src: TensorSource) -> None:
        got = [int(v) for v in src.read().tolist()]
        if got != [rows, cols]:
            where = f"{getattr(src, 'name', 'weight_shape')} in {getattr(src, 'file', 'the checkpoint')}"
            raise ValueError(f"{where} is {got}, expected {[rows, cols]}")
    return fn


def read_block(src: TensorSource, r0: int, nr: int, c0: int, nc: int) -> torch.Tensor:
    """Rows ``[r0, r0+nr)`` × columns ``[c0, c0+nc)`` of a 2-D source, reading from the file only the dim that
    is cut (a layer cuts rows or columns, never both; if both, the columns are cut in memory)."""
    rows, cols = src.shape
    if nc == cols:
        return src.narrow(0, r0, nr) if nr != rows else src.read()
    part = src.narrow(1, c0, nc)
    return part if nr == rows else part.narrow(0, r0, nr)


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's share of the output: name prefix (``""`` = the module itself), full rows,
    local rows, which shard of the rows."""

    name: str
    full_out: int
    local_out: int
    shard: int


@dataclass(frozen=True)
class InSplit:
    """The input (reduction) dim: full columns, local columns, which shard."""

    full_in: int
    local_in: int
    shard: int


class QuantLinear(ShardedModule):
    """``y = x Wᵀ`` with ``W`` stored quantized (``cfg.method``); ``comm``: all-reduce after (row-parallel).

    INT4: ``qweight [out, in/8]`` int32, ``scale [out, in/G]``. FP8: ``qweight [out, in]`` e4m3,
    ``scale [Σ⌈out_part/Bo⌉, ⌈in/Bi⌉]`` fp32 (``out``, ``in``: this rank's). The kernel comes from the kernel
    set (``w4a16_linear``, or ``fp8_linear``: W8A8 where the device has FP8, else W8A16).
    """

    def __init__(self, cfg: QuantConfig, parts: list[Part], split: InSplit, comm: Comm | None = None,
                 reduce: bool = False, dtype=torch.float32, names_relative_to_parent: bool = False):
        super().__init__()
        self.cfg, self.parts, self.split = cfg, parts, split
        self.dtype = dtype  # the model's (activations') dtype: what ``weight`` dequantizes to
        self.comm, self.reduce = comm, reduce
        self.names_relative_to_parent = names_relative_to_parent
        out, k = sum(p.local_out for p in parts), split.local_in
        if cfg.method == INT4:
            g = cfg.group_size
            qweight = torch.empty(out, k // cfg.pack_factor, dtype=torch.int32)
            scale = torch.empty(out, k // g, dtype=dtype)
        else:
            bo, bi = cfg.block
            qweight = torch.empty(out, k, dtype=torch.float8_e4m3fn)
            scale = torch.empty(sum(cdiv(p.local_out, bo) for p in parts), cdiv(k, bi), dtype=torch.float32)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.kernels: KernelSet = reference_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out_local]
        if self.cfg.method == INT4:
            y = self.kernels.w4a16_linear(x, self.qweight, self.scale, self.cfg.group_size)
        else:
            y = self.kernels.fp8_linear(x, self.qweight, self.scale, self.cfg.block)
        return self.comm.all_reduce(y) if self.reduce else y

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized local weight ``[out, in]`` in the model's dtype, computed on each call (as DeepSeek's
        inference code does): for code that reads weights directly (MLA's absorbed ``kv_b_proj``)."""
        if self.cfg.method == INT4:
            return dequant_int4(self.qweight, self.scale, self.cfg.group_size, self.dtype)
        parts, row = [], 0
        for p, scale in zip(self.parts, self._scale_rows(), strict=True):
            parts.append(dequant_fp8(self.qweight[row:row + p.local_out], scale, self.cfg.block, self.dtype))
            row += p.local_out
        return torch.cat(parts)

    def _scale_rows(self) -> list[torch.Tensor]:
        """The FP8 scale grid split per part."""
        return list(self.scale.split([cdiv(p.local_out, self.cfg.block[0]) for p in self.parts]))

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        row = srow = 0
        for p in self.parts:
            pre = f"{p.name}." if p.name else ""
            if self.cfg.method == INT4:
                yield from self._int4_tensors(pre, p, row)
            else:
                yield from self._fp8_tensors(pre, p, row, srow)
                srow += cdiv(p.local_out, self.cfg.block[0])
            row += p.local_out

    def _int4_tensors(self, pre: str, p: Part, row: int) -> Iterator[CheckpointTensor]:
        s, g, f = self.split, self.cfg.group_size, self.cfg.pack_factor
        rows = slice(row, row + p.local_out)

        def load(dst: torch.Tensor, per_col: int):
            def fn(src: TensorSource) -> None:
                n = s.local_in // per_col
                copy_into(dst[rows], read_block(src, p.shard * p.local_out, p.local_out, s.shard * n, n))
            return fn
        yield CheckpointTensor(f"{pre}weight_packed", (p.full_out, s.full_in // f), load(self.qweight, f),
                               quantized=True)
        yield CheckpointTensor(f"{pre}weight_scale", (p.full_out, s.full_in // g), load(self.scale, g))
        yield CheckpointTensor(f"{pre}weight_shape", (2,), check_shape(p.full_out, s.full_in), quantized=True)

    def _fp8_tensors(self, pre: str, p: Part, row: int, srow: int) -> Iterator[CheckpointTensor]:
        s, (bo, bi) = self.split, self.cfg.block
        n_srow = cdiv(p.local_out, bo)

        def load_w(src: TensorSource) -> None:
            block = read_block(src, p.shard * p.local_out, p.local_out, s.shard * s.local_in, s.local_in)
            copy_into(self.qweight[row:row + p.local_out], block)

        def load_s(src: TensorSource) -> None:
            block = read_block(src, p.shard * p.local_out // bo, n_srow, s.shard * s.local_in // bi,
                               cdiv(s.local_in, bi))
            copy_into(self.scale[srow:srow + n_srow], block)
        yield CheckpointTensor(f"{pre}weight", (p.full_out, s.full_in), load_w, quantized=True)
        yield CheckpointTensor(f"{pre}weight_scale_inv", (cdiv(p.full_out, bo), cdiv(s.full_in, bi)), load_s)
