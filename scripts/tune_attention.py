"""Tune the paged attention kernels' launch configs on a GPU and write them into model/triton/configs/attention.json.

    python scripts/tune_attention.py [--kernels mla_decode gqa_decode ...] [--batch 8] [--context 16384]
                                     [--nodes 17] [--kv-heads 1] [--budget-s 900] [--out PATH]

For each table entry of the chosen kernels (kernel, query heads per KV head, head dim) it builds a bf16 paged case
(``model.triton.cases``: ``--batch`` sequences of ``--context`` keys, 64-slot KV blocks, tree kernels with
``--nodes`` nodes of a random ancestor tree; MLA entries split their head dim into latent + 64 rope, as DeepSeek-V3
and Kimi K2; GQA cases have ``--kv-heads`` KV heads), times every candidate (``BLOCK_N``, ``BLOCK_R``,
``num_warps``, ``num_stages``) with ``triton.testing.do_bench``, checks the fastest against the torch reference
(``model.kernels``) and replaces the entry, its ``source`` saying what was measured. Keyed by shapes only: the batch
and context are the tuning point, never a lookup key. Without CUDA it exits with status 2.
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

from model.triton.launch_tables import ATTENTION_KERNELS, CONFIG_DIR

log = logging.getLogger("tune_attention")
MLA_ROPE = 64  # rope dims of DeepSeek-V3 / Kimi K2's MLA; the table's head dim is latent + rope
KV_BLOCK = 64


def candidates(split_keys: int):
    """The search space: key tiles dividing a split, row blocks, warps and pipeline stages."""
    for block_n, block_r, warps, stages in itertools.product((16, 32, 64, 128), (16, 32, 64), (2, 4, 8), (1, 2, 3)):
        if split_keys % block_n == 0:
            yield dict(BLOCK_N=block_n, BLOCK_R=block_r, num_warps=warps, num_stages=stages)


def replace_entry(table: dict, kernel: str, q_heads_per_kv: int, head_dim: int, config: dict, source: str) -> dict:
    """``table`` (attention.json's content) with the entry of one shape replaced by ``config`` and ``source``
    (added when the shape had none)."""
    row = dict(kernel=kernel, q_heads_per_kv=q_heads_per_kv, head_dim=head_dim, **config, source=source)
    key = (kernel, q_heads_per_kv, head_dim)
    entries = [e for e in table["entries"] if (e["kernel"], e["q_heads_per_kv"], e["head_dim"]) != key]
    return dict(table, entries=[*entries, row])


def _case(kernel: str, groups: int, head_dim: int, args, device: torch.device) -> tuple[str, dict]:
    """The op name of ``model.kernels`` / ``model.triton.attention`` and its bf16 arguments for one entry."""
    from model.triton import cases

    gen, lens = torch.Generator().manual_seed(0), [args.context] * args.batch
    tree = args.nodes if kernel.endswith("tree") else 0
    op = ("tree_verify_" if tree else "paged_decode_") + kernel.split("_")[0]
    if kernel.startswith("mla"):
        case = cases.mla_case(lens, groups, head_dim - MLA_ROPE, MLA_ROPE, KV_BLOCK, gen, tree, torch.bfloat16, device)
    else:
        case = cases.gqa_case(lens, groups * args.kv_heads, args.kv_heads, head_dim, KV_BLOCK, gen, tree,
                              torch.bfloat16, device)
    return op, case


def tune_entry(kernel: str, groups: int, head_dim: int, args, device: torch.device, deadline: float):
    """``(config, microseconds)`` of the fastest correct candidate for one entry, or None when none ran."""
    import triton

    from model import kernels
    from model.triton import attention

    op, case = _case(kernel, groups, head_dim, args, device)
    fn, want = getattr(attention, op), getattr(kernels, op)(**case).float()
    best = None
    for config in candidates(attention.SPLIT_KEYS):
        if time.monotonic() > deadline:
            break
        try:
            us = 1e3 * triton.testing.do_bench(lambda c=config: fn(**case, config=c), warmup=5, rep=20)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or launch is skipped
            log.debug("skip %s: %s", config, exc)
            continue
        if best is None or us < best[1]:
            best = (config, us)
    if best is not None:
        err = (fn(**case, config=best[0]).float() - want).abs().max().item()
        if err > 2e-2 * max(1.0, want.abs().max().item()):
            raise SystemExit(f"{kernel} {groups}x{head_dim}: the fastest config {best[0]} is wrong (error {err:.3g})")
    return best


def tune(table: dict, args, device: torch.device) -> dict:
    """Every chosen entry of ``table`` tuned within ``--budget-s``; entries the budget does not reach stay."""
    import triton

    name = torch.cuda.get_device_name(device)
    deadline = time.monotonic() + args.budget_s
    for e in [e for e in table["entries"] if e["kernel"] in args.kernels]:
        if time.monotonic() > deadline:
            log.warning("budget spent: the remaining entries keep what they had")
            break
        best = tune_entry(e["kernel"], e["q_heads_per_kv"], e["head_dim"], args, device, deadline)
        if best is None:
            continue
        source = (f"measured: scripts/tune_attention.py on {name}, triton {triton.__version__}, "
                  f"{time.strftime('%Y-%m-%d')}, batch {args.batch}, context {args.context}"
                  f"{f', {args.nodes} nodes' if e['kernel'].endswith('tree') else ''}: {best[1]:.1f} us")
        table = replace_entry(table, e["kernel"], e["q_heads_per_kv"], e["head_dim"], best[0], source)
        log.info("%s %dx%d: %.1f us %s", e["kernel"], e["q_heads_per_kv"], e["head_dim"], best[1], best[0])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=list(ATTENTION_KERNELS), choices=ATTENTION_KERNELS)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--nodes", type=int, default=17, help="tree kernels: nodes per sequence")
    parser.add_argument("--kv-heads", type=int, default=1, help="GQA: KV heads on the rank")
    parser.add_argument("--budget-s", type=float, default=900.0, help="stop timing after this long")
    parser.add_argument("--out", type=Path, default=CONFIG_DIR / "attention.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("tune_attention: no CUDA device here: timing launch configs needs a GPU; the shipped table keeps "
              "its untuned defaults.", file=sys.stderr)
        raise SystemExit(2)
    table = tune(json.loads((CONFIG_DIR / "attention.json").read_text()), args, torch.device("cuda"))
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
