"""Tune the fused MoE's launch configs on a GPU and write vLLM-style config files (token bucket → tiles).

    python scripts/tune_moe.py --experts 48 --inter 2048 --hidden 7168 [--top-k 8] [--buckets 1 8 64 ...]
    python scripts/tune_moe.py --experts 48 --inter 2048 --hidden 7168 --write-defaults   # no GPU needed

For each token bucket M it builds random bf16 rows routed top-k uniformly over the E local experts, times every
candidate (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages) on the whole ``fused_moe`` (align kernel and
both GEMMs) with ``triton.testing.do_bench``, checks the winner against the torch reference, and writes
``model/triton/configs/moe/E=<E>,N=<I>,K=<H>,device_name=<GPU>.json`` — read by ``model.triton.moe.table_tiles``.
``--write-defaults`` writes the ``device_name=default`` file from ``default_tiles`` instead, marked
``"_source": "untuned default"``. Without CUDA anything but ``--write-defaults`` exits with status 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from pathlib import Path

import torch

from model.triton.launch_tables import UNTUNED, moe_config_path

log = logging.getLogger("tune_moe")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


def entry(t) -> dict:
    """One bucket's entry in vLLM's field names, from a :class:`model.triton.moe.MoETiles`."""
    return dict(BLOCK_SIZE_M=t.block_m, BLOCK_SIZE_N=t.block_n, BLOCK_SIZE_K=t.block_k, GROUP_SIZE_M=t.group_m,
                num_warps=t.num_warps, num_stages=t.num_stages)


def default_table(inter: int, hidden: int, top_k: int, buckets=BUCKETS) -> dict:
    """The untuned file: ``default_tiles`` at each bucket's pair count."""
    from model.triton.moe import default_tiles

    table = {"_source": UNTUNED}
    table.update({str(m): entry(default_tiles(m * top_k, hidden, inter)) for m in buckets})
    return table


def candidates(tokens: int, top_k: int, experts: int):
    """The search space for one bucket: M blocks near the rows per expert, the usual N/K/warps/stages."""
    from model.triton.moe import MoETiles

    per_expert = max(1, tokens * top_k // experts)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)]
    for bm, bn, bk, g, w, s in itertools.product(block_ms, (32, 64, 128), (64, 128), (1, 8, 16), (4, 8), (2, 3, 4)):
        if bm * bk + bk * bn <= 128 * 256:  # skip tiles that cannot fit a few stages of shared memory
            yield MoETiles(bm, bn, bk, w, g, s)


def _case(tokens: int, top_k: int, experts: int, inter: int, hidden: int, device: torch.device):
    from parallelism.dispatch import ExpertInput

    gen = torch.Generator(device=device).manual_seed(tokens)
    slots = torch.rand(tokens, experts, generator=gen, device=device).topk(min(top_k, experts), dim=1).indices
    inp = ExpertInput(torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16), slots,
                      torch.rand(slots.shape, generator=gen, device=device))
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device, dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=device, dtype=torch.bfloat16) * inter ** -0.5
    return inp, w1, w2


def tune(args, device: torch.device) -> dict:
    """Time every candidate per bucket within ``--budget-s``; the fastest that matches the reference wins."""
    import triton

    from model.kernels import local_experts
    from model.triton import moe

    name = torch.cuda.get_device_name(device).replace(" ", "_")
    table = {"_source": f"measured: scripts/tune_moe.py on {name}, triton {triton.__version__}, "
                        f"{time.strftime('%Y-%m-%d')}; _us = fused_moe microseconds per bucket"}
    timings, deadline = {}, time.monotonic() + args.budget_s
    for m in args.buckets:
        inp, w1, w2 = _case(m, args.top_k, args.experts, args.inter, args.hidden, device)
        want = local_experts(inp, w1, w2).float()
        best = None
        for t in candidates(m, args.top_k, args.experts):
            if time.monotonic() > deadline:
                log.warning("budget spent at bucket %d: the remaining buckets keep the default", m)
                break
            try:
                run = lambda t=t, a=(inp, w1, w2): moe.fused_moe(*a, tiles=t)
                us = 1e3 * triton.testing.do_bench(run, warmup=5, rep=20)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or launch is skipped
                log.debug("skip %s: %s", t, exc)
                continue
            if best is None or us < best[0]:
                best = (us, t)
        if best is None:
            table[str(m)] = entry(moe.default_tiles(m * args.top_k, args.hidden, args.inter))
            continue
        err = (moe.fused_moe(inp, w1, w2, tiles=best[1]).float() - want).abs().max().item()
        if err > 2e-2 * max(1.0, want.abs().max().item()):
            raise SystemExit(f"bucket {m}: the fastest config {best[1]} is wrong (max error {err:.3g})")
        table[str(m)], timings[str(m)] = entry(best[1]), round(best[0], 2)
        log.info("bucket %5d: %8.1f us  %s", m, best[0], entry(best[1]))
    table["_us"] = timings
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, required=True, help="local experts E")
    parser.add_argument("--inter", type=int, required=True, help="intermediate size I of one expert (vLLM's N)")
    parser.add_argument("--hidden", type=int, required=True, help="hidden size H (K)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--buckets", type=int, nargs="+", default=list(BUCKETS))
    parser.add_argument("--budget-s", type=float, default=1800.0, help="stop timing after this long")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: model/triton/configs/moe")
    parser.add_argument("--write-defaults", action="store_true", help="write the untuned default file (no GPU)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.write_defaults:
        table, device_name = default_table(args.inter, args.hidden, args.top_k, args.buckets), "default"
    elif not torch.cuda.is_available():
        print("tune_moe: no CUDA device here: timing launch configs needs a GPU. "
              "Run it on one, or pass --write-defaults for the untuned default file.", file=sys.stderr)
        raise SystemExit(2)
    else:
        device = torch.device("cuda")
        table, device_name = tune(args, device), torch.cuda.get_device_name(device)
    path = moe_config_path(args.experts, args.inter, args.hidden, device_name)
    if args.out_dir is not None:
        path = args.out_dir / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
