"""Markdown tables of the cost model (projections, hardware profiles, memory per rank) and its validation against
published single-box decode figures (:data:`PUBLISHED`). ``python -m bench.cost.tables`` prints them all."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.cost.efficiency import ASSUMPTION, KernelEfficiency, load_efficiency
from bench.cost.formulas import LAYOUTS, Projection, memory_fit, project, project_matrix
from bench.cost.hardware import B300_NVLINK5, H200_NVLINK4, HARDWARE, REF, RTX_PRO_6000_PCIE5, Hardware
from bench.cost.shapes import KIMI_K2_INT4, ModelShape

RTX6KPRO = "github.com/local-inference-lab/rtx6kpro"
# luke's 8-GPU table (rtx6kpro hardware/pcie-bandwidth.md): custom all-reduce 9.2 us at 8 KB, 16.5 us at 32 KB
# (NCCL 24.2 / 24.5 us); linear in size at Kimi's 14336-byte hidden row.
CUSTOM_AR_ALPHA_S = (9.2 + (14336 - 8192) / (32768 - 8192) * (16.5 - 9.2)) * 1e-6


def projection_table(projections: list[Projection]) -> str:
    """Markdown table of projections (times in ms)."""
    head = ("| box | layout | batch | context | memory ms | compute ms | comm ms | step ms | tok/s | tok/s/user "
            "| bound | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {p.hardware} | {p.layout} | {p.batch} | {p.context} | {p.memory_s * 1e3:.3f} | "
            f"{p.compute_s * 1e3:.3f} | {p.comm_s * 1e3:.3f} | {p.step_s * 1e3:.3f} | {p.tok_s:.1f} | "
            f"{p.tok_s_per_user:.1f} | {p.bound} | {'yes' if p.fits else 'no'} |" for p in projections]
    return "\n".join([head, *rows])


def hardware_table(hw: Hardware) -> str:
    """Markdown table of one profile's parameters with their sources."""
    rows = []
    for r in hw.parameters():
        value = r["value"] if isinstance(r["value"], str) else f"{r['value']:g} {r['unit']}"
        rows.append(f"| {r['parameter']} | {value} | {r['source']} |")
    return "\n".join([f"**{hw.name}**", "", "| parameter | value | source |", "|---|---|---|", *rows])



@dataclass(frozen=True)
class Published:
    """A published single-box decode figure to check projections against (tok/s per user at ``batch``)."""

    case: str
    hardware: Hardware
    model: ModelShape
    layout: str
    batch: int
    tok_s: float
    source: str
    note: str = ""
    alpha_s: float | None = None  # the all-reduce latency of that deployment when its source publishes one


# The autoregressive B300 figure is derived: 303 tok/s with speculative decoding at 2.15x over autoregressive.
B300_AR_TOK_S = 303 / 2.15

PUBLISHED: tuple[Published, ...] = (
    Published("origin story: Kimi K2.6, 8x RTX PRO 6000 PCIe, TP8, C=1", RTX_PRO_6000_PCIE5, KIMI_K2_INT4,
              "tp8", 1, 26.0, REF),
    Published("origin story: Kimi K2.6, 8x RTX PRO 6000 PCIe, EP8, C=1", RTX_PRO_6000_PCIE5, KIMI_K2_INT4,
              "ep8", 1, 65.0, REF, "EP8 with TP attention (vLLM --enable-expert-parallel, DP=1)"),
    Published("origin story: Kimi K2.6, 8x B300 NVLink5, TP8 + graphs, C=1, autoregressive", B300_NVLINK5,
              KIMI_K2_INT4, "tp8", 1, B300_AR_TOK_S, REF, "derived: 303 tok/s with spec decode / 2.15x"),
    Published("Kimi K2.5, 8x RTX PRO 6000 PCIe, vLLM TP8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, "tp8", 1, 90.0, REF,
              "concurrency not stated; compared at C=1"),
    Published("Kimi K2.5, 8x RTX PRO 6000 PCIe, SGLang EP8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, "ep8", 1, 101.0,
              f"{REF}; {RTX6KPRO} models/kimi-k25.md", "single batch; --tp 8 --ep 8 (TP attention) with luke's custom "
              "PCIe all-reduce, overclocked GDDR7; alpha = that all-reduce at 14 KB", CUSTOM_AR_ALPHA_S),
    Published("Kimi K2.6, 8x RTX PRO 6000 PCIe, vLLM TP8, C=1", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, "tp8", 1, 91.5,
              f"{RTX6KPRO} models/kimi-k26.md (DCP=1, no MTP, ctx 0)", "vLLM PCIe custom all-reduce (latency not "
              "published: NCCL alpha kept, comm an upper bound), fp8 KV, Triton MLA"),
)

# The speculative B300 figure: tau is not published, so it is solved for instead of compared.
B300_SPEC = Published("origin story: Kimi K2.6, 8x B300 NVLink5, TP8 + DFlash/DDTree, C=1", B300_NVLINK5,
                      KIMI_K2_INT4, "tp8", 1, 303.0, REF, "2.15x over autoregressive; tau not published")


def _project(pub: Published, context: int, efficiency: KernelEfficiency | None, **kw) -> Projection:
    hw = pub.hardware if pub.alpha_s is None else replace(pub.hardware, alpha_s=pub.alpha_s)
    return project(pub.layout, hw, pub.model, pub.batch, context, efficiency=efficiency, **kw)


def validate(context: int = 2048, verify_width: int = 8, efficiency: KernelEfficiency | None = None,
             **kw) -> list[dict]:
    """Projections against :data:`PUBLISHED`: the ideal floor, ``efficiency`` (default: the H200 file with the
    decode-step rule, "this engine") and the kernels-only rule (the file's cuBLAS figure for the dense class).

    Each row: ``case, layout, published_tok_s, floor_tok_s, projected_tok_s`` (calibrated), ``kernels_tok_s``,
    ``ratio`` (calibrated/published), ``error_pct``, ``unexplained_ms`` (published step − calibrated step),
    ``bound``, ``note``. Then the EP8/TP8 ratios, and the B300 speculative row, where the τ each model needs to
    reach 303 tok/s with a ``verify_width``-token verify step is reported instead of an error.
    ``context``: cached tokens per sequence (not published; an assumption)."""
    eff = load_efficiency() if efficiency is None else efficiency
    kern = KernelEfficiency(eff.data, "kernel")
    rows, by_case = [], {}
    for pub in PUBLISHED:
        fl, pr, kr = (_project(pub, context, e, **kw) for e in (None, eff, kern))
        ratio = pr.tok_s_per_user / pub.tok_s
        by_case[pub.case] = (pub, fl, pr, kr)
        rows.append({"case": pub.case, "layout": pub.layout, "published_tok_s": pub.tok_s,
                     "floor_tok_s": fl.tok_s_per_user, "projected_tok_s": pr.tok_s_per_user,
                     "kernels_tok_s": kr.tok_s_per_user, "ratio": ratio, "error_pct": 100 * (ratio - 1),
                     "unexplained_ms": (1 / pub.tok_s - pr.step_s) * 1e3, "bound": pr.bound,
                     "note": pub.note, "source": pub.source})
    cases = [p.case for p in PUBLISHED]
    for label, tp_case, ep_case in (("EP8/TP8, origin story (Kimi K2.6, PCIe)", cases[0], cases[1]),
                                    ("EP8/TP8, SGLang vs vLLM (Kimi K2.5, PCIe)", cases[3], cases[4])):
        (tp_pub, *tp), (ep_pub, *ep) = by_case[tp_case], by_case[ep_case]
        published = ep_pub.tok_s / tp_pub.tok_s
        fl, pr, kr = (e.tok_s_per_user / t.tok_s_per_user for e, t in zip(ep, tp, strict=True))
        rows.append({"case": label, "layout": "ep8/tp8", "published_tok_s": published, "floor_tok_s": fl,
                     "projected_tok_s": pr, "kernels_tok_s": kr, "ratio": pr / published,
                     "error_pct": 100 * (pr / published - 1), "unexplained_ms": None, "bound": "",
                     "note": "ratio of the two rows above", "source": REF})
    spec_row = {"case": B300_SPEC.case, "layout": "tp8", "published_tok_s": B300_SPEC.tok_s, "floor_tok_s": None,
                "projected_tok_s": None, "kernels_tok_s": None, "ratio": None, "error_pct": None,
                "unexplained_ms": None, "source": REF}
    for key, e in (("floor", None), ("calibrated", eff)):
        ar = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, context, efficiency=e, **kw)
        spec = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, context, tokens_per_seq=verify_width, efficiency=e, **kw)
        spec_row[f"tau_needed_{key}"] = B300_SPEC.tok_s * spec.step_s
        spec_row[f"tau_for_2_15x_{key}"] = 2.15 * spec.step_s / ar.step_s
        spec_row["bound"] = spec.bound
    spec_row["note"] = (f"tau is not published: tau needed for 303 tok/s with a {verify_width}-token verify step "
                        "(drafter cost ignored), and tau that 2.15x implies over the projected autoregressive step")
    rows.append(spec_row)
    return rows


def validation_table(rows: list[dict]) -> str:
    """Markdown table of :func:`validate` rows."""
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    head = ("| case | published | ideal floor | calibrated | kernels only | calibrated/published | "
            "unexplained ms/step | note |\n|---|---|---|---|---|---|---|---|")
    out = []
    for r in rows:
        note = r["note"]
        if "tau_needed_floor" in r:
            note = (f"tau needed: floor {r['tau_needed_floor']:.2f}, calibrated {r['tau_needed_calibrated']:.2f}; "
                    f"tau implied by 2.15x: floor {r['tau_for_2_15x_floor']:.2f}, calibrated "
                    f"{r['tau_for_2_15x_calibrated']:.2f}. {note}")
        num = ".2f" if r["layout"] == "ep8/tp8" else ".1f"
        out.append(f"| {r['case']} | {f(r['published_tok_s'], num)} | {f(r['floor_tok_s'], num)} | "
                   f"{f(r['projected_tok_s'], num)} | {f(r['kernels_tok_s'], num)} | {f(r['ratio'], '.2f')} | "
                   f"{f(r['unexplained_ms'], '.2f')} | {note} |")
    return "\n".join([head, *out])


def calibrated_table(projections: list[Projection]) -> str:
    """Markdown table: the ideal floor and the calibrated projection side by side (tok/s per user and in all)."""
    head = ("| box | layout | batch | floor step ms | calibrated step ms | floor tok/s | calibrated tok/s | "
            "calibrated/floor | bound |\n|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {p.hardware} | {p.layout} | {p.batch} | {p.floor_step_s * 1e3:.2f} | {p.step_s * 1e3:.2f} | "
            f"{p.batch * p.tau / p.floor_step_s:.0f} | {p.tok_s:.0f} | {p.floor_step_s / p.step_s:.2f} | {p.bound} |"
            for p in projections]
    return "\n".join([head, *rows])


def memory_table(model: ModelShape = KIMI_K2_INT4, boxes: tuple[Hardware, ...] = (H200_NVLINK4, B300_NVLINK5),
                 utilization: float = 0.9) -> str:
    """Markdown table of :func:`bench.cost.formulas.memory_fit` for every preset on ``boxes``."""
    head = (f"| box | layout | weights GB/rank | fits at {utilization:.0%} | KV room GB/rank | KV tokens/rank | "
            "KV tokens/box |\n|---|---|---|---|---|---|---|")
    rows = []
    for hw in boxes:
        for name in LAYOUTS:
            m = memory_fit(name, hw, model, utilization)
            rows.append(f"| {hw.name} | {name} | {m['weights'] / 1e9:.1f} | {'yes' if m['fits'] else 'no'} | "
                        f"{m['kv_room'] / 1e9:.1f} | {m['kv_tokens_rank']:,} | {m['kv_tokens_box']:,} |")
    return "\n".join([head, *rows])


def main() -> None:
    eff = load_efficiency()
    print(f"# Calibration: {eff.label}\n# {ASSUMPTION}\n")
    print("## Validation (Kimi K2.x INT4, C=1, context 2048)\n")
    print(validation_table(validate(efficiency=eff)))
    print("\n## Floor vs calibrated, Kimi K2.x INT4, context 4096\n")
    print(calibrated_table(project_matrix(batches=(1, 8, 64), context=4096, efficiency=eff)))
    print("\n## Weights and KV room per rank, Kimi K2.6 INT4 (bf16 KV, MLA 576 elements/token/layer)\n")
    print(memory_table())
    print("\n## Hardware profiles\n")
    print("\n\n".join(hardware_table(hw) for hw in HARDWARE.values()))


if __name__ == "__main__":
    main()
