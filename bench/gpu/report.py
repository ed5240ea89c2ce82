"""The GPU check's report and its sections in order (``scripts/gpu_check.py`` is the entry point; its
docstring lists the sections). Each section is recorded even when another fails, and the report is
rewritten after every section, so a timeout leaves a partial report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.gpu import draft_check, graph_check, step_check
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


class Report:
    """Sections in order; written to JSON and Markdown after each one, so a timeout leaves a partial report."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.deadline, self.sections, self.seconds = out, time.monotonic() + budget_s, {}, {}
        out.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn, *args) -> None:
        """Record ``fn(*args)`` as section ``name``; an exception becomes the section's ``error``."""
        start = time.monotonic()
        log.info("section %s (%.0f s of budget left)", name, self.left_s())
        try:
            value = fn(*args) if self.left_s() > 0 else "skipped: --budget-s spent"
        except Exception:  # noqa: BLE001 - one broken section must not lose the others
            value = {"error": traceback.format_exc(limit=8)}
        self.sections[name] = value
        self.seconds[name] = round(time.monotonic() - start, 1)
        self.write()

    def write(self) -> None:
        everything = {**self.sections, "section_seconds": self.seconds}
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


def cuda_graphs(budget_s: float) -> dict | str:
    """:func:`bench.gpu.graph_check.gpu_check`: decode and tree-verify graphs (budgets 8…256) captured, replayed
    against the eager static step, and timed."""
    return graph_check.gpu_check(device=torch.device("cuda"), budget_s=budget_s) if CUDA else NO_GPU


def draft_graphs(budget_s: float) -> dict | str:
    """:func:`bench.gpu.draft_check.gpu_check`: the drafter step (paged context, device tree builder) captured per
    batch size at budgets 8…256, replayed against the eager static draft, and timed."""
    return draft_check.gpu_check(device=torch.device("cuda"), budget_s=budget_s) if CUDA else NO_GPU


def spec_steps(budget_s: float) -> dict | str:
    """:func:`bench.gpu.step_check.gpu_check`: one engine tree-verify step, static (graphs, no host sync from the
    draft to the commit) against dynamic, at budgets 8…256."""
    return step_check.gpu_check(device=torch.device("cuda"), budget_s=budget_s) if CUDA else NO_GPU


def main() -> None:
    """``scripts/gpu_check.py``: every section in order, the report in ``--out``; exit status 1 when a kernel
    is out of tolerance."""
    parser = argparse.ArgumentParser(description="One call on one GPU: are the kernels right, fast, and where is the "
                                                 "floor?")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_report"), help="report directory (default $OUT)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this")
    parser.add_argument("--aot", choices=("core", "full", "none"), default="core",
                        help="ahead-of-time compile set when there is no GPU (default: every code path once)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = Report(Path(args.out), args.budget_s)
    report.sections["gpu_parts"] = "run on " + torch.cuda.get_device_name(0) if CUDA else (
        "SKIPPED — no CUDA device here, so moe_timing, bandwidth, power, cuda_graphs, draft_graphs and spec_steps did "
        "not run; correctness ran the Triton kernels under TRITON_INTERPRET=1 at tiny fp32 and fp16 shapes"
        + ("" if args.aot == "none" else ", and aot_compile built them for sm_90/sm_100 without a GPU"))
    report.run("environment", environment)
    report.run("kernel_select", kernel_selection)
    report.run("aot_compile", aot_compile, args.aot)
    report.run("correctness", correctness)
    power = PowerMeter() if CUDA else None
    report.run("moe_timing", moe_timing, power)
    report.run("bandwidth", bandwidth, power)
    report.run("power", power.summary if power else lambda: NO_GPU)
    report.run("cuda_graphs", cuda_graphs, max(0.0, report.left_s() - 120))
    report.run("draft_graphs", draft_graphs, max(0.0, report.left_s() - 60))
    report.run("spec_steps", spec_steps, max(0.0, report.left_s()))
    failed = [r["kernel"] for r in report.sections["correctness"] if not r.get("ok")] \
        if isinstance(report.sections["correctness"], list) else ["correctness section failed"]
    report.sections["verdict"] = "all kernels within tolerance" if not failed else f"FAILED: {failed}"
    report.write()
    log.info("%s; report in %s", report.sections["verdict"], args.out)
    sys.exit(1 if failed else 0)
