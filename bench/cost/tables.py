"""Markdown tables of the cost model (projections, hardware profiles) and its validation against published
single-box decode figures (:data:`PUBLISHED`)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.cost.formulas import Projection, project
from bench.cost.hardware import B300_NVLINK5, REF, RTX_PRO_6000_PCIE5, Hardware
from bench.cost.shapes import KIMI_K2_INT4, ModelShape


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
              REF, "concurrency not stated; compared at C=1; assumed TP attention (no DP attention)"),
)

# The speculative B300 figure: tau is not published, so it is solved for instead of compared.
B300_SPEC = Published("origin story: Kimi K2.6, 8x B300 NVLink5, TP8 + DFlash/DDTree, C=1", B300_NVLINK5,
                      KIMI_K2_INT4, "tp8", 1, 303.0, REF, "2.15x over autoregressive; tau not published")


def validate(context: int = 2048, verify_width: int = 8, **kw) -> list[dict]:
    """Projections against :data:`PUBLISHED` (pure floors unless ``kw`` adds ``host_overhead_s``).

    Each row: ``case, layout, published_tok_s, projected_tok_s, ratio`` (projected/published),
    ``error_pct`` (100·(ratio−1)), ``unexplained_ms`` (published step − projected step: what the floors miss),
    ``bound``, ``note``. Then the EP8/TP8 ratios, and the B300 speculative row, where the τ that the model
    needs to reach 303 tok/s with a ``verify_width``-token verify step is reported instead of an error.
    ``context``: cached tokens per sequence (not published; an assumption)."""
    rows = []
    by_case = {}
    for pub in PUBLISHED:
        pr = project(pub.layout, pub.hardware, pub.model, pub.batch, context, **kw)
        ratio = pr.tok_s_per_user / pub.tok_s
        by_case[pub.case] = (pub, pr)
        rows.append({"case": pub.case, "layout": pub.layout, "published_tok_s": pub.tok_s,
                     "projected_tok_s": pr.tok_s_per_user, "ratio": ratio, "error_pct": 100 * (ratio - 1),
                     "unexplained_ms": (1 / pub.tok_s - pr.step_s) * 1e3, "bound": pr.bound,
                     "note": pub.note, "source": pub.source})
    cases = [p.case for p in PUBLISHED]
    for label, tp_case, ep_case in (("EP8/TP8, origin story (Kimi K2.6, PCIe)", cases[0], cases[1]),
                                    ("EP8/TP8, SGLang vs vLLM (Kimi K2.5, PCIe)", cases[3], cases[4])):
        (tp_pub, tp_pr), (ep_pub, ep_pr) = by_case[tp_case], by_case[ep_case]
        published, projected = ep_pub.tok_s / tp_pub.tok_s, ep_pr.tok_s_per_user / tp_pr.tok_s_per_user
        rows.append({"case": label, "layout": "ep8/tp8",
                     "published_tok_s": published, "projected_tok_s": projected, "ratio": projected / published,
                     "error_pct": 100 * (projected / published - 1), "unexplained_ms": None, "bound": "",
                     "note": "ratio of the two rows above", "source": REF})
    ar = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, context, **kw)
    spec = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, context, tokens_per_seq=verify_width, **kw)
    tau_needed = B300_SPEC.tok_s * spec.step_s
    rows.append({"case": B300_SPEC.case, "layout": "tp8", "published_tok_s": B300_SPEC.tok_s,
                 "projected_tok_s": None, "ratio": None, "error_pct": None, "unexplained_ms": None,
                 "bound": spec.bound, "tau_needed": tau_needed,
                 "tau_for_2_15x": 2.15 * spec.step_s / ar.step_s, "source": REF,
                 "note": f"tau is not published: tau the floors need for 303 tok/s with a {verify_width}-token "
                         "verify step (drafter cost ignored), and tau that 2.15x implies over the projected "
                         "autoregressive step"})
    return rows


def validation_table(rows: list[dict]) -> str:
    """Markdown table of :func:`validate` rows."""
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    head = ("| case | published | projected | projected/published | error | unexplained ms/step | note |\n"
            "|---|---|---|---|---|---|---|")
    out = []
    for r in rows:
        note = r["note"]
        if "tau_needed" in r:
            note = f"tau needed {r['tau_needed']:.2f}; tau implied by 2.15x {r['tau_for_2_15x']:.2f}. {note}"
        num = ".2f" if r["layout"] == "ep8/tp8" else ".1f"
        out.append(f"| {r['case']} | {f(r['published_tok_s'], num)} | {f(r['projected_tok_s'], num)} | "
                   f"{f(r['ratio'], '.2f')} | {f(r['error_pct'], '+.0f')}{'' if r['error_pct'] is None else ' %'} | "
                   f"{f(r['unexplained_ms'], '.2f')} | {note} |")
    return "\n".join([head, *out])
