"""Logits of one causal forward per sequence, under any layout — a contract other tools rely on.

    python scripts/logits.py model.path=DIR parallel=NAME logits.input=IN.json logits.output=OUT.safetensors

IN.json: a list of token-id lists (any lengths; fewer sequences than DP ranks is fine).
OUT: ``seq_<i>`` float32 ``[len_i, vocab_size]``. Spawns its own ranks unless launched by torchrun.
"""

from __future__ import annotations

import json
import logging

import hydra
from common import CONF_DIR, layout_from, model_dir, prepare_ranks, setup_logging
from omegaconf import DictConfig
from preflight import one_line_errors, preflight
from safetensors.torch import save_file

from model.forward import full_logits
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.launch import launch

log = logging.getLogger("logits")


def read_input(path: str, vocab_size: int) -> list[list[int]]:
    seqs = json.loads(open(path).read())
    if not isinstance(seqs, list) or not seqs or not all(isinstance(s, list) and s for s in seqs):
        raise SystemExit(f"{path}: expected a non-empty JSON list of non-empty token-id lists")
    for i, s in enumerate(seqs):
        bad = [t for t in s if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise SystemExit(f"{path}: sequence {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
    return seqs


def rank_main(rank: int, layout, ckpt: str, seqs: list[list[int]], output: str) -> None:
    setup_logging(rank)
    model = load_model(ckpt, build_groups(layout))
    logits = full_logits(model, seqs)
    if logits is not None:
        save_file({f"seq_{i}": t.contiguous() for i, t in enumerate(logits)}, output)
        log.info("wrote %d sequences to %s", len(logits), output)


@hydra.main(config_path=CONF_DIR, config_name="logits", version_base=None)
@one_line_errors
def main(cfg: DictConfig) -> None:
    setup_logging()
    layout = layout_from(cfg)
    ckpt = model_dir(cfg)
    model_cfg = preflight(layout, ckpt, input=cfg.logits.input, output=cfg.logits.output, group="logits")
    seqs = read_input(cfg.logits.input, model_cfg.vocab_size)
    log.info("layout %s, %d sequences, checkpoint %s", layout.describe(), len(seqs), ckpt)
    _, backend, _ = prepare_ranks(cfg, layout)  # no device group: the logits script computes on the CPU (gloo)
    launch(layout.world_size, rank_main, layout, ckpt, seqs, cfg.logits.output, master_port=cfg.master_port,
           backend=backend)


if __name__ == "__main__":
    main()
