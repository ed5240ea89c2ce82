"""The gRPC service — a contract:

    python scripts/serve.py model.path=DIR parallel=NAME server.host=127.0.0.1 server.port=P [spec_decode=ddtree]

serves ``vllm.grpc.engine.VllmEngine`` (the SMG worker protocol), ``switchyard.v1.EngineInfo``,
``grpc.health.v1`` and server reflection until SIGTERM; it is ready when grpc health says SERVING. SIGTERM
drains (in-flight requests finish, up to ``server.drain_timeout_s``) and exits 0. A rank that dies, crashes or
hangs past ``server.step_timeout_s`` ends the open streams UNAVAILABLE and the process exits non-zero.

Processes: with more than one rank this process only launches and joins them (``parallelism/launch.py``).
Rank 0 runs the server and the engine; on SIGTERM/SIGINT this process forwards SIGTERM to rank 0 alone, which
drains and then releases the other ranks. The other ranks ignore SIGTERM/SIGINT (a SIGTERM to the whole
process group still drains); they end with rank 0's shutdown broadcast, with a collective error when a peer
dies, or by SIGKILL from rank 0 on its fatal path (or from the launcher, 30 s after a rank failed). Any rank
exiting non-zero makes this process exit 1.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys

import hydra
import torch
from common import CONF_DIR, engine_keys, layout_from, model_dir, prepare_ranks, setup_logging, spec_config
from omegaconf import DictConfig, OmegaConf
from preflight import debug_requested, one_line, one_line_errors, preflight
from settings import typed

from engine.config import EngineConfig
from engine.engine import Engine
from engine.reasoning import ReasoningParser
from engine.sampling.grammar import GrammarBackend
from engine.worker.kv_budget import size_kv_cache
from engine.worker.loop import make_runner, worker_loop
from engine.worker.telemetry import rank_sampler
from model.loader import DeviceConfig, load_target
from model.tokenizer import load_tokenizer
from parallelism.comm import build_groups
from parallelism.launch import launch
from spec_decode.speculation import load_speculation

log = logging.getLogger("serve")


def configs(cfg: DictConfig):
    from rpc.server import ServerConfig

    server = ServerConfig(**typed(OmegaConf.to_container(cfg.server, resolve=True), "server", ServerConfig))
    e = engine_keys(cfg)
    e["max_num_seqs"] = server.max_num_seqs
    return EngineConfig.flat(**e), server


def what_is_on(layout: str, spec, engine: EngineConfig, server) -> str:
    """One line of what this server runs: layout, speculation, KV tiers, PD role, expert balancing, ports."""
    c = engine.cache
    tiers = ["device (its size is logged once the weights are in)"]
    if c.host_kv_cache_gb:
        tiers.append(f"host {c.host_kv_cache_gb:g} GiB per DP group")
    if c.kv_store != "none":
        tiers.append(f"store {c.kv_store} at {c.kv_store_master} (rank 0 says below whether it answered)")
    speculation = f"{spec.method} budget {spec.budget}" if spec.enabled else "off"
    balancing = "on" if engine.balancer.eplb_enabled else "off"
    metrics = f"/metrics on {server.metrics_port}" if server.metrics_port is not None else "/metrics off"
    return (f"layout {layout}; speculation {speculation}; KV tiers: {', '.join(tiers)}; PD role {server.kv_role}; "
            f"expert rebalancing {balancing}; gRPC on {server.host}:{server.port}; {metrics}")


def rank_main(rank: int, layout, ckpt: str, sched_cfg: EngineConfig, server_cfg, spec, seed: int,
              rank0_pid, device: DeviceConfig) -> None:
    setup_logging(rank)
    if rank == 0:
        from rpc.server import request_stop_on_signals

        rank0_pid.value = os.getpid()
        request_stop_on_signals()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then releases us (or SIGKILLs us)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups = build_groups(layout)
    model = load_target(ckpt, groups, rank, device)
    speculation = load_speculation(spec, model)
    sched_cfg = size_kv_cache(model, sched_cfg, speculation)
    grammar = GrammarBackend.for_checkpoint(ckpt, model.cfg.vocab_size, tuple(model.cfg.eos_token_ids)) \
        if load_tokenizer(ckpt) is not None else None  # every rank of a DP group keeps its requests' matchers
    if grammar is not None:
        grammar.compile_soon()  # the tokenizer info (most of a first compile) before the first constrained step
    ranks = groups.world.gather_objects({"rank": rank, "pid": os.getpid(), "host": socket.gethostname()})
    # each rank samples its own device on a thread of its own; the samples reach rank 0 with the step gathers
    telemetry = rank_sampler(model.device, server_cfg.telemetry_interval_s).start() \
        if server_cfg.metrics_port is not None else None
    if rank != 0:
        worker_loop(make_runner(model, sched_cfg, speculation, grammar), telemetry)
        return
    from rpc.server import serve  # grpc is imported after the fork, in rank 0 only

    engine = Engine(model, sched_cfg, seed, speculation=speculation, tokenizer=load_tokenizer(ckpt), grammar=grammar,
                    telemetry=telemetry)
    if sched_cfg.runner.warm_up:  # every static shape before the first request (on CUDA: captured)
        engine.warm_up()
    serve(engine, ckpt, server_cfg, ranks)


def forward_stop(rank0_pid) -> None:
    """In the launcher: SIGTERM/SIGINT go to rank 0 (which drains), not to the whole job."""
    def handler(signum, frame):
        if rank0_pid.value:
            os.kill(rank0_pid.value, signal.SIGTERM)
        else:  # rank 0 has not started: nothing to drain
            for child in mp.active_children():
                child.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


@hydra.main(config_path=CONF_DIR, config_name="serve", version_base=None)
@one_line_errors
def main(cfg: DictConfig) -> None:
    setup_logging()
    layout, ckpt = layout_from(cfg), model_dir(cfg)
    sched_cfg, server_cfg = configs(cfg)
    spec = spec_config(cfg)
    model_cfg = preflight(layout, ckpt, drafter=spec.drafter_path if spec.enabled else None,
                          bind=(server_cfg.host, server_cfg.port), metrics_port=server_cfg.metrics_port)
    sched_cfg = sched_cfg.for_model(model_cfg.max_position_embeddings)
    if server_cfg.reasoning_parser is not None:  # the checkpoint holds its markers: refused here, before the ranks
        ReasoningParser.for_checkpoint(server_cfg.reasoning_parser, load_tokenizer(ckpt),
                                       server_cfg.max_thinking_tokens)
    device, backend, _ = prepare_ranks(cfg, layout)
    log.info("on: %s", what_is_on(layout.describe(), spec, sched_cfg, server_cfg))
    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    rank0_pid = ctx.RawValue("i", 0)
    if layout.world_size > 1 and "RANK" not in os.environ:
        forward_stop(rank0_pid)
    try:
        launch(layout.world_size, rank_main, layout, ckpt, sched_cfg, server_cfg, spec, int(cfg.engine.seed), rank0_pid,
               device, master_port=cfg.master_port, backend=backend)
    except Exception as err:  # noqa: BLE001 - a failed rank: the reason is logged, the exit code says it
        log.error("serve failed: %s", err if debug_requested(cfg) else one_line(err))
        sys.exit(1)
    log.info("serve exited cleanly")


if __name__ == "__main__":
    main()
