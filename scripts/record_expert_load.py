"""Records the expert load of a set of prompts — tokens routed to each logical expert per MoE layer — as a file that
seeds an expert placement (``eplb.placement_file``, ``docs/eplb.md``)::

    python scripts/record_expert_load.py --model model/zoo/tiny_kimi/target \
        --prompts model/zoo/tiny_kimi/eval_prompts.json --out /tmp/load.json
    python scripts/generate.py parallel=ep8 eplb.placement_file=/tmp/load.json eplb.redundant_experts=8 ...

``--prompts``: a JSON list of token-id lists or strings, or a ``{"prompts": [{"ids": [...]}, ...]}`` file (the zoo's
prompt files). One prefill forward per prompt on one rank (fp32, the reference kernels); the file holds
``{"load": [[tokens per expert] per MoE layer], "tokens": N, "prompts": K}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from model.expert_load import record_load
from model.loader import load_model
from model.tokenizer import load_tokenizer
from parallelism.comm import build_groups
from parallelism.layout import Layout


def read_prompts(path: str, model_dir: str) -> list[list[int]]:
    """Token-id lists from ``path`` (see the module docstring); strings are encoded with the model's tokenizer."""
    data = json.loads(Path(path).read_text())
    items = [p["ids"] for p in data["prompts"]] if isinstance(data, dict) else data
    tok = None
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            tok = tok or load_tokenizer(model_dir)
            if tok is None:
                raise SystemExit(f"{path}: prompt {i} is a string but {model_dir} has no tokenizer")
            item = tok.encode(item)
        if not isinstance(item, list) or not item or not all(isinstance(t, int) for t in item):
            raise SystemExit(f"{path}: prompt {i} must be a non-empty list of token ids or a string")
        out.append(item)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    seqs = read_prompts(args.prompts, args.model)
    load = record_load(load_model(args.model, build_groups(Layout())), seqs)
    Path(args.out).write_text(json.dumps({"load": load.tolist(), "tokens": sum(map(len, seqs)), "prompts": len(seqs)}))
    print(f"{args.out}: {load.shape[0]} MoE layers x {load.shape[1]} experts, {sum(map(len, seqs))} tokens")


if __name__ == "__main__":
    main()
