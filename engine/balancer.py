"""Rank 0's expert load balancer (``engine.eplb_enabled``; the ``eplb`` group's ``enabled``): experts that follow the
load while serving, one MoE layer at a time, between two steps (``docs/eplb.md``).

- Every ``eplb_window_steps`` steps it reads the load the ranks counted since the last read (``ReadExpertLoad`` with
  reset: tokens per logical expert per MoE layer, summed over the attention-DP groups); that window is what a
  rebalance sees.
- Every ``eplb_interval_steps`` steps it computes a placement from the last complete window
  (:func:`parallelism.eplb.rebalance`, the current slot count; over ``eplb_num_nodes`` > 1, each expert group's
  replicas on one node) and queues every layer whose predicted balancedness on
  that window rises by at least ``eplb_min_gain`` over the current placement's; the other layers stay.
- Before each step it first swaps in the layers whose moves it started before the previous step (``SwapExperts``:
  every rank waits for its transfers, writes the weights and switches the routing tables), then starts moving at
  most ``eplb_layers_per_step`` queued layers (``MoveExperts``: the weights travel rank to rank on a thread while
  the next step runs with the current placement), and stamps the step's plan with every layer's placement version,
  which each rank checks before it runs the step.

All of it happens at a step boundary with no step in flight. With ``engine.overlap=on`` the engine makes one
(:meth:`ExpertBalancer.due`): the step before it is not overlapped, so it is read back before the next is planned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.config import BalancerConfig
from engine.worker.control import ControlPlane, MoveExperts, RankState, ReadExpertLoad, SwapExperts
from parallelism.eplb import balancedness, rank_loads, rebalance


@dataclass
class BalancerStats:
    """What the balancer did since start: rebalances computed, layer moves done and skipped, bytes and seconds."""

    rebalances: int = 0
    layers_moved: int = 0
    layers_kept: int = 0  # a rebalance's layers whose gain was below min_gain
    moved_bytes: int = 0
    move_seconds: float = 0.0  # steps waited on moves: starting them (local copies) and swapping them in
    # per window read: its step, each layer's balancedness at the placement the window ran on and at the starting one,
    # and the busiest EP rank's routed choices per step
    windows: list[dict] = field(default_factory=list)


class ExpertBalancer:
    """Rank 0's side of expert load balancing: reads windows, rebalances, starts and swaps in layer moves through
    ``control`` (rank 0's own share run on ``rank``)."""

    def __init__(self, control: ControlPlane, rank: RankState, cfg: BalancerConfig):
        self.control, self.rank, self.cfg = control, rank, cfg
        self.maps = rank.runner.expert_maps
        self.window: torch.Tensor | None = None  # [L, E] tokens per expert over the last complete window
        self.pending: list[tuple[int, tuple[int, ...]]] = []  # (MoE layer, slots) to move, in order
        self.moving: list[int] = []  # layers whose moves started at the last step boundary: swapped at the next
        self.stats = BalancerStats()
        self.initial = self.maps.placements()  # [L, P] the placement serving began with
        self.requested = False  # an operator asked for a rebalance (BalanceExperts): at the next step boundary
        self.last_read = self.last_rebalance = 0  # the steps of the last window read and rebalance

    @property
    def versions(self) -> tuple[int, ...]:
        """Every MoE layer's placement version (what a step plan carries)."""
        return tuple(self.maps.versions)

    def figures(self) -> dict:
        """What a step record carries (``/metrics``): the last window's balancedness per MoE layer at the placement it
        ran on (None before the first window), and the totals of rebalances, bytes and seconds moved."""
        s = self.stats
        return {"balancedness": s.windows[-1]["balancedness"] if s.windows else None, "rebalances": s.rebalances,
                "moved_bytes": s.moved_bytes, "move_seconds": s.move_seconds}

    def run_figures(self) -> dict:
        """``eplb_rebalances`` and ``eplb_balancedness``: per MoE layer, the mean over the run's windows of each
        window's balancedness at the placement it ran on (None per layer before the first window)."""
        windows = [w["balancedness"] for w in self.stats.windows]
        layers = len(self.maps.layers)
        mean = [sum(col) / len(col) for col in zip(*windows, strict=True)] if windows else [None] * layers
        return {"eplb_rebalances": self.stats.rebalances, "eplb_balancedness": mean}

    def request_rebalance(self) -> None:
        """Rebalance at the next step boundary from the counts since the last window (the last window's when there
        are none), whatever the interval."""
        self.requested = True

    def due(self, steps: int) -> bool:
        """Whether the balancer has work at the boundary before step number ``steps``: a move to swap in or start, a
        requested rebalance, a window to read or a rebalance to compute."""
        return bool(self.moving or self.pending or self.requested
                    or steps - self.last_read >= self.cfg.eplb_window_steps
                    or steps - self.last_rebalance >= self.cfg.eplb_interval_steps)

    def before_step(self, steps: int) -> None:
        """Called by the engine before step number ``steps`` (0-based, warm-up excluded) when no step is in flight:
        reads a window, rebalances and moves layers as their periods come (or as an operator asked)."""
        if self.requested:
            self.requested = False
            fresh = self._read()
            self.window = fresh if fresh.sum() > 0 or self.window is None else self.window
            self._rebalance()
        if steps - self.last_read >= self.cfg.eplb_window_steps:
            span, placed = steps - self.last_read, self.maps.placements()
            self.last_read, self.window = steps, self._read()
            self.stats.windows.append({
                "step": steps, "balancedness": balancedness(self.window, placed, self._moe_ep).tolist(),
                "at_start_placement": balancedness(self.window, self.initial, self._moe_ep).tolist(),
                # what sets an EP step's time: the busiest rank's expert tokens (routed choices) per step
                "max_rank_tokens_per_step": (rank_loads(self.window, placed, self._moe_ep).max(dim=1).values
                                             / span).tolist()})
        if steps - self.last_rebalance >= self.cfg.eplb_interval_steps and self.window is not None:
            self.last_rebalance = steps
            self._rebalance()
        self._swap()
        for _ in range(min(self.cfg.eplb_layers_per_step, len(self.pending))):
            self._start(*self.pending.pop(0))

    @property
    def _moe_ep(self) -> int:
        return self.maps.groups.layout.moe_ep

    def _read(self) -> torch.Tensor:
        counts = [c for c in self.control.send(ReadExpertLoad(reset=True), self.rank) if c is not None]
        return torch.stack(counts).sum(0).double()

    def _rebalance(self) -> None:
        current = self.maps.placements()
        proposed = rebalance(self.window, current.shape[1], self._moe_ep, self.cfg.eplb_num_nodes,
                             self.rank.runner.model.cfg.moe.n_group)
        gain = balancedness(self.window, proposed, self._moe_ep) - balancedness(self.window, current, self._moe_ep)
        self.stats.rebalances += 1
        queued = {layer for layer, _ in self.pending}
        for layer in range(current.shape[0]):
            if gain[layer] >= self.cfg.eplb_min_gain and not torch.equal(proposed[layer], current[layer]):
                if layer in self.moving:  # its move is in flight: the next rebalance sees its new placement
                    continue
                if layer in queued:  # a newer placement replaces a queued one
                    self.pending = [(la, s) for la, s in self.pending if la != layer]
                self.pending.append((layer, tuple(proposed[layer].tolist())))
            else:
                self.stats.layers_kept += 1

    def _start(self, layer: int, slots: tuple[int, ...]) -> None:
        t0 = time.perf_counter()
        sent = self.control.send(MoveExperts(layer, slots, self.maps.versions[layer] + 1), self.rank)
        self.moving.append(layer)
        self.stats.moved_bytes += sum(sent)
        self.stats.move_seconds += time.perf_counter() - t0

    def _swap(self) -> None:
        """Swaps in every layer whose move started at an earlier step boundary."""
        t0 = time.perf_counter()
        for layer in self.moving:
            self.control.send(SwapExperts(layer), self.rank)
            self.stats.layers_moved += 1
        self.moving = []
        self.stats.move_seconds += time.perf_counter() - t0
