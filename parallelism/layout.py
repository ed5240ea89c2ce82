"""The layout algebra: parallel degrees as one frozen, validated dataclass with pure rank math.

Rank order (written down once, Megatron/SGLang convention):
- attention: ``rank = dp_rank * attn_tp + tp_rank`` (attention-TP innermost);
- experts:   ``rank = ep_rank * moe_tp + etp_rank`` (expert-TP innermost),
so ranks that share an attention shard or an expert sit next to each other (the fastest links).
"""

from __future__ import annotations

from dataclasses import dataclass

DISPATCHERS = ("auto", "allreduce", "alltoall", "allgather", "deepep")
PLACEMENTS = ("linear", "round_robin")


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the violated constraint."""


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator / denominator`` that refuses to round: raises LayoutError naming ``what``."""
    if denominator <= 0 or numerator % denominator != 0:
        raise LayoutError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in each grid."""

    rank: int
    attn_tp_rank: int
    attn_dp_rank: int
    moe_tp_rank: int
    moe_ep_rank: int


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one job. ``attn_tp*attn_dp == moe_tp*moe_ep == world_size``."""

    world_size: int = 1
    attn_tp: int = 1
    attn_dp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    dispatcher: str = "auto"
    placement: str = "linear"
    deepep_low_latency: bool = True  # deepep: low-latency (graph-safe) path for decode; False = normal mode only
    deepep_max_decode_tokens: int = 128  # deepep: per-rank token bound of the low-latency path
    # per MoE layer, the logical expert of each physical slot (EPLB: ``eplb.placement_file``,
    # ``eplb.redundant_experts``); None: one slot per expert, by ``placement``
    expert_slots: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "attn_tp", "attn_dp", "moe_tp", "moe_ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.attn_tp * self.attn_dp != self.world_size:
            raise LayoutError(
                f"attn_tp*attn_dp must equal world_size: {self.attn_tp}*{self.attn_dp} != {self.world_size}"
            )
        if self.moe_tp * self.moe_ep != self.world_size:
            raise LayoutError(
                f"moe_tp*moe_ep must equal world_size: {self.moe_tp}*{self.moe_ep} != {self.world_size}"
            )
        if self.dispatcher not in DISPATCHERS:
            raise LayoutError(f"parallel.dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")
        if self.placement not in PLACEMENTS:
            raise LayoutError(f"parallel.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.expert_slots is not None:
            sizes = {len(row) for row in self.expert_slots}
            if len(sizes) != 1 or next(iter(sizes)) % self.moe_ep:
                raise LayoutError(f"expert slots per MoE layer must be one count divisible by moe_ep={self.moe_ep}, "
                                  f"got {sorted(sizes)}")
        if self.dispatcher == "allreduce" and self.attn_dp > 1:
            raise LayoutError(
                "dispatcher 'allreduce' needs tokens replicated on every rank (attn_dp == 1), "
                f"got attn_dp={self.attn_dp}; use 'alltoall' or 'allgather'"
            )

    @property
    def resolved_dispatcher(self) -> str:
        """The dispatcher backend ``auto`` stands for: allreduce with TP attention, alltoall with DP (mixed TP × DP
        attention included: each attention-TP rank dispatches its share of the group's tokens)."""
        if self.dispatcher != "auto":
            return self.dispatcher
        return "allreduce" if self.attn_dp == 1 else "alltoall"

    def coords(self, rank: int) -> RankCoords:
        """Grid coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        return RankCoords(
            rank=rank,
            attn_tp_rank=rank % self.attn_tp,
            attn_dp_rank=rank // self.attn_tp,
            moe_tp_rank=rank % self.moe_tp,
            moe_ep_rank=rank // self.moe_tp,
        )

    def groups(self) -> dict[str, list[list[int]]]:
        """Rank lists of every process group, by kind. Each kind partitions the world."""
        w = self.world_size
        return {
            "world": [list(range(w))],
            "attn_tp": [list(range(d * self.attn_tp, (d + 1) * self.attn_tp)) for d in range(self.attn_dp)],
            "attn_dp": [list(range(t, w, self.attn_tp)) for t in range(self.attn_tp)],
            "moe_tp": [list(range(e * self.moe_tp, (e + 1) * self.moe_tp)) for e in range(self.moe_ep)],
            "moe_ep": [list(range(t, w, self.moe_tp)) for t in range(self.moe_tp)],
        }

    def describe(self) -> str:
        """Short human name, e.g. ``attn tp8 | moe ep8 (allreduce)``."""
        attn = f"tp{self.attn_tp}" if self.attn_dp == 1 else f"dp{self.attn_dp}"
        if self.attn_tp > 1 and self.attn_dp > 1:
            attn = f"tp{self.attn_tp}xdp{self.attn_dp}"
        parts = [f"tp{self.moe_tp}"] * (self.moe_tp > 1) + [f"ep{self.moe_ep}"] * (self.moe_ep > 1)
        placement = "" if self.placement == "linear" else f", {self.placement}"
        if self.expert_slots is not None:
            placement = f", eplb {len(self.expert_slots[0])} slots"
        return f"attn {attn}, moe {'x'.join(parts) or 'tp1'} ({self.resolved_dispatcher}{placement})"

    def expert_placement(self, num_experts: int, moe_layer: int = 0) -> ExpertPlacement:
        """Where the routed experts of the ``moe_layer``-th MoE layer sit (counting MoE layers only)."""
        slots = None
        if self.expert_slots is not None:
            if moe_layer >= len(self.expert_slots):
                raise LayoutError(f"the expert placement has {len(self.expert_slots)} MoE layers, the model more")
            slots = self.expert_slots[moe_layer]
        return ExpertPlacement(num_experts, self.moe_ep, self.moe_tp, self.placement, slots)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which ranks hold which routed experts, as physical slots: pure math over a Layout and an expert count.

    ``slots[s]`` (phy2log) is the logical expert in physical slot ``s``; slot ``s`` sits on EP rank
    ``s // slots_per_rank`` as its local slot ``s % slots_per_rank``, and an expert may fill several slots
    (replicas, on different ranks or not). Without ``slots`` the ``kind`` gives one slot per expert:
    ``linear``: expert e in slot e (EP rank ``e // experts_per_rank``, local slot ``e % experts_per_rank``);
    ``round_robin``: EP rank ``e % moe_ep``, local slot ``e // moe_ep``.
    Each slot's intermediate dim is split over the ``moe_tp`` ranks of its EP rank.
    """

    num_experts: int
    moe_ep: int
    moe_tp: int
    kind: str = "linear"
    slots: tuple[int, ...] | None = None  # [num_slots] logical expert of each physical slot (EPLB); None: from kind

    def __post_init__(self) -> None:
        if self.slots is None:
            return
        what = f"an expert placement of {len(self.slots)} slots over moe_ep={self.moe_ep}"
        divide(len(self.slots), self.moe_ep, what)
        bad = sorted({e for e in self.slots if not 0 <= e < self.num_experts})
        if bad:
            raise LayoutError(f"{what} names experts {bad[:5]} outside 0..{self.num_experts - 1}")
        missing = sorted(set(range(self.num_experts)) - set(self.slots))
        if missing:
            raise LayoutError(f"{what} leaves experts {missing[:5]} without a slot (every expert needs one)")

    @property
    def experts_per_rank(self) -> int:
        """Logical experts per EP rank without replicas (the ``kind`` placements)."""
        return divide(self.num_experts, self.moe_ep, f"routed experts over moe_ep={self.moe_ep}")

    @property
    def phy2log(self) -> tuple[int, ...]:
        """``[num_slots]``: the logical expert in each physical slot."""
        if self.slots is not None:
            return self.slots
        epr, ep = self.experts_per_rank, self.moe_ep
        if self.kind == "linear":
            return tuple(range(self.num_experts))
        return tuple((s % epr) * ep + s // epr for s in range(self.num_experts))  # slot r*epr + j holds j*ep + r

    @property
    def num_slots(self) -> int:
        return len(self.phy2log)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.moe_ep

    def replicas(self, expert: int) -> list[int]:
        """The physical slots holding ``expert``, ascending."""
        return [s for s, e in enumerate(self.phy2log) if e == expert]

    def local_experts(self, ep_rank: int) -> list[int]:
        """The logical expert of each of ``ep_rank``'s slots, in local-slot order (one may repeat)."""
        n = self.slots_per_rank
        return list(self.phy2log[ep_rank * n:(ep_rank + 1) * n])

    def ranks_of_slot(self, slot: int) -> list[int]:
        """World ranks holding a shard of physical ``slot`` (``moe_tp`` of them)."""
        base = (slot // self.slots_per_rank) * self.moe_tp
        return [base + s for s in range(self.moe_tp)]
