"""Bench report: every ``cell_*.json`` of a run → ``summary.csv``, ``summary.md`` and PNG plots.

The projections section carries each layout's *measured* collective calls per output token (rescaled
from the measured model's depth to Kimi K2's with the documented formula) onto the cost model's boxes;
it is labelled as a projection with the profiles' parameters and sources in docs/cost_model.md.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from bench.cost.efficiency import ASSUMPTION, load_efficiency
from bench.cost.formulas import project, rescale_calls
from bench.cost.hardware import HARDWARE
from bench.cost.shapes import KIMI_K2_INT4, ModelShape
from parallelism.layout import Layout

COLUMNS = [
    ("layout", "layout"), ("spec_decode", "spec"), ("context", "ctx"), ("concurrency", "C"),
    ("output_throughput", "out tok/s"), ("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"), ("median_e2el_ms", "E2E p50 ms"), ("acceptance_length", "τ"),
]


def load_cells(out_dir: Path) -> list[dict]:
    cells = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("cell_*.json"))]
    return sorted(cells, key=lambda c: (c["layout"], c["spec_decode"], c["context"], c["concurrency"]))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def cpu_pct(cell: dict) -> float | None:
    """Mean host CPU utilisation of a cell (% of all cores), when the CPU backend sampled it."""
    stats = (cell.get("telemetry") or {}).get("cpu_total_pct")
    return stats["mean"] if stats else None


def flat_row(c: dict) -> dict:
    comm = c.get("comm_per_output_token") or {}
    graphs = c.get("cuda_graphs") or {}
    v = c.get("verdict") or {}
    row = {key: c.get(key) for key, _ in COLUMNS}
    row.update({"comm_calls_per_token": comm.get("calls_per_token"),
                "comm_bytes_per_token": comm.get("bytes_per_token"), "graph_coverage": graphs.get("summary"),
                "bound": v.get("bound"),
                "bound_ratio": v.get("ratio"), "cpu_total_pct": cpu_pct(c),
                "matches_reference": c.get("matches_reference")})
    return row


def write_csv(cells: list[dict], path: Path) -> None:
    rows = [flat_row(c) for c in cells]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["layout"])
        writer.writeheader()
        writer.writerows(rows)


def projections(cells: list[dict], measured: ModelShape) -> list[dict]:
    """Per layout: its measured calls/token (spec none, lowest concurrency) projected onto each box at C=1, as the
    ideal floor (``tok_s``) and at the H200-measured kernel efficiencies (``calibrated_tok_s``)."""
    out, seen, eff = [], set(), load_efficiency()
    for c in cells:
        if c["spec_decode"] != "none" or c["layout"] in seen:
            continue
        seen.add(c["layout"])
        per_op = {k: v["calls_per_token"] for k, v in (c["comm_per_output_token"] or {}).get("per_op", {}).items()
                  if k.split("/")[0] != "broadcast"}
        depth = (measured.num_layers, measured.num_layers - measured.num_dense_layers)
        target = (KIMI_K2_INT4.num_layers, KIMI_K2_INT4.num_layers - KIMI_K2_INT4.num_dense_layers)
        layout = Layout(**c["parallel"]) if c.get("parallel") else c["layout"]  # the degrees run, overrides included
        calls = rescale_calls(per_op, layout, depth, target)
        for hw_name, hw in HARDWARE.items():
            p = project(layout, hw, KIMI_K2_INT4, batch=1, context=2048, comm_calls_per_token_by_op=calls,
                        efficiency=eff)
            out.append({"layout": c["layout"], "hardware": hw_name, "tok_s": 1 / p.floor_step_s,
                        "calibrated_tok_s": p.tok_s, "step_ms": p.step_s * 1e3, "bound": p.bound})
    return out


def write_markdown(cells: list[dict], proj: list[dict], path: Path, plots: list[str]) -> None:
    lines = ["# Bench summary", "",
             "Measured on this machine; see `telemetry_source` in the cell JSONs for what was sampled. On a CPU "
             "box with gloo the numbers rank host and interconnect overheads, not GPU kernels.", "",
             "`bound`: what the floor model names (the largest floor, or host/launch when the step is over twice the "
             "floors), then the measured step over the floors it explains; below 1× the step was faster than the "
             "floor, whose link or peak figures are then above this box's (on gloo over loopback, the interconnect "
             "floor uses the topology's link numbers).", "",
             "| " + " | ".join(h for _, h in COLUMNS) + " | calls/tok | bytes/tok | graphs | bound (step ÷ floor) "
             "| = ref |",
             "|" + "---|" * (len(COLUMNS) + 5)]
    for c in cells:
        r = flat_row(c)
        lines.append("| " + " | ".join(_fmt(r[k]) for k, _ in COLUMNS) + f" | {_fmt(r['comm_calls_per_token'])} | "
                     f"{_fmt(r['comm_bytes_per_token'])} | {r['graph_coverage'] or '-'} | "
                     f"{r['bound'] or '-'} (step {_fmt(r['bound_ratio'])}× floor) | "
                     f"{'✓' if r['matches_reference'] else '✗'} |")
    if proj:
        lines += ["", "## Projection (cost model, not measured): Kimi K2 INT4, batch 1, context 2048", "",
                  "Each layout's measured collective calls per output token, rescaled to 61 layers, on the "
                  "cost model's boxes (parameters and sources: docs/cost_model.md): ideal floor / calibrated at the "
                  f"kernel efficiencies measured on one H200 (docs/kernel_efficiency.json; {ASSUMPTION}).", "",
                  "| layout | " + " | ".join(HARDWARE) + " |", "|---|" + "---|" * len(HARDWARE)]
        by_layout: dict[str, dict] = {}
        for p in proj:
            by_layout.setdefault(p["layout"], {})[p["hardware"]] = p
        for lay, row in by_layout.items():
            lines.append(f"| {lay} | " + " | ".join(
                f"{row[h]['tok_s']:.0f} / {row[h]['calibrated_tok_s']:.0f} tok/s ({row[h]['bound']})"
                for h in HARDWARE) + " |")
    lines += ["", "Plots:", *[f"- `{p}`" for p in plots], ""]
    path.write_text("\n".join(lines))


def write_plots(cells: list[dict], proj: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    layouts = sorted({c["layout"] for c in cells})
    groups = sorted({(c["spec_decode"], c["context"]) for c in cells})

    def save(fig, name):
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(str(p))

    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.2), squeeze=False)
    for ax, (spec, ctx) in zip(axes[0], groups, strict=True):
        for lay in layouts:
            pts = sorted((c["concurrency"], c["output_throughput"] or 0) for c in cells
                         if c["layout"] == lay and c["spec_decode"] == spec and c["context"] == ctx)
            ax.plot(*zip(*pts, strict=True), marker="o", label=lay)
        ax.set(title=f"{spec}, ctx {ctx}", xlabel="concurrency", ylabel="output tok/s")
    axes[0][0].legend(fontsize=7)
    save(fig, "throughput_vs_concurrency.png")

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for i, lay in enumerate(layouts):
            sel = [c for c in cells if c["layout"] == lay and c["spec_decode"] == "none"]
            p50 = [c[f"median_{metric}_ms"] or 0 for c in sel]
            p99 = [c[f"p99_{metric}_ms"] or 0 for c in sel]
            xs = [j + i * 0.8 / len(layouts) for j in range(len(sel))]
            ax.bar(xs, p99, width=0.8 / len(layouts), alpha=0.4, color=f"C{i}")
            ax.bar(xs, p50, width=0.8 / len(layouts), label=lay, color=f"C{i}")
        ax.set(title=f"{metric.upper()} p50 (solid) / p99 (light), spec none", ylabel="ms", xlabel="cell (ctx×C)")
    axes[0].legend(fontsize=7)
    save(fig, "latency_percentiles.png")

    fig, ax = plt.subplots(figsize=(5, 3.2))
    vals = [max((c["comm_per_output_token"] or {}).get("bytes_per_token", 0) for c in cells if c["layout"] == lay)
            for lay in layouts]
    ax.bar(layouts, vals)
    ax.set(title="collective bytes per output token (rank 0)", ylabel="bytes")
    save(fig, "comm_bytes_per_token.png")

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for lay in layouts:
        pts = sorted((c["concurrency"], cpu_pct(c) or 0) for c in cells
                     if c["layout"] == lay and c["spec_decode"] == "none" and c["context"] == groups[0][1])
        ax.plot(*zip(*pts, strict=True), marker="o", label=lay)
    ax.set(title="host CPU utilisation (no GPU sampled)", xlabel="concurrency", ylabel="% of all cores")
    ax.legend(fontsize=7)
    save(fig, "utilisation.png")

    if proj:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        hws = list(HARDWARE)
        for i, lay in enumerate(layouts):
            ys = [next((p["calibrated_tok_s"] for p in proj if p["layout"] == lay and p["hardware"] == h), 0)
                  for h in hws]
            ax.bar([j + i * 0.8 / len(layouts) for j in range(len(hws))], ys, width=0.8 / len(layouts), label=lay)
        ax.set_xticks(range(len(hws)), hws)
        ax.set(title="PROJECTED decode tok/s, Kimi K2 INT4, C=1 (cost model, H200-calibrated)", ylabel="tok/s")
        ax.legend(fontsize=7)
        save(fig, "projected_tok_s.png")
    return paths


def write_reports(out_dir: str | Path, measured: ModelShape) -> dict:
    """Refreshes every report file from the cell JSONs in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    cells = load_cells(out_dir)
    proj = projections(cells, measured)
    write_csv(cells, out_dir / "summary.csv")
    plots = write_plots(cells, proj, out_dir) if cells else []
    write_markdown(cells, proj, out_dir / "summary.md", plots)
    return {"summary_csv": str(out_dir / "summary.csv"), "summary_md": str(out_dir / "summary.md"), "plots": plots}
