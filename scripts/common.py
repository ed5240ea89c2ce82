"""Helpers shared by the entry points: hydra config → typed objects, model directory, logging. The model a rank
runs is assembled in the package (:func:`model.loader.load_target`); only the ``DictConfig`` conversions live here."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from settings import check_across_groups, typed

from model.config import load_config
from model.loader import DeviceConfig
from model.tiny import preset_dir
from parallelism.expert_slots import EPLBConfig, initial_expert_slots, nodes
from parallelism.layout import Layout

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = str(REPO / "conf")


def repo_path(path: str | None) -> str | None:
    """Relative paths in configs (e.g. the built-in model zoo) are relative to the repository root."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        p = p.resolve() if p.exists() else REPO / p
    return str(p)


def layout_from(cfg: DictConfig) -> Layout:
    """The ``parallel`` group, with the ``eplb`` group's starting expert placement when it asks for one (its slots
    need the model's MoE layer and expert counts: ``config.json`` is read)."""
    layout = Layout(**typed(OmegaConf.to_container(cfg.parallel, resolve=True), "parallel", Layout))
    if "eplb" in cfg:
        start = typed({k: cfg.eplb[k] for k in ("placement_file", "redundant_experts")}, "eplb", EPLBConfig)
        eplb = EPLBConfig(start["placement_file"], start["redundant_experts"], nodes(cfg.eplb.num_nodes))
    else:
        eplb = EPLBConfig()
    if not eplb.active:
        return layout
    if eplb.placement_file:
        eplb = dataclasses.replace(eplb, placement_file=repo_path(eplb.placement_file))
    model = load_config(model_dir(cfg))
    slots = initial_expert_slots(eplb, sum(model.moe_layers), model.moe.num_experts, layout.moe_ep, model.moe.n_group)
    return dataclasses.replace(layout, expert_slots=slots)


BALANCER_KEYS = ("enabled", "window_steps", "interval_steps", "min_gain", "layers_per_step")


def engine_keys(cfg: DictConfig) -> dict:
    """The ``engine`` group's keys (``seed`` aside: the scripts take it themselves) and the ``eplb`` group's
    rebalancing keys as ``eplb_*`` (``engine.config.BalancerConfig``): what ``EngineConfig.flat`` takes."""
    from engine.config import BalancerConfig, CacheConfig, RunnerConfig, SchedulerConfig

    keys = typed(OmegaConf.to_container(cfg.engine, resolve=True), "engine", SchedulerConfig, CacheConfig,
                 RunnerConfig)
    keys.pop("seed", None)
    if "eplb" in cfg:
        balancer = typed({k: cfg.eplb[k] for k in BALANCER_KEYS}, "eplb", BalancerConfig, rename=lambda k: f"eplb_{k}")
        keys |= {f"eplb_{k}": v for k, v in balancer.items()} | {"eplb_num_nodes": nodes(cfg.eplb.num_nodes)}
    return keys


def model_dir(cfg: DictConfig) -> str:
    """``model.path`` if given, else the built-in preset's directory (written on first use)."""
    if cfg.model.get("path"):
        return repo_path(str(cfg.model.path))
    if not cfg.model.get("preset"):
        raise SystemExit("model.path=DIR is required for model=hf")
    return str(preset_dir(cfg.model.preset))


def device_config(cfg: DictConfig) -> DeviceConfig:
    """The ``device`` group (cpu | cuda), or the CPU default when the config has none; travels to the ranks."""
    if "device" not in cfg:
        return DeviceConfig()
    return DeviceConfig(**typed(OmegaConf.to_container(cfg.device, resolve=True), "device", DeviceConfig))


def spec_config(cfg: DictConfig):
    from spec_decode.config import SpecConfig

    s = typed(OmegaConf.to_container(cfg.spec_decode, resolve=True), "spec_decode", SpecConfig) \
        if "spec_decode" in cfg else {}
    s["drafter_path"] = repo_path(s.get("drafter_path"))
    return SpecConfig(**s)


def prepare_ranks(cfg: DictConfig, layout: Layout, environ=None) -> tuple[DeviceConfig, str, dict]:
    """What a script settles before it starts any rank: the ``device`` group (:func:`device_config`), the
    process-group backend it implies (``parallelism.launch.backend_for``) and ``topology=auto|nvlink|pcie``
    applied for that backend (``parallelism.topology.prepare``: NCCL's switches written into ``environ``, default
    ``os.environ``). Returns ``(device, backend, topology summary)``; the summary is also logged. The rules that join
    groups run first (:func:`settings.check_across_groups`)."""
    from parallelism.launch import backend_for
    from parallelism.topology import prepare

    device = device_config(cfg)
    engine = cfg.engine if "engine" in cfg else {}
    check_across_groups(layout, device, batch_invariant=bool(engine.get("batch_invariant")),
                        block_size=engine.get("block_size"),
                        eplb_enabled="eplb" in cfg and cfg.eplb.enabled is True)
    backend = backend_for(device.type)
    mode = cfg.topology.mode if "topology" in cfg else "auto"
    summary = prepare(mode, layout, environ=environ, backend=backend)
    logging.getLogger("topology").info("topology=%s: %s; NCCL env %s", mode, summary["effective"], summary["env"])
    return device, backend, summary


def setup_logging(rank: int = 0) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(levelname)s %(name)s: %(message)s")
