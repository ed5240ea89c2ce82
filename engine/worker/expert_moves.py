"""Expert weights that move between ranks while serving (the rank side of expert load balancing, ``docs/eplb.md``).

:class:`ExpertMaps` holds, per MoE layer of a rank's model, the current placement (``ExpertPlacement``: the logical
expert of each physical slot) and its version. A layer moves to a new placement of the same slot count in two rank
messages, run on every rank in the order rank 0 sent them:

1. ``MoveExperts`` (:meth:`ExpertMaps.start`): every rank derives the same slot fills from the old and new maps
   (:func:`slot_fills`): a slot whose expert changes is filled from a slot of the same rank that holds that expert,
   or else from one rank that holds it (the holders taken in turn, so the sends spread over the replicas). Each
   fill's tensors — every per-slot tensor of the layer's experts module: a bf16/fp32 expert's ``w_gate_up`` and
   ``w_down``; a quantized expert's packed weights *and* their scales — are staged: copied on the same rank now, or
   sent point to point between the ranks of the same expert-TP shard as bytes, on a thread over the moves' own
   process group (``parallelism.comm.side_group``) while the next steps run with the current placement.
2. ``SwapExperts`` (:meth:`ExpertMaps.swap`), between two later steps: the rank waits for its transfers, then writes
   the staged rows into their slots and switches the dispatcher's routing tables (``Dispatcher.set_placement``),
   both in place (a captured CUDA graph keeps its addresses), and takes the move's version.

Every step plan carries the placement version of each layer (``StepPlan.expert_versions``); a rank whose version
differs raises :class:`PlacementVersionError` at once, naming the layer and both versions, before it runs anything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from model.moe import MoE
from parallelism.comm import Comm, ParallelGroups, side_group
from parallelism.layout import ExpertPlacement


class PlacementVersionError(RuntimeError):
    """A step planned for another expert placement than the one this rank holds."""


def slot_fills(old: tuple[int, ...], new: tuple[int, ...], slots_per_rank: int) -> list[tuple[int, int]]:
    """``(new slot, source slot)`` for every physical slot whose expert changes: the source holds that expert under
    ``old``, on the same EP rank when one does (a local copy), else on the holders taken in turn by the slot's index
    (the same answer on every rank)."""
    fills = []
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        rank = slot // slots_per_rank
        here = [s for s in range(rank * slots_per_rank, (rank + 1) * slots_per_rank) if old[s] == expert]
        holders = [s for s, e in enumerate(old) if e == expert]
        fills.append((slot, here[0] if here else holders[slot % len(holders)]))
    return fills


def slot_tensors(experts: nn.Module) -> list[torch.Tensor]:
    """The experts module's per-slot tensors (leading dim = its local slots), by name: parameters and buffers."""
    n = len(experts.global_ids)
    named = sorted([*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)])
    return [t for _, t in named if t.dim() and t.shape[0] == n]


def staging_bytes(model: nn.Module) -> int:
    """The most a move stages on one rank: one MoE layer's every local slot (what the KV cache leaves room for when
    the balancer runs, ``engine.worker.kv_budget.size_kv_cache``)."""
    layers = [m.experts for m in model.modules() if isinstance(m, MoE)]
    return max((sum(t.numel() * t.element_size() for t in slot_tensors(e)) for e in layers), default=0)


@dataclass
class _Staged:
    """A move in flight on this rank: its transfer (a thread), the rows it stages and the placement they make."""

    layer: int
    placement: ExpertPlacement
    version: int
    rows: list[tuple[torch.Tensor, int, torch.Tensor]]  # (slot tensor, local slot, staged row)
    thread: threading.Thread
    error: list[BaseException] = field(default_factory=list)


class ExpertMaps:
    """Per MoE layer of ``model`` (in order): its placement, version and the tensors a move rewrites."""

    def __init__(self, model: nn.Module, groups: ParallelGroups):
        self.groups = groups
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.versions = [0] * len(self.layers)
        self.in_flight: dict[int, _Staged] = {}
        self._side: Comm | None = None  # the moves' own group, made by the first move (every rank, in order)

    def placements(self) -> torch.Tensor:
        """``[L, P]`` int64: each MoE layer's current logical expert per physical slot."""
        return torch.tensor([m.dispatcher.placement.phy2log for m in self.layers])

    def check(self, versions: tuple[int, ...]) -> None:
        """Raises :class:`PlacementVersionError` if a plan's per-layer ``versions`` (empty: not tracked) differ from
        this rank's."""
        if not versions:
            return
        for layer, (want, have) in enumerate(zip(versions, self.versions, strict=True)):
            if want != have:
                raise PlacementVersionError(
                    f"rank {self.groups.rank}: the step was planned for expert placement version {want} of MoE "
                    f"layer {layer}, this rank holds version {have}")

    def move(self, layer: int, slots: tuple[int, ...], version: int) -> int:
        """:meth:`start` then :meth:`swap` at once. Returns the bytes this rank sent."""
        sent = self.start(layer, slots, version)
        self.swap(layer)
        return sent

    def start(self, layer: int, slots: tuple[int, ...], version: int) -> int:
        """Starts moving MoE layer ``layer`` to the placement ``slots`` (logical expert per physical slot), to be
        ``version``: local copies are staged now, the transfers run on a thread over the moves' own process group
        while steps go on with the current placement; collective over the world. Returns the bytes this rank
        sends."""
        if layer in self.in_flight:
            raise ValueError(f"MoE layer {layer} is already moving (to version {self.in_flight[layer].version})")
        moe = self.layers[layer]
        old: ExpertPlacement = moe.dispatcher.placement
        new = ExpertPlacement(old.num_experts, old.moe_ep, old.moe_tp, slots=tuple(slots))
        if new.num_slots != old.num_slots:
            raise ValueError(f"MoE layer {layer}: a move keeps {old.num_slots} slots, got {new.num_slots}")
        spr, c = old.slots_per_rank, self.groups.coords
        tensors = slot_tensors(moe.experts)
        sends, recvs, rows = [], [], []
        for i, (dst, src) in enumerate(slot_fills(old.phy2log, new.phy2log, spr)):
            (dst_rank, dst_local), (src_rank, src_local) = divmod(dst, spr), divmod(src, spr)
            for j, t in enumerate(tensors):
                tag = i * len(tensors) + j
                if dst_rank == c.moe_ep_rank:
                    buf = t[src_local].clone() if src_rank == dst_rank else torch.empty_like(t[dst_local])
                    rows.append((t, dst_local, buf))
                    if src_rank != dst_rank:
                        recvs.append((src_rank * old.moe_tp + c.moe_tp_rank, tag, _bytes(buf)))
                elif src_rank == c.moe_ep_rank:
                    sends.append((dst_rank * old.moe_tp + c.moe_tp_rank, tag, _bytes(t[src_local].clone())))
        side = self._side_group()
        staged = _Staged(layer, new, version, rows, threading.Thread())

        def transfer() -> None:
            try:
                side.send_recv(sends, recvs)
            except BaseException as err:  # noqa: BLE001 - re-raised on the step thread by swap()
                staged.error.append(err)

        staged.thread = threading.Thread(target=transfer, name=f"expert-move-{layer}", daemon=True)
        staged.thread.start()
        self.in_flight[layer] = staged
        return sum(b.numel() for _, _, b in sends)

    def swap(self, layer: int) -> None:
        """Waits for MoE layer ``layer``'s transfer, then writes the staged rows into their slots and switches the
        routing tables, both in place, and takes the move's version: between two steps, on every rank."""
        staged = self.in_flight.pop(layer)
        staged.thread.join()
        if staged.error:
            why = f"rank {self.groups.rank}: moving MoE layer {layer}'s experts failed"
            raise RuntimeError(why) from staged.error[0]
        for t, local, buf in staged.rows:
            t[local].copy_(buf)
        moe = self.layers[layer]
        moe.experts.global_ids = staged.placement.local_experts(self.groups.coords.moe_ep_rank)
        moe.dispatcher.set_placement(staged.placement)
        self.versions[layer] = staged.version

    def _side_group(self) -> Comm:
        if self._side is None:
            self._side = side_group(self.groups, "eplb")
        return self._side


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat uint8 view (any dtype travels as its bytes: float8 and packed int4 included)."""
    return t.contiguous().view(-1).view(torch.uint8)
