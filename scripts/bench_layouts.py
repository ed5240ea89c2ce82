"""The topology A/B: the same weights under each layout, a closed-loop sweep through gRPC.

    python scripts/bench_layouts.py -m parallel=tp8,ep8,dp8_ep8,tp2_ep4 bench.context=[64,256] bench.concurrency=[1,4]

Per layout (one hydra job each, outermost) and spec mode: one server lifetime (``scripts/serve.py``), then
``bench.warmup`` warm-up requests, then ``bench.context × bench.concurrency`` cells of ≥ 5·C measured prompts of
fixed output length, greedy. Every cell writes ``cell_*.json`` to ``bench.output_dir``: ``vllm bench
serve``-named metrics, τ, collective calls/bytes per output token, CUDA-graph coverage, telemetry, a
verdict against the floors, and whether its tokens equal the reference layout's (the first layout run).
After each layout ``summary.csv``, ``summary.md`` and PNG plots are refreshed.

NVLink vs PCIe on one NVLink box: ``-m parallel=tp8,ep8 topology=nvlink,pcie``. Each server applies the mode
(``scripts/common.py`` ``prepare_ranks``: NCCL's switches before its ranks start), cells record the plan, and a mode
other than ``auto`` labels the layout ``tp8@pcie`` in files and reports; the tokens must still equal the first
job's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from common import CONF_DIR, layout_from, model_dir, prepare_ranks
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from bench.run import sweep


@hydra.main(config_path=CONF_DIR, config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO)
    layout, ckpt = layout_from(cfg), model_dir(cfg)
    task = list(HydraConfig.get().overrides.task)
    if any(o.lstrip("+").split("=", 1)[0] == "spec_decode" for o in task):
        raise SystemExit("bench: choose the spec modes with bench.spec=[none,ddtree,...], not spec_decode=...")
    _, _, topology = prepare_ranks(cfg, layout, environ={})  # refuses early; the servers apply it themselves
    out_dir = Path(cfg.bench.output_dir)
    if not out_dir.is_absolute():
        out_dir = Path(hydra.utils.get_original_cwd()) / out_dir
    paths = sweep(cfg, layout, ckpt, HydraConfig.get().runtime.choices.get("parallel"), topology, task, out_dir)
    print(Path(paths["summary_md"]).read_text())
    print("plots:", *paths["plots"], sep="\n  ")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
