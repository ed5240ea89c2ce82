"""The engine end to end on the trained tiny_kimi pair: ``run(device, budget_s) -> dict``.

Per arm — plain decoding (graphs on and off; ``engine.overlap`` on and off when ``EngineConfig`` has that
field), DFlash (block 9, its best on this pair) and DDTree (block 16) at budgets 16, 64, 256; batch 1 and 8; greedy
and seeded T=1; bf16 and fp32 — one row: decode tok/s after a warm-up (``Engine.warm_up()`` when the engine has
it, then one untimed pass of the arm's first batch), τ, coverage per step kind with the eager reasons, whether
the tokens equal plain decoding's (fp32 must), host ms (wall) and GPU ms (the step records' device span: CUDA
events around each decode step's launch, gaps included) per decode step. Then HF transformers ``generate`` on the
same checkpoint and the stored HF greedy continuations of the held-out prompts, as outside references, and
DDTree projected onto the Kimi-shaped slice (:mod:`bench.gpu.projection`). Arms run in priority order until the
budget is spent; the rest are recorded as skipped. Built without hydra (the GPU image has none).

On CPU a smoke version: one prompt, 8 tokens, fp32, plain decoding and DDTree 16, the same row keys.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import torch

from bench import REPO
from bench.gpu import projection
from engine.config import EngineConfig, RunnerConfig
from engine.core.recorder import EngineStats
from engine.core.step_record import StepRecord
from engine.engine import Engine
from engine.params import SamplingParams
from engine.step import StepKind
from model.loader import DeviceConfig, load_target
from parallelism.comm import build_groups
from parallelism.layout import Layout
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation

ZOO = REPO / "model/zoo/tiny_kimi"
DFLASH_BLOCK = 9  # DFlash's best block on this pair (docs/tiny_kimi.md, docs/records/gpu_first_run.md)
DDTREE_BLOCK = 16  # the drafter's training block
BUDGETS = (16, 64, 256)
# seconds a reference needs on a GPU to be worth starting (HF: two generate passes; projection: a 10 GiB slice)
MIN_LEFT_S = {"hf_generate": 15.0, "projection": 40.0}
ROW_KEYS = ("arm", "method", "budget", "block_size", "batch", "temperature", "dtype", "static_steps", "overlap",
            "prompts", "new_tokens", "decode_tok_s", "x_plain", "tau", "decode_steps", "host_ms_per_step",
            "gpu_ms_per_step", "draft_ms_per_step", "verify_ms_per_step", "coverage", "eager_reasons",
            "captures_during_timing", "warm_up", "same_tokens_as_plain", "first_diff", "kv_blocks_in_use_after",
            "seconds")


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One engine configuration and workload. ``overlap``: ``RunnerConfig.overlap``'s value (None: the
    field's default, or no such field); ``batch_invariant``: ``RunnerConfig.batch_invariant``."""

    method: str = "none"
    budget: int | None = None
    batch: int = 1
    temperature: float = 0.0
    dtype: str = "bfloat16"
    static_steps: str = "auto"
    overlap: object = None
    batch_invariant: bool = False

    @property
    def block(self) -> int | None:
        return {"dflash": DFLASH_BLOCK, "ddtree": DDTREE_BLOCK}.get(self.method)

    @property
    def label(self) -> str:
        what = self.method + (f" {self.budget}" if self.budget else "") + (f" block {self.block}" if self.block else "")
        extra = ("" if self.static_steps == "auto" else f", static {self.static_steps}") + \
            ("" if self.overlap is None else f", overlap {self.overlap}") + \
            (", batch-invariant" if self.batch_invariant else "")
        return f"{what}, b{self.batch}, {'greedy' if self.temperature == 0 else f'T={self.temperature:g}'}, " \
               f"{self.dtype}{extra}"

    def base(self) -> Arm:
        """The plain-decoding arm whose tokens this one's are compared with (same batch, sampling and dtype)."""
        return dataclasses.replace(self, method="none", budget=None, static_steps="auto", overlap=None)

    def spec(self) -> SpecConfig:
        if self.method == "none":
            return SpecConfig()
        return SpecConfig(self.method, budget=self.budget or 16, block_size=self.block,
                          drafter_path=str(ZOO / "drafter"))

    def params(self, i: int, new_tokens: int) -> SamplingParams:
        """Request ``i``'s sampling: greedy, or T=1 seeded per request (the same seeds in every arm)."""
        seed = None if self.temperature == 0 else 1000 + i
        return SamplingParams(temperature=self.temperature, seed=seed, max_tokens=new_tokens, ignore_eos=True)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run measures: ``prompts`` held-out prompts one at a time at batch 1 (batch b: the first b
    together), ``new_tokens`` each, the arms in priority order; ``hf_dtypes`` the HF references; ``projection``
    whether to project DDTree onto the slice (after the arms it needs τ from)."""

    prompts: int
    new_tokens: int
    arms: tuple[Arm, ...]
    hf_dtypes: tuple[str, ...]
    projection_after: int  # how many arms run before the projection


def overlap_values() -> tuple[object, ...] | str:
    """``engine.overlap``'s on and off values, or why there are none (the field is another change's)."""
    fields = {f.name: f for f in dataclasses.fields(RunnerConfig)}
    if "overlap" not in fields:
        return "RunnerConfig has no overlap field on this commit"
    default = fields["overlap"].default
    return (True, False) if isinstance(default, bool) else ("on", "off")


def gpu_plan() -> Plan:
    """Priority order: bf16 batch 1 greedy (every method, graphs off, overlap), the fp32 equality rows, bf16 batch 8
    (then the HF references and the projection), T=1, and fp32 at batch 8 / T=1."""
    bf, fp = "bfloat16", "float32"
    ov = overlap_values()
    methods = [("none", None), ("dflash", None), *(("ddtree", b) for b in BUDGETS)]
    first = [Arm(dtype=bf), Arm(dtype=bf, static_steps="off"),
             *([] if isinstance(ov, str) else [Arm(dtype=bf, overlap=v) for v in ov]),
             *(Arm(method=m, budget=b, dtype=bf) for m, b in methods[1:])]
    fp32 = [Arm(method=m, budget=b, dtype=fp) for m, b in methods[:4]]
    batch8 = [Arm(method=m, budget=b, batch=8, dtype=bf) for m, b in methods]
    later = [*(Arm(method=m, budget=b, temperature=1.0, dtype=bf) for m, b in methods[:3]),
             *(Arm(method=m, budget=b, batch=8, dtype=fp) for m, b in methods[:3]),
             *(Arm(method=m, budget=b, temperature=1.0, dtype=fp) for m, b in methods[:3]),
             *(Arm(method=m, budget=b, batch=8, temperature=1.0, dtype=d) for d in (bf, fp) for m, b in methods[:3:2])]
    return Plan(prompts=4, new_tokens=128, arms=(*first, *fp32, *batch8, *later), hf_dtypes=(fp, bf),
                projection_after=len(first) + len(fp32) + len(batch8))


def cpu_plan() -> Plan:
    """The smoke version: one prompt, 8 tokens, fp32, plain decoding and DDTree 16."""
    arms = (Arm(dtype="float32"), Arm(method="ddtree", budget=16, dtype="float32"))
    return Plan(prompts=1, new_tokens=8, arms=arms, hf_dtypes=("float32",), projection_after=2)


def load_prompts() -> list[dict]:
    """The held-out prompts (``ids``, and ``hf_greedy``: HF fp32 greedy continuations, 96 tokens)."""
    return json.loads((ZOO / "eval_prompts.json").read_text())["prompts"]


@dataclass
class StepTimes:
    """Decode and verify steps only, from the engine's step records: wall seconds, rank 0's device ms (CUDA), and
    the runner's draft / target seconds summed."""

    walls: list[float] = dataclasses.field(default_factory=list)
    device_ms: list[float] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def observe(self, record: StepRecord) -> None:
        if record.kind not in (StepKind.DECODE, StepKind.VERIFY):
            return
        self.walls.append(record.wall_s)
        if record.device_ms is not None:
            self.device_ms.append(record.device_ms)
        self.draft_s += record.host_ms["draft"] / 1e3
        self.verify_s += record.host_ms["target"] / 1e3


def generate(engine: Engine, groups: list[list[list[int]]], arm: Arm, new_tokens: int) -> tuple[list[list[int]],
                                                                                                 StepTimes]:
    """Each group of prompts submitted together, stepped to the end → tokens per prompt and the decode steps'
    times (a step-record subscriber)."""
    tokens, times, i = [], StepTimes(), 0
    engine.subscribe(times.observe)
    for group in groups:
        out = {str(i + j): [] for j in range(len(group))}
        for j, prompt in enumerate(group):
            engine.add_request(str(i + j), prompt, arm.params(i + j, new_tokens))
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_tokens
        tokens += [out[str(i + j)] for j in range(len(group))]
        i += len(group)
    return tokens, times


def _captures(engine: Engine) -> int:
    """Shapes the engine's runner has captured or given up on so far (a new one during timing costs a capture)."""
    r, spec = engine.runner, engine.runner.speculator  # spec: spec_decode.speculation.DFlashSpeculator
    graphs = [r.static, *((spec.drafts, spec.commits) if spec is not None else ())]
    return sum(len(g.captured) + len(g.reasons) for g in graphs if g is not None)


def run_arm(model, arm: Arm, groups: list[list[list[int]]], new_tokens: int) -> tuple[dict, list[list[int]]]:
    """One arm: warm-up, then the timed run on fresh stats → (its row, its tokens per prompt)."""
    t0, device = time.time(), model.device
    kv = dict(max_num_seqs=max(8, arm.batch), max_num_batched_tokens=1024, max_model_len=1024, block_size=16,
              num_blocks=512, static_steps=arm.static_steps, gpu_memory_utilization=None,
              batch_invariant=arm.batch_invariant)
    cfg = EngineConfig.flat(**kv, **({} if arm.overlap is None else {"overlap": arm.overlap}))
    spec = arm.spec()
    engine = Engine(model, cfg, seed=0, speculation=load_speculation(spec, model))
    warm = []
    if callable(getattr(engine, "warm_up", None)):
        try:
            engine.warm_up()
            warm.append("Engine.warm_up()")
        except TypeError as exc:  # another change's API; this check calls it without arguments
            warm.append(f"Engine.warm_up() not called: {exc}")
    generate(engine, groups[:1], arm, new_tokens)
    warm.append("one untimed pass of the first batch")
    engine.stats = EngineStats()
    captured = _captures(engine)
    tokens, t = generate(engine, groups, arm, new_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    s, cov, steps = engine.stats, engine.stats.coverage.summary(), max(len(t.walls), 1)
    row = dict(arm=arm.label, method=arm.method, budget=arm.budget, block_size=arm.block, batch=arm.batch,
               temperature=arm.temperature, dtype=arm.dtype,
               static_steps="on" if engine.runner.static is not None else "off",
               overlap=None if arm.overlap is None else cfg.runner.overlap,
               prompts=sum(map(len, groups)), new_tokens=new_tokens,
               decode_tok_s=s.decode_tokens / s.decode_s if s.decode_s else None, x_plain=None,
               tau=s.acceptance_length if spec.enabled else 1.0, decode_steps=len(t.walls),
               host_ms_per_step=1e3 * statistics.fmean(t.walls) if t.walls else None,
               gpu_ms_per_step=statistics.fmean(t.device_ms) if t.device_ms else None,
               draft_ms_per_step=1e3 * t.draft_s / steps, verify_ms_per_step=1e3 * t.verify_s / steps,
               coverage={k: f"{c['replays']}/{c['steps']}" for k, c in cov.items()},
               eager_reasons={k: c["eager_reason"] for k, c in cov.items() if c["eager_reason"]},
               captures_during_timing=_captures(engine) - captured, warm_up=" + ".join(warm),
               same_tokens_as_plain=None, first_diff=None,
               kv_blocks_in_use_after=engine.scheduler.blocks_in_use(), seconds=round(time.time() - t0, 1))
    return row, tokens


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), None when equal."""
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), None if len(a) == len(b) else shorter)


def compare(rows: list[dict], arms: list[Arm], tokens: dict[Arm, list[list[int]]]) -> None:
    """Fills each row's ``same_tokens_as_plain``, ``first_diff`` (per prompt) and ``x_plain`` from its base arm's
    run (left None when the base did not run, and for the base itself)."""
    speed = {arm: row.get("decode_tok_s") for arm, row in zip(arms, rows, strict=True)}
    for arm, row in zip(arms, rows, strict=True):
        base = arm.base()
        if arm not in tokens or base not in tokens:
            continue
        if speed.get(base) and row.get("decode_tok_s"):
            row["x_plain"] = row["decode_tok_s"] / speed[base]
        if arm != base:
            diffs = [first_diff(a, b) for a, b in zip(tokens[arm], tokens[base], strict=True)]
            row["same_tokens_as_plain"], row["first_diff"] = all(d is None for d in diffs), diffs


def stored_reference(prompts: list[dict], tokens: list[list[int]]) -> dict:
    """Engine tokens against the stored HF fp32 greedy continuations (computed on CPU when the prompts were made)."""
    diffs = [first_diff(t[:len(p["hf_greedy"])], p["hf_greedy"][:len(t)]) for p, t in zip(prompts, tokens, strict=True)]
    return dict(equal=f"{sum(d is None for d in diffs)}/{len(diffs)}", first_diff=diffs,
                compared_tokens=min(len(tokens[0]), len(prompts[0]["hf_greedy"])))


def hf_reference(device: torch.device, dtype: str, prompts: list[list[int]], new_tokens: int,
                 engine_tokens: list[list[int]] | None) -> dict:
    """HF transformers ``generate`` on the same checkpoint, batch 1, greedy: decode tok/s (``generate(N) -
    generate(1)``, prefill excluded) and its tokens against the engine's plain greedy tokens in the same dtype."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        return dict(dtype=dtype, skipped=f"transformers not importable: {exc}")
    t0 = time.time()
    hf = AutoModelForCausalLM.from_pretrained(str(ZOO / "target"), dtype=getattr(torch, dtype)).to(device).eval()

    def timed(ids: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=hf.config.pad_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, out

    timed(torch.tensor([prompts[0]], device=device), 2)  # warm-up: kernels, cuBLAS handles
    decode_s, tokens = 0.0, []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        full, out = timed(ids, new_tokens)
        decode_s += full - timed(ids, 1)[0]
        tokens.append(out[0, len(p):].tolist())
    diffs = [first_diff(a, b) for a, b in zip(tokens, engine_tokens, strict=True)] if engine_tokens else None
    return dict(dtype=dtype, transformers=transformers.__version__, batch=1, prompts=len(prompts),
                new_tokens=new_tokens, decode_tok_s=len(prompts) * (new_tokens - 1) / max(decode_s, 1e-9),
                same_tokens_as_engine_plain=None if diffs is None else f"{sum(d is None for d in diffs)}/{len(diffs)}",
                first_diff=diffs, seconds=round(time.time() - t0, 1))


def markdown(rows: list[dict]) -> str:
    """The arms as one table."""
    head = "| arm | decode tok/s | × plain | τ | host ms/step | GPU ms/step | coverage | = plain |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        if "decode_tok_s" not in r:
            lines.append(f"| {r['arm']} | {r.get('error') or r.get('skipped')} | | | | | | |")
            continue
        cov = ", ".join(f"{k} {v}" for k, v in r["coverage"].items())
        lines.append(f"| {r['arm']} | {num(r['decode_tok_s'], '.1f')} | {num(r['x_plain'], '.2f')} | "
                     f"{r['tau']:.2f} | {num(r['host_ms_per_step'], '.2f')} | {num(r['gpu_ms_per_step'], '.2f')} | "
                     f"{cov} | {r['same_tokens_as_plain'] if r['same_tokens_as_plain'] is not None else '-'} |")
    return "\n".join(lines)


def run(device: torch.device | str, budget_s: float, plan: Plan | None = None) -> dict:
    """The arms of ``plan`` (None: :func:`gpu_plan` on CUDA, :func:`cpu_plan` elsewhere), the HF references and
    the projection, until ``budget_s`` has passed."""
    t0, device = time.time(), torch.device(device)
    plan = plan or (gpu_plan() if device.type == "cuda" else cpu_plan())
    left = lambda: budget_s - (time.time() - t0)  # noqa: E731
    held_out = load_prompts()[:max(plan.prompts, max(a.batch for a in plan.arms))]
    ids = [p["ids"] for p in held_out]
    models, rows, tokens, done = {}, [], {}, {}
    extra: dict = dict(hf_generate=[], stored_hf_greedy={}, projection="skipped: time budget")

    def model(dtype: str):
        if dtype not in models:
            models[dtype] = load_target(ZOO / "target", build_groups(Layout()), 0, DeviceConfig(device.type, dtype))
        return models[dtype]

    for i, arm in enumerate(plan.arms):
        if i == plan.projection_after:
            _references(extra, plan, device, ids, tokens, done, left)
        if left() <= 0:
            rows.append(dict(arm=arm.label, skipped="time budget"))
            continue
        groups = [[p] for p in ids[:plan.prompts]] if arm.batch == 1 else [ids[:arm.batch]]
        try:
            done[arm], tokens[arm] = run_arm(model(arm.dtype), arm, groups, plan.new_tokens)
            rows.append(done[arm])
        except Exception as exc:  # noqa: BLE001 - recorded, the next arm still runs
            rows.append(dict(arm=arm.label, error=f"{type(exc).__name__}: {exc}"[:800]))
    if plan.projection_after >= len(plan.arms):
        _references(extra, plan, device, ids, tokens, done, left)
    compare(rows, list(plan.arms), tokens)
    unequal = [r["arm"] for r in rows if r.get("dtype") == "float32" and r.get("same_tokens_as_plain") is False]
    compared = [r for r in rows if r.get("dtype") == "float32" and r.get("same_tokens_as_plain") is not None]
    ov = overlap_values()
    return dict(model="tiny_kimi target + DFlash drafter (model/zoo/tiny_kimi)", device=str(device),
                prompts=f"{plan.prompts} held-out prompts (eval_prompts.json) one at a time at batch 1"
                        + (", the first 8 together at batch 8" if any(a.batch == 8 for a in plan.arms) else ""),
                new_tokens=plan.new_tokens,
                overlap="arms with overlap on/off" if not isinstance(ov, str) else f"no overlap arms: {ov}",
                arms=rows, table=markdown(rows), fp32_equal=(not unequal) if compared else None,
                fp32_unequal=unequal, **extra,
                notes="gpu_ms_per_step: CUDA events around each decode step, the span of its device work (gaps while "
                      "the GPU waits for the host included); host_ms_per_step: its wall time. "
                      "captures_during_timing > 0: a shape first seen in the timed run, its capture is in the time.")


def _references(extra: dict, plan: Plan, device: torch.device, ids: list[list[int]], tokens: dict,
                done: dict[Arm, dict], left) -> None:
    """HF generate, the stored HF greedy continuations and the slice projection, each if time is left."""
    prompts = load_prompts()[:plan.prompts]
    need = MIN_LEFT_S if device.type == "cuda" else dict.fromkeys(MIN_LEFT_S, 0.0)
    for dtype in plan.hf_dtypes:
        plain = tokens.get(Arm(dtype=dtype))
        if plain is not None:
            extra["stored_hf_greedy"][dtype] = stored_reference(prompts, plain)
        if left() <= need["hf_generate"]:
            extra["hf_generate"].append(dict(dtype=dtype, skipped=f"time budget ({left():.0f} s left)"))
            continue
        try:
            extra["hf_generate"].append(hf_reference(device, dtype, ids[:plan.prompts], plan.new_tokens, plain))
        except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
            extra["hf_generate"].append(dict(dtype=dtype, error=f"{type(exc).__name__}: {exc}"[:800]))
    taus = {a.budget: r["tau"] for a, r in done.items()
            if a.method == "ddtree" and a.batch == 1 and a.temperature == 0 and a.dtype == plan.arms[0].dtype}
    if not taus:
        extra["projection"] = "skipped: no DDTree arm at batch 1 greedy ran, so no τ to project with"
    elif left() <= need["projection"]:
        extra["projection"] = f"skipped: time budget ({left():.0f} s left, it needs about {need['projection']:.0f})"
    else:
        try:
            extra["projection"] = projection.run(device, taus, left(), context=4096 if device.type == "cuda" else 64)
        except Exception as exc:  # noqa: BLE001 - recorded in the report
            extra["projection"] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
