"""Which torch ops are row-invariant on this machine (docs/batch_invariance.md, "Findings"): one row computed alone
vs the same row inside launches of 2, 9, 17, 64 and 257 rows, bf16 and fp32, bit for bit — torch's own ops and the
invariant set's (``model.invariant``); elementwise ops: a value alone vs inside a 4099-long tensor; gloo's all-reduce
over ``--ranks`` processes (0: skip).

    python scripts/probe_row_invariance.py [--ranks 8]
    python scripts/probe_row_invariance.py --code-paths   # the same under each CPU code path (bench.cpu_paths)

``--code-paths`` reruns the probe once per code path (the native one and :data:`bench.cpu_paths.CODE_PATHS`) and
prints, per op, where it is not row-invariant and whether the path changed its bits (a digest of its output against
the native path's): a switch that changes nothing on this CPU tests nothing here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench.cpu_paths import CODE_PATHS
from model import invariant, kernels
from parallelism.dispatch_base import ExpertInput

SIZES = (2, 9, 17, 64, 257)


def rows_differ(fn, x: torch.Tensor, *side: torch.Tensor) -> list[int]:
    """Launch sizes n at which some probed row of ``fn(x[:n], *side[:n])`` differs from that row alone."""
    bad = []
    for n in SIZES:
        full = fn(x[:n], *(s[:n] for s in side))
        rows = sorted({0, n // 2, n - 1})
        if any(not torch.equal(fn(x[r:r + 1], *(s[r:r + 1] for s in side))[0], full[r]) for r in rows):
            bad.append(n)
    return bad


def dense_probes(dtype: torch.dtype) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    x, w, lm = rn(257, 256), rn(768, 256, scale=0.05), rn(4096, 256, scale=0.05)
    router = rn(16, 256, scale=0.05).float()
    wuk = rn(8, 32, 64)
    e, h, i, k = 16, 256, 128, 4
    wgu, wd = rn(e, 2 * i, h, scale=0.05), rn(e, h, i, scale=0.05)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(257)])
    wts = torch.rand(257, k, generator=g)
    kk, vv = rn(300, 8, 80), rn(300, 8, 64)

    def tiles(a):
        pad = -a.shape[0] % 16
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
        return torch.cat([F.linear(a[j:j + 16], w) for j in range(0, a.shape[0], 16)])

    def chunk_vs_decode(q):  # n-query causal chunk at the end of 300 keys; row r = decode at 300 - n + r
        return kernels.attention(q, kk, vv, 0.1)
    out = {
        "F.linear K256->N768": rows_differ(lambda a: F.linear(a, w), x),
        "F.linear K256->N4096 (LM head)": rows_differ(lambda a: F.linear(a, lm), x),
        "router F.linear(x.float(), W fp32)": rows_differ(lambda a: F.linear(a.float(), router), x),
        "F.linear in 16-row tiles": rows_differ(tiles, x),
        "einsum thd,hdl->thl (MLA absorption)": rows_differ(lambda a: torch.einsum("thd,hdl->thl", a, wuk),
                                                            rn(257, 8, 32)),
        "kernels.local_experts (grouped_mm + index_add_)": rows_differ(
            lambda a, s, ws: kernels.local_experts(ExpertInput(a, s, ws), wgu, wd), x, ids, wts),
        "kernels.rms_norm": rows_differ(lambda a: kernels.rms_norm(a, x[0], 1e-6), x),
        "softmax over 4096": rows_differ(lambda a: torch.softmax(a.float(), -1), rn(257, 4096)),
    }
    q = rn(257, 8, 80)
    bad = []
    for n in SIZES:
        full = chunk_vs_decode(q[:n])
        for r in sorted({0, n // 2, n - 1}):
            m = 300 - n + r + 1
            if not torch.equal(kernels.attention(q[r:r + 1], kk[:m], vv[:m], 0.1)[0], full[r]):
                bad.append(n)
                break
    out["kernels.attention: chunk row vs its decode"] = bad
    return out


def invariant_probes(dtype: torch.dtype) -> dict[str, list[int]]:
    """The invariant set's ops (and the router's ``torch.sigmoid`` over 16 experts, which the set replaces)."""
    g = torch.Generator().manual_seed(2)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    x, w, wh = rn(257, 150), rn(80, 150, scale=0.1), rn(4, 24, 40, scale=0.2)
    e, h, i, k = 6, 32, 16, 3
    xe, wgu, wd = rn(257, h), rn(e, 2 * i, h, scale=0.2), rn(e, h, i, scale=0.2)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(257)])
    wts = torch.rand(257, k, generator=g)
    q, kk, vv = rn(257, 1, 4, 24), rn(257, 40, 2, 24), rn(257, 40, 2, 16)
    logits = torch.randn(257, 16, generator=g)
    return {
        "invariant.linear": rows_differ(lambda a: invariant.linear(a, w), x),
        "invariant.head_matmul": rows_differ(lambda a: invariant.head_matmul(a, wh), rn(257, 4, 24)),
        "invariant.silu_and_mul": rows_differ(invariant.silu_and_mul, rn(257, 64)),
        "invariant.moe_experts": rows_differ(lambda a, s, ws: invariant.moe_experts(ExpertInput(a, s, ws), wgu, wd),
                                             xe, ids, wts),
        "invariant.masked_attention": rows_differ(
            lambda a, b, c: invariant.masked_attention(a, b, c, torch.ones(a.shape[0], 1, 40, dtype=torch.bool), 0.2),
            q, kk, vv),
        "router torch.sigmoid [T, 16] fp32": rows_differ(torch.sigmoid, logits),
        "invariant.sigmoid [T, 16] fp32": rows_differ(invariant.sigmoid, logits),
    }


def digests() -> dict[str, str]:
    """A digest of each op's output on fixed inputs: equal digests under two code paths = the same bits."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 256, generator=g), torch.randn(768, 256, generator=g) * 0.05
    a, b = np.random.default_rng(0).standard_normal((16, 64), np.float32), np.random.default_rng(1).standard_normal(
        (64, 64), np.float32)
    outs = {"F.linear fp32": F.linear(x, w), "F.linear bf16": F.linear(x.bfloat16(), w.bfloat16()),
            "torch.bmm fp32": torch.bmm(x.view(4, 16, 256), w[:256].expand(4, -1, -1).contiguous()),
            "torch.exp fp32": torch.exp(x), "F.silu fp32": F.silu(x), "torch.sigmoid fp32": torch.sigmoid(x),
            "softmax fp32": torch.softmax(x, -1), "sum(-1) fp32": x.sum(-1), "numpy (OpenBLAS) matmul": a @ b}
    return {name: hashlib.sha1(np.ascontiguousarray(torch.as_tensor(t).float().numpy()).tobytes()).hexdigest()[:12]
            for name, t in outs.items()}


def elementwise_probes(dtype: torch.dtype) -> dict[str, int]:
    x = (torch.randn(4099, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    ops = {"exp": torch.exp, "tanh": torch.tanh, "silu": F.silu, "sigmoid": torch.sigmoid,
           "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-3)}
    return {name: sum(not torch.equal(f(x[j:j + 1]), f(x)[j:j + 1]) for j in range(0, 4099, 7))
            for name, f in ops.items()}


def _gloo_rank(rank: int, world: int, port: int, dtype: torch.dtype, box) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.randn(257, 24, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)

    def reduce(a):
        a = a.clone()
        dist.all_reduce(a)
        return a
    bad = rows_differ(reduce, x)
    if rank == 0:
        box.put(bad)
    dist.destroy_process_group()


def code_paths() -> None:
    """The probe once per code path; one Markdown table: where each op is not row-invariant, and whether each path
    changed its bits against the native path."""
    runs = {"native": {}, **CODE_PATHS}
    found = {}
    for name, switches in runs.items():
        done = subprocess.run([sys.executable, __file__, "--json"], env={**os.environ, **switches}, check=True,
                              capture_output=True, text=True)
        found[name] = json.loads(done.stdout)
    print("| op | " + " | ".join(f"{n} ({found[n]['capability']})" for n in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for op, native in found["native"]["digests"].items():
        cells = ["(native)" if n == "native" else "other bits" if found[n]["digests"][op] != native else "same bits"
                 for n in runs]
        print(f"| {op} | " + " | ".join(cells) + " |")
    for op in found["native"]["rows"]:
        cells = [", ".join(f"{d}: M={bad}" for d, bad in found[n]["rows"][op].items() if bad) or "invariant"
                 for n in runs]
        print(f"| rows: {op} | " + " | ".join(cells) + " |")


def report() -> dict:
    """What ``--json`` prints: the capability, the digests and the row probes by op and dtype."""
    rows: dict[str, dict[str, list[int]]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        for name, bad in {**dense_probes(dtype), **invariant_probes(dtype)}.items():
            rows.setdefault(name, {})[str(dtype).removeprefix("torch.")] = bad
    return {"capability": torch.backends.cpu.get_cpu_capability(), "digests": digests(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--code-paths", action="store_true", help="rerun under each CPU code path, one table")
    parser.add_argument("--json", action="store_true", help="print the digests and row probes as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.code_paths:
        return code_paths()
    if args.json:
        return print(json.dumps(report()))
    for dtype in (torch.bfloat16, torch.float32):
        for name, bad in {**dense_probes(dtype), **invariant_probes(dtype)}.items():
            print(f"{str(dtype):15s} {name:48s} {'invariant' if not bad else f'differs at M = {bad}'}")
        for name, count in elementwise_probes(dtype).items():
            print(f"{str(dtype):15s} {'elementwise ' + name:48s} "
                  f"{'invariant' if not count else f'{count}/586 values differ alone vs in 4099'}")
        if args.ranks > 1:
            from socket import socket
            with socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ctx = mp.get_context("spawn")
            box = ctx.Queue()
            mp.start_processes(_gloo_rank, args=(args.ranks, port, dtype, box), nprocs=args.ranks, start_method="spawn")
            bad = box.get()
            print(f"{str(dtype):15s} {f'gloo all_reduce over {args.ranks} ranks':48s} "
                  f"{'invariant' if not bad else f'differs at M = {bad}'}")


if __name__ == "__main__":
    main()
