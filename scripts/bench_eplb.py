"""Expert placement on held-out traffic (``bench/eplb.py``): the built-in tiny_kimi target, its held-out prompts
split in two (even-numbered ones to fit a placement on, odd-numbered ones to measure it on), EP8 with 0, 1 and 2
redundant slots per rank; the router as trained, and with a synthetic Zipf-shaped skew on its choice bias::

    python scripts/bench_eplb.py --out docs/eplb/heldout.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.eplb import heldout_rows, skew_router
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout

MOE_EP = 8
REDUNDANT = (0, 8, 16)
ZOO = Path(__file__).resolve().parent.parent / "model" / "zoo" / "tiny_kimi"
SKEW = {"exponent": 1.2, "scale": 0.3}  # the synthetic arm's Zipf bias on the router's choice scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    zoo = ZOO
    prompts = [p["ids"] for p in json.loads((zoo / "eval_prompts.json").read_text())["prompts"]]
    fit, heldout = prompts[0::2], prompts[1::2]
    result = {}
    for arm in ("as trained", "synthetic skew"):
        model = load_model(zoo / "target", build_groups(Layout()))
        if arm == "synthetic skew":
            skew_router(model, **SKEW)
        result[arm] = heldout_rows(model, fit, heldout, MOE_EP, REDUNDANT)
        print(f"{arm}: busiest expert / mean per layer",
              " ".join(f"{h:.2f}" for h in result[arm]["busiest_expert_over_mean"]))
        for row in result[arm]["rows"]:
            held, fitted = (" ".join(f"{b:.3f}" for b in row[k]) for k in ("heldout", "in_sample"))
            print(f"  {row['placement']:<18} R={row['redundant']:<3} held-out {held} | in-sample {fitted}")
    result["skew"] = SKEW
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
