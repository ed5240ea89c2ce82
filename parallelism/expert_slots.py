"""Where the routed experts sit when a job starts: the ``eplb`` config group turned into per-MoE-layer physical slots
(``Layout.expert_slots``), from a placement file or a recorded load.

- ``eplb.placement_file``: a JSON file holding either ``{"phy2log": [[...], ...]}`` — per MoE layer, the logical
  expert in each physical slot, slot ``s`` on EP rank ``s // (slots // moe_ep)`` — or ``{"load": [[...], ...]}`` —
  per MoE layer, tokens routed to each logical expert (what ``scripts/record_expert_load.py`` writes), from which
  :func:`parallelism.eplb.rebalance` computes the slots. It wins over ``parallel.placement``.
- ``eplb.redundant_experts``: physical slots beyond one per expert, a multiple of ``moe_ep`` (the same count on every
  rank). Without a file the load is taken as even.
- ``eplb.num_nodes``: the nodes the EP ranks span (null: torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``, else 1). With
  more than one, and the model's expert groups (``n_group``) a multiple of it, each group's replicas stay on one
  node (DeepSeek's hierarchical policy: group-limited routing then crosses fewer nodes).

Neither set: ``None``, one slot per expert by ``parallel.placement``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from parallelism.eplb import EPLBError, rebalance


@dataclass(frozen=True)
class EPLBConfig:
    """The ``eplb`` config group's keys for the placement a job starts from."""

    placement_file: str | None = None
    redundant_experts: int = 0
    num_nodes: int = 1

    @property
    def active(self) -> bool:
        return bool(self.placement_file) or self.redundant_experts != 0


def nodes(setting: int | None, environ: dict | None = None) -> int:
    """``eplb.num_nodes``: as set, or (null) the nodes torchrun spans (``WORLD_SIZE // LOCAL_WORLD_SIZE``), else 1."""
    if setting is not None:
        if setting < 1:
            raise EPLBError(f"eplb.num_nodes must be >= 1, got {setting}")
        return setting
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
        return max(int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"]), 1)
    return 1


def initial_expert_slots(cfg: EPLBConfig, num_moe_layers: int, num_experts: int, moe_ep: int,
                         num_groups: int = 1) -> tuple[tuple[int, ...], ...] | None:
    """``[num_moe_layers][num_experts + redundant_experts]`` logical expert per physical slot, or None when
    ``cfg`` asks for nothing; ``num_groups``: the model's expert groups (``n_group``), for ``cfg.num_nodes`` > 1.
    Raises :class:`EPLBError` naming the key and the numbers that do not fit."""
    if not cfg.active:
        return None
    r = cfg.redundant_experts
    if r < 0 or r % moe_ep:
        raise EPLBError(f"eplb.redundant_experts={r} must be a non-negative multiple of parallel.moe_ep={moe_ep} "
                        "(every EP rank holds the same number of slots)")
    num_slots = num_experts + r
    if num_slots % moe_ep:
        raise EPLBError(f"{num_experts} experts + eplb.redundant_experts={r} = {num_slots} slots do not divide over "
                        f"parallel.moe_ep={moe_ep}")
    if not cfg.placement_file:
        load = torch.ones(num_moe_layers, num_experts)
        return _rows(rebalance(load, num_slots, moe_ep, cfg.num_nodes, num_groups))
    data = _read(cfg.placement_file)
    where = f"eplb.placement_file={cfg.placement_file}"
    if "phy2log" in data:
        rows = data["phy2log"]
        widths = {len(row) for row in rows}
        if widths != {num_slots}:
            raise EPLBError(f"{where} holds {sorted(widths)} slots per layer; {num_experts} experts + "
                            f"eplb.redundant_experts={r} make {num_slots}")
        _check_layers(where, len(rows), num_moe_layers)
        return tuple(tuple(int(e) for e in row) for row in rows)
    if "load" in data:
        load = torch.tensor(data["load"], dtype=torch.float64)
        if load.dim() != 2 or load.shape[1] != num_experts:
            raise EPLBError(f"{where}: 'load' must be [MoE layers, {num_experts} experts], got {list(load.shape)}")
        _check_layers(where, load.shape[0], num_moe_layers)
        return _rows(rebalance(load, num_slots, moe_ep, cfg.num_nodes, num_groups))
    raise EPLBError(f"{where} holds neither 'phy2log' nor 'load' (keys: {sorted(data)})")


def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EPLBError(f"eplb.placement_file={path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise EPLBError(f"eplb.placement_file={path} must hold a JSON object with 'phy2log' or 'load'")
    return data


def _check_layers(where: str, found: int, num_moe_layers: int) -> None:
    if found != num_moe_layers:
        raise EPLBError(f"{where} has {found} MoE layers; the model has {num_moe_layers}")


def _rows(phy2log: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in phy2log.tolist())
