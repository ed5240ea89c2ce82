"""``make demo``: the same tiny DeepSeek-V3 checkpoint under every layout — max logit difference vs the
single-rank result and collective calls/bytes per token of each layout, side by side.

This is a correctness-and-communication A/B on gloo/CPU: the bytes are what each layout would move;
wall-clock time here says nothing about GPUs.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import hydra
import torch
from common import CONF_DIR, model_dir
from omegaconf import DictConfig, OmegaConf

from model.forward import full_logits
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.launch import launch
from parallelism.layout import Layout

log = logging.getLogger("demo")


def preset_layout(name: str) -> Layout:
    return Layout(**OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "parallel" / f"{name}.yaml")))


def rank_main(rank: int, layout: Layout, ckpt: str, seqs: list[list[int]], out: str) -> None:
    torch.set_num_threads(1)
    groups = build_groups(layout)
    model = load_model(ckpt, groups)
    groups.counter.reset()
    logits = full_logits(model, seqs)
    stats = groups.world.gather_objects((dict(groups.counter.calls), dict(groups.counter.bytes)))
    if logits is not None:
        torch.save({"logits": logits, "stats": stats}, out)


def run_layout(name: str, layout: Layout, ckpt: str, seqs: list[list[int]], tmp: Path) -> tuple[list, list]:
    out = tmp / f"{name}.pt"
    launch(layout.world_size, rank_main, layout, ckpt, seqs, str(out))
    result = torch.load(out)
    return result["logits"], result["stats"]


def summarise(stats: list, num_tokens: int) -> tuple[float, float, str]:
    """Mean per-rank collective calls and bytes per token, and the ops involved."""
    calls = sum(sum(c.values()) for c, _ in stats) / len(stats)
    nbytes = sum(sum(b.values()) for _, b in stats) / len(stats)
    ops = sorted({f"{g}/{op}" for c, _ in stats for (g, op) in c})
    return calls / num_tokens, nbytes / num_tokens, ", ".join(ops) or "-"


@hydra.main(config_path=CONF_DIR, config_name="demo", version_base=None)
def main(cfg: DictConfig) -> None:
    ckpt = model_dir(cfg)
    gen = torch.Generator().manual_seed(cfg.demo.seed)
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    lens = torch.randint(4, cfg.demo.max_len + 1, (cfg.demo.num_sequences,), generator=gen).tolist()
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    tokens = sum(lens)
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name in cfg.demo.layouts:
            layout = preset_layout(name)
            logits, stats = run_layout(name, layout, ckpt, seqs, Path(tmp))
            if reference is None:
                reference = logits
            diff = max(float((a - b).abs().max()) for a, b in zip(logits, reference, strict=True))
            calls, nbytes, ops = summarise(stats, tokens)
            rows.append({"preset": name, "layout": layout.describe(), "max_abs_logit_diff_vs_first": diff,
                         "calls_per_token": calls, "bytes_per_token": nbytes, "ops": ops})
    print(f"\nSwitchyard layout A/B — {ckpt}, {len(seqs)} sequences, {tokens} tokens, one causal forward\n")
    print(f"| preset | layout | max abs Δlogit vs {cfg.demo.layouts[0]} | calls/token | bytes/token | collectives |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['layout']} | {r['max_abs_logit_diff_vs_first']:.2e} | "
              f"{r['calls_per_token']:.3f} | {r['bytes_per_token']:.0f} | {r['ops']} |")
    Path(cfg.demo.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.demo.output).write_text(json.dumps({"tokens": tokens, "rows": rows}, indent=2))
    print(f"\nwrote {cfg.demo.output}")


if __name__ == "__main__":
    main()
