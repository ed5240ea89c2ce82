"""gpu_check section ``invariance``: does ``engine.batch_invariant`` hold on this device, and what does it cost?
``run(device, budget_s) -> dict`` (docs/batch_invariance.md).

- ``tokens``: the trained tiny_kimi pair in bf16, static steps on; plain decoding, DFlash and DDTree (budgets 16,
  64) over one batch of 8 (4 held-out prompts greedy, the same 4 seeded at T=1) and prompt 0 alone, greedy and
  seeded. With the flag on every arm must give plain decoding's tokens, and prompt 0 alone the tokens it got in
  the batch (``flag_on_identical``); the same arms with the flag off say what the flag changes.
- ``ops``: every op of ``batch_invariant_kernels(select_kernels(device))`` (:func:`bench.gpu.row_cases.kernel_ops`:
  an op added to the set is listed without edits here), bf16 and fp32: one row alone against the same row inside
  2, 9, 17, 64 and 257-row launches, bit for bit.
- ``cost``: plain decode tok/s at batch 1 and 32, flag off and on (:func:`bench.gpu.engine_check.run_arm`).

Parts run in the order flag-on tokens, ops, cost, flag-off tokens; an arm starts only while more of ``budget_s`` is
left than the longest arm of its part so far took, an op while any is left (the hard stop past the budget loses
the whole section); the rest are recorded as ``skipped: time budget``. Without a GPU gpu_check records "no CUDA
device"; :func:`cpu_plan` is the same logic at tiny sizes for the CPU test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.gpu.engine_check import ZOO, Arm, first_diff, load_prompts, run_arm
from bench.gpu.harness import check_rows
from bench.gpu.row_cases import BF16_ONLY, MODEL, ROW_CASES, TINY, Dims, kernel_ops, row_mismatches
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from model.kernel_select import KernelSet, batch_invariant_kernels, select_kernels
from model.loader import DeviceConfig, load_target
from parallelism.comm import build_groups
from parallelism.layout import Layout
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation

Request = tuple[str, list[int], SamplingParams]
Tokens = dict[str, list[int]]  # request id → its generated tokens


@dataclass(frozen=True, kw_only=True)
class Plan:
    """``prompts`` held-out prompts, each greedy and seeded in one batch, ``new_tokens`` each, for ``methods``
    (``(method, budget)``); op rows at ``op_sizes`` rows, widths ``op_dims``, in ``op_dtypes``; plain decode cost at
    ``cost_batches``, ``cost_tokens`` each."""

    prompts: int
    new_tokens: int
    methods: tuple[tuple[str, int | None], ...]
    op_sizes: tuple[int, ...]
    op_dims: Dims
    op_dtypes: tuple[torch.dtype, ...]
    cost_batches: tuple[int, ...]
    cost_tokens: int


def gpu_plan() -> Plan:
    return Plan(prompts=4, new_tokens=32, methods=(("none", None), ("dflash", None), ("ddtree", 16), ("ddtree", 64)),
                op_sizes=(2, 9, 17, 64, 257), op_dims=MODEL, op_dtypes=(torch.bfloat16, torch.float32),
                cost_batches=(1, 32), cost_tokens=64)


def cpu_plan() -> Plan:
    """The CPU test's: 2 prompts (a batch of 4), 4 tokens, plain and DDTree 16; ops at 2 and 9 rows, tiny widths."""
    return Plan(prompts=2, new_tokens=4, methods=(("none", None), ("ddtree", 16)), op_sizes=(2, 9), op_dims=TINY,
                op_dtypes=(torch.bfloat16, torch.float32), cost_batches=(1, 2), cost_tokens=4)


def workload(prompts: list[list[int]], new_tokens: int) -> list[list[Request]]:
    """The runs of one arm: every prompt greedy (``g0``…) and seeded at T=1, top-p 0.9 (``s0``…) in one batch, then
    prompt 0 greedy alone and seeded alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=new_tokens, ignore_eos=True)
    batch = [(f"{name}{i}", prompt, params) for name, params in (("g", greedy), ("s", seeded))
             for i, prompt in enumerate(prompts)]
    return [batch, [batch[0]], [batch[len(prompts)]]]


def run_requests(engine: Engine, requests: list[Request]) -> Tokens:
    """``requests`` submitted together and stepped to the end."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: Tokens = {rid: [] for rid, _, _ in requests}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_tokens
    return out


def arm_tokens(model, spec: SpecConfig, cfg: EngineConfig, runs: list[list[Request]]) -> list[Tokens]:
    """Each run on a fresh engine with ``spec`` and ``cfg``."""
    speculation = load_speculation(spec, model)
    return [run_requests(Engine(model, cfg, speculation=speculation), requests) for requests in runs]


def token_diffs(got: list[Tokens], plain: list[Tokens] | None) -> dict:
    """First differing token: ``vs_plain`` per ``run/request`` where ``got`` leaves ``plain`` (None without a
    plain run), ``alone_vs_batch`` per request whose tokens alone differ from its tokens in the batch (run 0)."""
    vs_plain = None if plain is None else {
        f"{run}/{rid}": d for run, (a, b) in enumerate(zip(got, plain, strict=True)) for rid in a
        if (d := first_diff(a[rid], b[rid])) is not None}
    alone = {rid: d for run in got[1:] for rid in run if (d := first_diff(run[rid], got[0][rid])) is not None}
    return dict(same_as_plain=None if vs_plain is None else not vs_plain, vs_plain=vs_plain,
                same_alone_as_in_batch=not alone, alone_vs_batch=alone)


def token_rows(model, plan: Plan, runs: list[list[Request]], flag: bool, left: Callable[[], float]) -> list[dict]:
    """Every method of ``plan`` with ``engine.batch_invariant=flag``, compared with the first (plain) arm."""
    cfg = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, block_size=16,
                          num_blocks=256, static_steps="on", gpu_memory_utilization=None, batch_invariant=flag)
    rows, plain, longest = [], None, 0.0
    for method, budget in plan.methods:
        head = dict(flag="on" if flag else "off", method=method, budget=budget)
        if left() <= longest:  # an arm as long as the longest so far would end past the budget
            rows.append({**head, "skipped": "time budget"})
            continue
        t0 = time.time()
        spec = SpecConfig() if method == "none" else SpecConfig(method, budget=budget or 16,
                                                                 drafter_path=str(ZOO / "drafter"))
        try:
            got = arm_tokens(model, spec, cfg, runs)
        except Exception as exc:  # noqa: BLE001 - recorded, the next arm still runs
            rows.append({**head, "error": f"{type(exc).__name__}: {exc}"[:800]})
            continue
        plain, longest = got if method == "none" else plain, max(longest, time.time() - t0)
        rows.append({**head, **token_diffs(got, None if method == "none" else plain),
                     "seconds": round(time.time() - t0, 1)})
    return rows


def op_rows(kernels: KernelSet, plan: Plan, device: torch.device, budget_s: float) -> list[dict]:
    """Every op of ``kernels`` in each dtype of ``plan`` (the quantized ops in bf16 only): its row mismatches."""
    def check(op: str, dtype: str) -> dict:
        row = dict(op=op, dtype=dtype, impl=kernels.reasons.get(op, ""))
        if op not in ROW_CASES:
            return {**row, "skipped": "no row case in bench.gpu.row_cases.ROW_CASES"}
        t0, size = time.time(), max(plan.op_sizes)
        case = ROW_CASES[op](size, plan.op_dims, torch.Generator().manual_seed(0), getattr(torch, dtype), str(device))
        bad = row_mismatches(getattr(kernels, op), case, plan.op_sizes)
        return {**row, "invariant": not bad, "mismatches": bad[:8], "seconds": round(time.time() - t0, 2)}

    names = [str(dt).removeprefix("torch.") for dt in plan.op_dtypes]
    todo = [dict(op=op, dtype=dt) for dt in names for op in kernel_ops(kernels)
            if op not in BF16_ONLY or dt == "bfloat16"]
    return check_rows(todo, check, budget_s)


def cost_rows(model, plan: Plan, left: Callable[[], float]) -> list[dict]:
    """Plain decoding at each batch of ``plan``, flag off then on: decode tok/s after a warm-up, and on / off."""
    prompts = [p["ids"] for p in load_prompts()]
    rows, longest = [], 0.0
    for batch in plan.cost_batches:
        group = (prompts * -(-batch // len(prompts)))[:batch]
        speed = {}
        for flag in (False, True):
            head = dict(batch=batch, flag="on" if flag else "off")
            if left() <= longest:
                rows.append({**head, "skipped": "time budget"})
                continue
            try:
                row, _ = run_arm(model, Arm(batch=batch, batch_invariant=flag), [group], plan.cost_tokens)
            except Exception as exc:  # noqa: BLE001 - recorded, the next row still runs
                rows.append({**head, "error": f"{type(exc).__name__}: {exc}"[:800]})
                continue
            longest = max(longest, row["seconds"])
            speed[flag] = row["decode_tok_s"]
            rows.append({**head, **{k: row[k] for k in ("decode_tok_s", "decode_steps", "host_ms_per_step",
                                                         "gpu_ms_per_step", "eager_reasons", "seconds")}})
        if speed.get(False) and speed.get(True):
            rows[-1]["on_vs_off"] = speed[True] / speed[False]
    return rows


def summary(tokens: list[dict], ops: list[dict]) -> dict:
    """``flag_on_identical`` (None: no flag-on arm ran), the flag-off arms whose tokens moved, the ops not
    row-invariant."""
    on = [r for r in tokens if r["flag"] == "on" and "same_alone_as_in_batch" in r]
    moved = [f"{r['method']} {r['budget'] or ''}".strip() for r in tokens if r["flag"] == "off"
             and (r.get("same_as_plain") is False or r.get("same_alone_as_in_batch") is False)]
    return dict(flag_on_identical=all(r["same_alone_as_in_batch"] and r["same_as_plain"] is not False for r in on)
                if on else None, flag_off_moved=moved,
                ops_not_invariant=[f"{r['op']} {r['dtype']}" for r in ops if r.get("invariant") is False])


def run(device: torch.device | str, budget_s: float, plan: Plan | None = None) -> dict:
    """The section (see the module docstring) under ``budget_s``; ``plan``: :func:`gpu_plan` on CUDA, else
    :func:`cpu_plan`."""
    t0, device = time.time(), torch.device(device)
    plan = plan or (gpu_plan() if device.type == "cuda" else cpu_plan())
    left = lambda: budget_s - (time.time() - t0)  # noqa: E731
    model = load_target(ZOO / "target", build_groups(Layout()), 0, DeviceConfig(device.type, "bfloat16"))
    runs = workload([p["ids"] for p in load_prompts()[:plan.prompts]], plan.new_tokens)
    tokens = token_rows(model, plan, runs, True, left)
    ops = op_rows(batch_invariant_kernels(select_kernels(device)), plan, device, max(left(), 0.0))
    cost = cost_rows(model, plan, left)
    tokens += token_rows(model, plan, runs, False, left)
    return dict(model="tiny_kimi target + DFlash drafter (model/zoo/tiny_kimi), bf16", device=str(device),
                workload=f"{plan.prompts} held-out prompts greedy + the same seeded at T=1 in one batch, then prompt "
                         f"0 alone (greedy, seeded); {plan.new_tokens} new tokens, static steps on",
                **summary(tokens, ops), tokens=tokens, ops=ops, cost=cost, seconds=round(time.time() - t0, 1))
