"""Batch generation through the engine — a contract:

    python scripts/generate.py model.path=DIR parallel=NAME generate.input=IN.json generate.output=OUT.json \
        generate.max_tokens=N generate.ignore_eos=true sampling.temperature=0

IN.json: a list of token-id lists or strings (strings use the checkpoint's tokenizer). All requests are
submitted together and batched by the scheduler. OUT.json: ``{"outputs": [{"token_ids", "text",
"finish_reason"}], "stats": {...}}``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from common import CONF_DIR, engine_keys, layout_from, model_dir, prepare_ranks, setup_logging, spec_config
from omegaconf import DictConfig
from preflight import one_line_errors, preflight

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.snapshot import expert_load
from engine.worker.kv_budget import size_kv_cache
from engine.worker.loop import make_runner, worker_loop
from model.loader import DeviceConfig, load_target
from model.tokenizer import load_tokenizer
from parallelism.comm import build_groups
from parallelism.launch import launch
from spec_decode.speculation import load_speculation

log = logging.getLogger("generate")


def scheduler_config(cfg: DictConfig) -> EngineConfig:
    return EngineConfig.flat(**engine_keys(cfg))


def sampling_params(cfg: DictConfig) -> SamplingParams:
    s, g = cfg.sampling, cfg.generate
    return SamplingParams(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p),
                          min_p=float(s.min_p), seed=s.seed, max_tokens=int(g.max_tokens),
                          min_tokens=int(g.min_tokens), ignore_eos=bool(g.ignore_eos))


def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    """Submits every prompt, steps until all finish; returns token ids and finish reasons in order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, dict] = {}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_tokens
            if out.finished:
                done[out.request_id] = {"token_ids": tokens[out.request_id], "finish_reason": out.finish_reason}
    return [done[str(i)] for i in range(len(prompts))]


def rank_main(rank: int, layout, ckpt: str, prompts, params, sched_cfg, seed: int, output: str, spec,
              device: DeviceConfig) -> None:
    setup_logging(rank)
    model = load_target(ckpt, build_groups(layout), rank, device)
    speculation = load_speculation(spec, model)
    sched_cfg = size_kv_cache(model, sched_cfg, speculation)
    if rank != 0:
        worker_loop(make_runner(model, sched_cfg, speculation))
        return
    tok = load_tokenizer(ckpt)
    engine = Engine(model, sched_cfg, seed, speculation=speculation, tokenizer=tok)
    if sched_cfg.runner.warm_up:  # JIT and capture before the decode clock starts
        engine.warm_up()
    model.groups.counter.reset()
    outputs = generate_all(engine, prompts, params)
    load = expert_load(engine)  # before shutdown: a round trip with every rank
    engine.shutdown()
    for o in outputs:
        o["text"] = tok.decode(o["token_ids"]) if tok else ""
    s = engine.stats
    stats = {
        "decode_tokens_per_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
        "prefill_tokens_per_s": s.prefill_tokens / s.prefill_s if s.prefill_s else 0.0,
        "steps": s.steps, "step_kinds": s.step_kinds,
        "kv_blocks_in_use": engine.scheduler.blocks_in_use(),
        "comm": model.groups.counter.snapshot(),
        "layout": layout.describe(),
        "spec_decode": spec.method,
        "acceptance_length": s.acceptance_length,
        "warmup_s": s.warmup_s,
        "host_s_per_step": {phase: t / max(s.steps, 1) for phase, t in s.host_s.items()},
        "idle_s": s.idle_s,
        "expert_load": load,
    }
    if engine.balancer is not None:  # eplb.enabled: rebalances and each layer's balancedness over the run's windows
        stats |= engine.balancer.run_figures()
    Path(output).write_text(json.dumps({"outputs": outputs, "stats": stats}, indent=1))
    log.info("wrote %d outputs to %s (%.1f decode tok/s)", len(outputs), output, stats["decode_tokens_per_s"])


def read_prompts(path: str, ckpt: str) -> list[list[int]]:
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise SystemExit(f"{path}: expected a non-empty JSON list of prompts")
    tok = None
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            tok = tok or load_tokenizer(ckpt)
            if tok is None:
                raise SystemExit(f"{path}: prompt {i} is a string but {ckpt} has no tokenizer.json")
            item = tok.encode(item)
        if not isinstance(item, list) or not all(isinstance(t, int) for t in item):
            raise SystemExit(f"{path}: prompt {i} must be a string or a list of token ids")
        prompts.append(item)
    return prompts


@hydra.main(config_path=CONF_DIR, config_name="generate", version_base=None)
@one_line_errors
def main(cfg: DictConfig) -> None:
    setup_logging()
    layout, ckpt = layout_from(cfg), model_dir(cfg)
    spec = spec_config(cfg)
    model_cfg = preflight(layout, ckpt, drafter=spec.drafter_path if spec.enabled else None,
                          input=cfg.generate.input, output=cfg.generate.output)
    device, backend, _ = prepare_ranks(cfg, layout)
    prompts = read_prompts(cfg.generate.input, ckpt)
    params, sched_cfg = sampling_params(cfg), scheduler_config(cfg).for_model(model_cfg.max_position_embeddings)
    launch(layout.world_size, rank_main, layout, ckpt, prompts, params, sched_cfg, int(cfg.engine.seed),
           cfg.generate.output, spec, device, master_port=cfg.master_port, backend=backend)


if __name__ == "__main__":
    main()
