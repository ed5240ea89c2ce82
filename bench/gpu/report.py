"""The GPU check's report and its sections in order (``scripts/gpu_check.py`` is the entry point; its
docstring lists the sections). Each section runs under its own time budget (:data:`BUDGETS_S`, ``--budget
NAME=S``) inside the whole run's (``--budget-s``), is recorded even when another fails, and the report is
rewritten after every section, so a timeout leaves a partial report. ``docs/gpu_path.md`` ("Running gpu_check")
has the table and the command a GPU task runs."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.gpu import draft_check, engine_check, graph_check, hand_off, invariance, quant_check, roofline, step_check
from bench.gpu.kernels import (
    CUDA,
    NO_GPU,
    aot_compile,
    bandwidth,
    correctness,
    environment,
    kernel_selection,
    moe_timing,
)
from bench.gpu.power import PowerMeter

log = logging.getLogger("gpu_check")

# Seconds per section (estimates for one H200; the first GPU run's ``section_seconds`` should reset them). The
# sections that run on a GPU sum to 450 s, at the whole run's default --budget-s of 450 s; aot_compile runs only
# without a GPU. A section past its budget + min(30 s, 10 s + budget / 4) is stopped (SIGALRM).
BUDGETS_S = {"environment": 5, "kernel_select": 5, "aot_compile": 120, "correctness": 50, "moe_timing": 25,
             "bandwidth": 25, "power": 5, "cuda_graphs": 30, "draft_graphs": 25, "spec_steps": 25, "engine": 90,
             "invariance": 60, "roofline": 65, "quant": 25, "hand_off": 15}
TOTAL_BUDGET_S = 450.0
NOT_SELECTED = "not in --sections"


@dataclass
class Context:
    """What the sections share: the AOT mode, the sections named on the command line, the NVML power meter
    (moe_timing and bandwidth measure, power summarises; made on first use, CUDA only)."""

    aot: str = "core"
    explicit: frozenset[str] = frozenset()
    _power: PowerMeter | None = field(default=None, repr=False)

    @property
    def power(self) -> PowerMeter | None:
        if self._power is None and CUDA:
            self._power = PowerMeter()
        return self._power

    def device(self, name: str) -> str | None:
        """The device a GPU-or-dry-run section runs on: cuda; cpu when ``name`` was asked for by name; else None."""
        return "cuda" if CUDA else ("cpu" if name in self.explicit else None)


def _power_summary(ctx: Context, budget_s: float) -> dict | str:
    """NVML readings taken while moe_timing and bandwidth ran."""
    if not CUDA:
        return NO_GPU
    if ctx.power.backend is not None and not ctx.power.rows:
        return "skipped: nothing measured (power reads NVML while moe_timing and bandwidth run; neither did)"
    return ctx.power.summary()


def _roofline(ctx: Context, budget_s: float) -> dict | str:
    """:func:`bench.gpu.roofline.run` on the GPU; without one, only when asked by name: its tiny CPU dry run."""
    device = ctx.device("roofline")
    if device is None:
        return NO_GPU
    small = {} if device == "cuda" else dict(batches=(1, 2), contexts=(8, 24))
    return roofline.run(device, budget_s, **small)


def _engine(ctx: Context, budget_s: float) -> dict | str:
    """:func:`bench.gpu.engine_check.run`: the engine end to end on the trained tiny_kimi pair; without a GPU, only
    when asked by name: its smoke version."""
    device = ctx.device("engine")
    return NO_GPU if device is None else engine_check.run(device, budget_s)


def _graphs(check: Callable[..., dict]) -> Callable[[Context, float], dict | str]:
    return lambda ctx, budget_s: check(device=torch.device("cuda"), budget_s=budget_s) if CUDA else NO_GPU


# name → run(ctx, budget_s), in the order they run
SECTIONS: dict[str, Callable[[Context, float], object]] = {
    "environment": lambda ctx, b: environment(),
    "kernel_select": lambda ctx, b: kernel_selection(),
    "aot_compile": lambda ctx, b: aot_compile(ctx.aot),
    "correctness": lambda ctx, b: correctness(b),
    "moe_timing": lambda ctx, b: moe_timing(ctx.power),
    "bandwidth": lambda ctx, b: bandwidth(ctx.power),
    "power": _power_summary,
    "cuda_graphs": _graphs(graph_check.gpu_check),
    "draft_graphs": _graphs(draft_check.gpu_check),
    "spec_steps": _graphs(step_check.gpu_check),
    "engine": _engine,
    "invariance": lambda ctx, b: invariance.run("cuda", b) if CUDA else NO_GPU,
    "roofline": _roofline,
    "quant": lambda ctx, b: NO_GPU if ctx.device("quant") is None else quant_check.run(b),
    "hand_off": lambda ctx, b: NO_GPU if ctx.device("hand_off") is None else hand_off.run(ctx.device("hand_off"), b),
}
assert SECTIONS.keys() == BUDGETS_S.keys()


class SectionTimeout(BaseException):
    """A section ran past its hard limit (a BaseException, so the sections' own ``except Exception`` that keep a
    failing case's row do not swallow it)."""


@contextmanager
def hard_stop(seconds: float) -> Iterator[None]:
    """Raises :class:`SectionTimeout` in the body after ``seconds`` (SIGALRM: main thread, POSIX; elsewhere no
    limit). A body inside a long C call (a kernel, a compile) is stopped when the call returns."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"stopped after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def grace_s(budget_s: float) -> float:
    """How far past its budget a section may run before :func:`hard_stop` ends it (its last case may overrun)."""
    return min(30.0, 10.0 + budget_s / 4)


def outcome(value) -> tuple[str, str]:
    """A section's value → ``("ran" | "skipped" | "error", why)``."""
    if isinstance(value, str) and value.startswith("skipped"):
        return "skipped", value.removeprefix("skipped").lstrip(": ")
    if isinstance(value, dict) and "error" in value:
        return "error", str(value["error"]).strip().splitlines()[-1]
    return "ran", ""


class Report:
    """Sections in order; written to JSON and Markdown after each one, so a timeout leaves a partial report."""

    def __init__(self, out: Path, budget_s: float, ctx: Context):
        self.out, self.deadline, self.ctx = out, time.monotonic() + budget_s, ctx
        self.sections, self.seconds, self.budgets = {}, {}, {}
        out.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, budget_s: float) -> None:
        """Section ``name`` with ``budget_s`` seconds (capped by what is left of ``--budget-s``); an exception or
        the hard stop becomes the section's ``error``, a budget of 0 or a spent ``--budget-s`` a ``skipped``."""
        start, given = time.monotonic(), min(budget_s, self.left_s())
        log.info("section %s (budget %.0f s, %.0f s of --budget-s left)", name, given, self.left_s())
        if budget_s <= 0:
            value = f"skipped: budget 0 s (--budget {name}=0)"
        elif given <= 0:
            value = "skipped: --budget-s spent"
        else:
            try:
                with hard_stop(given + grace_s(given)):
                    value = SECTIONS[name](self.ctx, given)
            except SectionTimeout as exc:
                value = {"error": f"{exc}: past its budget of {given:.0f} s + {grace_s(given):.0f} s grace"}
            except Exception:  # noqa: BLE001 - one broken section must not lose the others
                value = {"error": traceback.format_exc(limit=8)}
        self.sections[name] = value
        self.seconds[name] = round(time.monotonic() - start, 1)
        self.budgets[name] = round(max(given, 0.0), 1)
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        self.write()

    def write(self) -> None:
        everything = {**self.sections, "section_seconds": self.seconds, "section_budgets_s": self.budgets}
        (self.out / "gpu_report.json").write_text(json.dumps(everything, indent=2, default=str))
        (self.out / "gpu_report.md").write_text(markdown(everything))


def markdown(sections: dict) -> str:
    lines = ["# gpu_check report", ""]
    for name, value in sections.items():
        lines += [f"## {name}", "", *_md_value(value), ""]
    return "\n".join(lines)


def _md_value(value) -> list[str]:
    """A list of dicts → a table; a dict → a bullet list (nested values below their key); else one cell."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = list(dict.fromkeys(k for row in value for k in row))
        rows = [" | ".join(_cell(row.get(k, "")) for k in keys) for row in value]
        return [" | ".join(keys), " | ".join("---" for _ in keys), *rows]
    if not isinstance(value, dict):
        return [_cell(value)]
    lines = []
    for k, v in value.items():
        lines += [f"- **{k}**:", "", *_md_value(v), ""] if isinstance(v, list | dict) and v else \
            [f"- **{k}**: {_cell(v)}"]
    return lines


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return f"```\n{text}\n```" if "\n" in text else text.replace("|", "\\|")


def parse_sections(text: str | None) -> list[str]:
    """``a,b,c`` → those sections in run order (None or ``all``: every one); an unknown name raises ValueError
    naming the valid ones."""
    if text is None or text.strip() == "all":
        return list(SECTIONS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"unknown section(s) {unknown or [text]}; valid: {', '.join(SECTIONS)}")
    return [n for n in SECTIONS if n in names]


def parse_budgets(items: list[str]) -> dict[str, float]:
    """``BUDGETS_S`` with ``NAME=SECONDS`` overrides (each item may hold several, comma-separated)."""
    budgets = dict(BUDGETS_S)
    for item in (p for text in items for p in text.split(",") if p.strip()):
        name, sep, seconds = item.partition("=")
        name = name.strip()
        if not sep or name not in SECTIONS:
            raise ValueError(f"--budget {item!r}: expected NAME=SECONDS with NAME one of {', '.join(SECTIONS)}")
        budgets[name] = float(seconds)
    return budgets


def default_out() -> Path:
    """``$OUT`` if set, else a new directory under the system temp dir (never inside the checkout)."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_check_"))


def summary(sections: dict, chosen: list[str]) -> dict:
    """What ran, what was skipped (grouped by reason) and what failed; the sections not chosen."""
    ran, skipped, errors = [], {}, {}
    for name in chosen:
        kind, why = outcome(sections.get(name, "skipped: not run"))
        if kind == "ran":
            ran.append(name)
        elif kind == "skipped":
            skipped.setdefault(why, []).append(name)
        else:
            errors[name] = why
    return dict(ran=ran, skipped=skipped, errors=errors, not_selected=[n for n in SECTIONS if n not in chosen])


def console_lines(s: dict, verdict: str, out: Path) -> list[str]:
    """The run's last lines: what ran, what was skipped and why, errors, the verdict, where the report is."""
    lines = [f"ran: {', '.join(s['ran']) or 'nothing'}"]
    for why, names in s["skipped"].items():
        head = "skipped on this machine (no CUDA device)" if why.startswith("no CUDA device") else f"skipped ({why})"
        lines.append(f"{head}: {', '.join(names)}")
    lines += [f"error in {name}: {why}" for name, why in s["errors"].items()]
    if s["not_selected"]:
        lines.append(f"not selected (--sections): {', '.join(s['not_selected'])}")
    return [*lines, verdict, f"report: {out / 'gpu_report.md'} (and gpu_report.json)"]


def verdict_of(sections: dict) -> tuple[str, bool]:
    """``(line, failed)``: kernels out of tolerance, fp32 engine tokens off plain decoding, batch-invariant tokens
    that moved, a section's error."""
    problems = []
    rows = sections.get("correctness")
    if isinstance(rows, list):
        problems += [f"{r['kernel']} {r['dtype']} out of tolerance" for r in rows if not r.get("ok", "skipped" in r)]
    elif outcome(rows)[0] == "error":
        problems.append("correctness section failed")
    eng = sections.get("engine")
    if isinstance(eng, dict) and eng.get("fp32_equal") is False:
        problems.append(f"fp32 engine tokens differ from plain decoding: {eng.get('fp32_unequal')}")
    inv = sections.get("invariance")
    if isinstance(inv, dict) and inv.get("flag_on_identical") is False:
        problems.append("engine.batch_invariant=true: bf16 tokens differ between arms or batch sizes")
    if problems:
        return f"FAILED: {problems}", True
    if not isinstance(rows, list):
        return "correctness not run", False
    skipped = [f"{r['kernel']} {r['dtype']}" for r in rows if "skipped" in r]
    line = "all kernels within tolerance" if not skipped else \
        f"the kernels checked are within tolerance; not checked (time budget): {skipped}"
    return line + ("" if CUDA else " (CPU: Triton interpreter, tiny fp32/fp16 shapes)"), False


def main(argv: list[str] | None = None) -> None:
    """``scripts/gpu_check.py``: the chosen sections in order, the report in ``--out``; exit status 1 when a
    kernel is out of tolerance, the engine's fp32 tokens leave plain decoding or the batch-invariant ones move."""
    parser = argparse.ArgumentParser(description="One call on one GPU: are the kernels right, fast, and where is the "
                                                 "floor?")
    parser.add_argument("--out", default=None, help="report directory (default: $OUT, else a new temp directory)")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated, in any order (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS",
                        help="a section's time budget (repeatable; 0 skips it); defaults: "
                             + ", ".join(f"{k}={v:g}" for k, v in BUDGETS_S.items()))
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                        help="the whole run's budget: no section starts after it, each gets at most what is left")
    parser.add_argument("--aot", choices=("core", "full", "none"), default="core",
                        help="ahead-of-time compile set when there is no GPU (default: every code path once)")
    args = parser.parse_args(argv)
    try:
        chosen, budgets = parse_sections(args.sections), parse_budgets(args.budget)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out) if args.out else default_out()
    log.info("report directory: %s", out)
    named = args.sections is not None and args.sections.strip() != "all"  # the dry runs off CUDA need their name
    report = Report(out, args.budget_s, Context(aot=args.aot, explicit=frozenset(chosen if named else ())))
    report.sections["machine"] = f"{torch.cuda.get_device_name(0)} (CUDA)" if CUDA else \
        "no CUDA device: the GPU sections are skipped; correctness runs the Triton kernels under TRITON_INTERPRET=1"
    for name in chosen:
        report.run(name, budgets[name])
    s = summary(report.sections, chosen)
    line, failed = verdict_of(report.sections)
    report.sections.update(summary=s, verdict=line)
    report.write()
    for text in console_lines(s, line, out):
        print(f"gpu_check: {text}")
    sys.exit(1 if failed else 0)
