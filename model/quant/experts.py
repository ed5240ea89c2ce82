"""The routed experts a rank holds, with quantized weights (takes the place of ``LocalExperts``).

Same placement and expert-TP split as ``LocalExperts``: ``global_ids`` in local-slot order, each expert's
intermediate dim cut into ``moe_tp`` pieces (gate/up rows, down columns), which must fall on group or block
boundaries (:mod:`model.quant.layout`). Buffers (``n`` local experts, ``I`` = this rank's intermediate):

- INT4: ``w13 [n, 2I, H/8]`` int32, ``w13_scale [n, 2I, H/G]``; ``w2 [n, H, I/8]``, ``w2_scale [n, H, I/G]``.
- FP8:  ``w13 [n, 2I, H]`` e4m3, ``w13_scale [n, 2I/Bo, ⌈H/Bi⌉]``; ``w2 [n, H, I]``, ``w2_scale [n, ⌈H/Bo⌉, I/Bi]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from model.kernel_select import KernelSet, check_unsummed, reference_kernels
from model.quant.config import INT4, QuantConfig
from model.quant.linear import cdiv, check_shape, read_block
from parallelism.dispatch_base import ExpertInput
from parallelism.linear import CheckpointTensor, ShardedModule, TensorSource, copy_into


class QuantExperts(ShardedModule):
    """Quantized routed experts; ``forward`` as ``LocalExperts.forward`` through the kernel set's ``w4a16_moe``
    or ``fp8_moe``."""

    def __init__(self, cfg: QuantConfig, global_ids: list[int], hidden: int, full_inter: int, inter: int,
                 tp_rank: int, dtype=torch.float32):
        super().__init__()
        self.cfg, self.global_ids, self.hidden = cfg, global_ids, hidden
        self.full_inter, self.inter, self.tp_rank = full_inter, inter, tp_rank
        n, h, i = len(global_ids), hidden, inter
        if cfg.method == INT4:
            f, g = cfg.pack_factor, cfg.group_size
            shapes = dict(w13=((n, 2 * i, h // f), torch.int32), w13_scale=((n, 2 * i, h // g), dtype),
                          w2=((n, h, i // f), torch.int32), w2_scale=((n, h, i // g), dtype))
        else:
            bo, bi = cfg.block
            e4m3 = torch.float8_e4m3fn
            shapes = dict(w13=((n, 2 * i, h), e4m3), w13_scale=((n, 2 * (i // bo), cdiv(h, bi)), torch.float32),
                          w2=((n, h, i), e4m3), w2_scale=((n, cdiv(h, bo), i // bi), torch.float32))
        for name, (shape, dt) in shapes.items():
            self.register_buffer(name, torch.empty(shape, dtype=dt))
        self.kernels: KernelSet = reference_kernels()

    def forward(self, inp: ExpertInput) -> torch.Tensor:  # -> [N, H], or [N, k, H] when inp.unsummed
        check_unsummed(inp, self.kernels)
        if self.cfg.method == INT4:
            return self.kernels.w4a16_moe(inp, self.w13, self.w13_scale, self.w2, self.w2_scale, self.cfg.group_size)
        return self.kernels.fp8_moe(inp, self.w13, self.w13_scale, self.w2, self.w2_scale, self.cfg.block)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        for slot, e in enumerate(self.global_ids):
            for half, name in enumerate(("gate_proj", "up_proj")):
                yield from self._tensors(f"{e}.{name}", slot, half, out_cut=True)
            yield from self._tensors(f"{e}.down_proj", slot, 0, out_cut=False)

    def _tensors(self, name: str, slot: int, half: int, out_cut: bool) -> Iterator[CheckpointTensor]:
        """gate/up (``out_cut``: rows of the intermediate dim are cut) or down (its columns are)."""
        c, h, i, full, r = self.cfg, self.hidden, self.inter, self.full_inter, self.tp_rank
        out_full, in_full = (full, h) if out_cut else (h, full)
        w, s = (self.w13, self.w13_scale) if out_cut else (self.w2, self.w2_scale)

        def loader(dst: torch.Tensor, rows_per: int, cols_per: int, n_rows: int, n_cols: int):
            """Copies this rank's block: rows/cols per stored entry (1, G, 8, Bo, Bi), local extents."""
            def fn(src: TensorSource) -> None:
                if out_cut:
                    block = read_block(src, r * i // rows_per, n_rows, 0, n_cols)
                    copy_into(dst[slot, half * n_rows:(half + 1) * n_rows], block)
                else:
                    copy_into(dst[slot], read_block(src, 0, n_rows, r * i // cols_per, n_cols))
            return fn
        if c.method == INT4:
            f, g = c.pack_factor, c.group_size
            rows = i if out_cut else h
            cols_w, cols_s = (h // f, h // g) if out_cut else (i // f, i // g)
            yield CheckpointTensor(f"{name}.weight_packed", (out_full, in_full // f),
                                   loader(w, 1, f, rows, cols_w), quantized=True)
            yield CheckpointTensor(f"{name}.weight_scale", (out_full, in_full // g), loader(s, 1, g, rows, cols_s))
            yield CheckpointTensor(f"{name}.weight_shape", (2,), check_shape(out_full, in_full),
                                   quantized=True)
        else:
            bo, bi = c.block
            rows_w, cols_w = (i, h) if out_cut else (h, i)
            rows_s, cols_s = (i // bo, cdiv(h, bi)) if out_cut else (cdiv(h, bo), i // bi)
            yield CheckpointTensor(f"{name}.weight", (out_full, in_full), loader(w, 1, 1, rows_w, cols_w),
                                   quantized=True)
            yield CheckpointTensor(f"{name}.weight_scale_inv", (cdiv(out_full, bo), cdiv(in_full, bi)),
                                   loader(s, bo, bi, rows_s, cols_s))

