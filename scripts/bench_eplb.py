"""Expert placement on held-out traffic (``bench/eplb.py``): the built-in tiny_kimi target, its held-out prompts
split in two (even-numbered ones to fit a placement on, odd-numbered ones to measure it on), EP8 with 0, 1 and 2
redundant slots per rank; the router as trained, and with a synthetic Zipf-shaped skew on its choice bias::

    python scripts/bench_eplb.py --out docs/eplb/heldout.json

``--serving OUT``: the same model served by the engine on 8 gloo ranks (ep8, one redundant slot per rank,
``engine.batch_invariant``, all 29 held-out prompts at once, 64 new tokens each), once with the balancer off
(control) and once rebalancing every 8 steps: decode step-time percentiles with and without a move before the step,
bytes moved, each window's balancedness at the placement it ran on (after the rebalances before it, computed on
earlier windows) against the starting placement's on the same window, and whether the tokens are the same::

    python scripts/bench_eplb.py --out docs/eplb/heldout.json --serving docs/eplb/serving.json

``--project OUT``: the cost model's decode tokens/s for Kimi K2.x (INT4 experts) on 8×H200 and 8×RTX PRO 6000 at
the serving run's balancedness — the starting placement's and the rebalanced one's, each the mean over the windows
from step 32 on — for ep8 and dp8_ep8 at 8 and 128 tokens per rank: projections, labelled so (from a serving run
already written: ``--serving-json FILE`` instead of ``--serving``)::

    python scripts/bench_eplb.py --serving-json docs/eplb/serving.json --project docs/eplb/projection.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sysconfig
import tempfile
from pathlib import Path

from train_tiny import RunConfig, read_texts, split_files, stdlib_files

from bench.eplb import heldout_rows, projections, serving_rank, skew_router, step_percentiles
from model.config import load_config
from model.loader import load_model
from model.tokenizer import load_tokenizer
from parallelism.comm import build_groups
from parallelism.expert_slots import EPLBConfig, initial_expert_slots
from parallelism.launch import launch
from parallelism.layout import Layout

MOE_EP = 8
REDUNDANT = (0, 8, 16)
SERVING_TOKENS = 64
WINDOW = 512  # tokens per forward of the held-out files
ZOO = Path(__file__).resolve().parent.parent / "model" / "zoo" / "tiny_kimi"
SKEW = {"exponent": 1.2, "scale": 0.3}  # the synthetic arm's Zipf bias on the router's choice scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="run the held-out placement bench and write it here")
    ap.add_argument("--serving", help="run the serving comparison and write it here")
    ap.add_argument("--serving-json", help="a serving comparison already written, for --project")
    ap.add_argument("--project", help="project the serving run's balancedness onto Kimi K2 and write it here")
    args = ap.parse_args()
    if args.out:
        heldout(args.out)
    if args.serving:
        serving(ZOO, args.serving)
    if args.project:
        if not (args.serving or args.serving_json):
            raise SystemExit("--project needs --serving or --serving-json")
        project(args.serving or args.serving_json, args.project)


def heldout(out: str) -> None:
    result = {"skew": SKEW, "traffic": {}}
    for source, (fit, measured) in traffic().items():
        result["traffic"][source] = arms = {}
        for arm in ("as trained", "synthetic skew"):
            model = load_model(ZOO / "target", build_groups(Layout()))
            if arm == "synthetic skew":
                skew_router(model, **SKEW)
            arms[arm] = heldout_rows(model, fit, measured, MOE_EP, REDUNDANT)
            print(f"{source}, {arm}: busiest expert / mean per layer",
                  " ".join(f"{h:.2f}" for h in arms[arm]["busiest_expert_over_mean"]))
            for row in arms[arm]["rows"]:
                held, fitted = (" ".join(f"{b:.3f}" for b in row[k]) for k in ("heldout", "in_sample"))
                print(f"  {row['placement']:<18} R={row['redundant']:<3} held-out {held} | in-sample {fitted}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def traffic() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Two sources, each (fit, measure): the zoo's 29 held-out prompts (even-numbered / odd-numbered), and the
    standard-library files the tiny model's training held out (``scripts/train_tiny.py``'s split of this Python's
    stdlib), tokenized and cut into windows of ``WINDOW`` tokens (even-numbered files / odd-numbered files)."""
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"]]
    run = RunConfig()
    root = sysconfig.get_paths()["stdlib"]
    _, held = split_files(stdlib_files(root, run.max_file_bytes), root, run.heldout_frac, run.seed)
    tok = load_tokenizer(str(ZOO / "target"))

    def windows(files: list[Path]) -> list[list[int]]:
        ids = [t for text in read_texts(files) for t in tok.encode(text)]
        return [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]

    return {"eval prompts": (prompts[0::2], prompts[1::2]), "held-out stdlib files": (windows(held[0::2]),
                                                                                       windows(held[1::2]))}


def plot_windows(windows: list[dict], path: Path) -> None:
    """Each window's balancedness (mean over MoE layers) at the placement it ran on and at the starting placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [w["step"] for w in windows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for key, label in (("balancedness", "placement it ran on (rebalancing)"),
                       ("at_start_placement", "starting placement")):
        ax.plot(steps, [sum(w[key]) / len(w[key]) for w in windows], marker="o", label=label)
    ax.set_xlabel("window ending at step")
    ax.set_ylabel("balancedness (mean / max rank tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_title("tiny_kimi, ep8, 24 slots: the same windows under two placements (CPU)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def project(serving_json: str, out: str) -> None:
    windows = [w for w in json.loads(Path(serving_json).read_text())["balancer"]["windows"] if w["step"] >= 32]
    static, balanced = (sum(b for w in windows for b in w[k]) / sum(len(w[k]) for w in windows)
                        for k in ("at_start_placement", "balancedness"))
    rows = projections(static, balanced, {"ep8": (8, 128), "dp8_ep8": (64, 1024)})
    Path(out).write_text(json.dumps({"note": "cost-model projection, not a measurement", "balancedness_static": static,
                                     "balancedness_balanced": balanced, "rows": rows}, indent=1, default=float))
    print(f"projection at balancedness {static:.3f} (static) and {balanced:.3f} (rebalanced):")
    for r in rows:
        print(f"  {r['hardware']:<13} {r['layout']:<8} batch {r['batch']:<4} {r['tok_s_static']:8.0f} -> "
              f"{r['tok_s_balanced']:8.0f} tok/s ({r['ratio']:.3f}x, {r['bound_static']} bound)")


def serving(zoo: Path, out: str) -> None:
    prompts = [p["ids"] for p in json.loads((zoo / "eval_prompts.json").read_text())["prompts"]]
    base = Layout(world_size=8, attn_tp=8, moe_ep=8)
    cfg = load_config(zoo / "target")
    slots = initial_expert_slots(EPLBConfig(redundant_experts=8), sum(cfg.moe_layers), cfg.moe.num_experts, 8)
    layout = dataclasses.replace(base, expert_slots=slots)
    common = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512, batch_invariant=True)
    arms = {"control": common, "rebalancing": common | dict(eplb_enabled=True, eplb_window_steps=8,
                                                             eplb_interval_steps=8, eplb_min_gain=0.01)}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, keys in arms.items():
            path = f"{tmp}/{arm}.json"
            launch(8, serving_rank, layout, keys, prompts, SERVING_TOKENS, path, backend="gloo")
            runs[arm] = json.loads(Path(path).read_text())
    control, moving = runs["control"], runs["rebalancing"]
    result = {"tokens_equal": control["tokens"] == moving["tokens"],
              "decode_steps": {arm: step_percentiles(r["steps"]) for arm, r in runs.items()},
              "balancer": moving["expert_load"]["balancer"],
              "setup": {"layout": "ep8, 24 slots (16 experts + 8 redundant)", "prompts": len(prompts),
                        "new_tokens": SERVING_TOKENS, "engine": arms}}
    Path(out).write_text(json.dumps(result, indent=1))
    plot_windows(result["balancer"]["windows"], Path(out).with_suffix(".png"))
    c, m = result["decode_steps"]["control"]["all"], result["decode_steps"]["rebalancing"]
    print(f"tokens equal: {result['tokens_equal']}; decode p50/p99 ms control {c['p50_ms']:.1f}/{c['p99_ms']:.1f}, "
          f"rebalancing {m['all']['p50_ms']:.1f}/{m['all']['p99_ms']:.1f} (steps after a move: "
          f"{m['with_a_move']})")
    for w in result["balancer"]["windows"]:
        print(f"  window to step {w['step']}: balancedness", " ".join(f"{b:.3f}" for b in w["balancedness"]),
              "| at the starting placement", " ".join(f"{b:.3f}" for b in w["at_start_placement"]))
    print("balancer", {k: v for k, v in result["balancer"].items() if k != "windows"})


if __name__ == "__main__":
    main()
