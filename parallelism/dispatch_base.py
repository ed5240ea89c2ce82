"""What every MoE token dispatcher shares: the expert-side contract (:class:`ExpertInput`), the
:class:`Dispatcher` base class and its routing tables, and the errors and capture check the backends use.

The backends live beside it (``parallelism/dispatch.py``: allreduce, alltoall, allgather and the registry;
``parallelism/deepep.py``: DeepEP); each imports only this module, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelism.comm import ParallelGroups
from parallelism.layout import ExpertPlacement


@dataclass(frozen=True)
class ExpertInput:
    """Rows for the local experts. ``packed_counts`` (DeepEP low latency): ``hidden`` is the packed layout
    ``[E_local, R, H]`` viewed ``[E_local * R, H]`` and expert ``e``'s valid rows are ``[0, packed_counts[e])``
    (``slots`` says the same: ``e`` there, −1 elsewhere); the experts' outputs on the other rows are
    unspecified (whatever reads them must not)."""

    hidden: torch.Tensor   # [N, H]
    slots: torch.Tensor    # [N, k] int64 local expert slot, -1 = not on this rank
    weights: torch.Tensor  # [N, k] float32 routing weights
    packed_counts: torch.Tensor | None = None  # [E_local] int, on hidden's device
    unsummed: bool = False  # return each (row, choice)'s weighted output [N, k, H] (zeros where not local)


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Dispatcher:
    """Base class. ``dispatch`` → local experts → ``combine``.

    Placement-invariant combine (:attr:`pairwise`: ``engine.batch_invariant`` with ``moe_ep`` > 1): the experts
    return each (row, choice)'s weighted output unsummed (:attr:`ExpertInput.unsummed`), the collective brings
    every pair to its token's rank, and a token's k outputs are added there in top-k order
    (:func:`~parallelism.comm.ordered_sum`), then its shared experts. Which rank computed a pair then changes
    nothing in the sum, so experts can move between ranks without changing a bit; otherwise each rank sums its own
    experts' outputs first and the ranks' partial sums are added, so the grouping of the additions follows the
    placement.
    """

    name = "base"
    needs_partitioned_tokens = False
    graph_safe = False
    needs_nvlink = False
    graph_token_limit: int | None = None  # most tokens per rank a captured step may hold (None: no bound)

    def __init__(self, groups: ParallelGroups, placement: ExpertPlacement):
        self.groups = groups
        self.world = groups.world
        self.moe_ep = placement.moe_ep
        self.placement = placement
        tables = self._tables(placement)
        self.holders = tables["holders"]  # [P, W]: rank r holds (a shard of) slot p
        self.slot_at_rank = tables["slot_at_rank"]  # [P, W]: slot's local index on rank r, or -1
        self.local_slot = tables["local_slot"]  # [P]: on this rank, or -1
        self.replica_count = tables["replica_count"]  # [E]
        self.log2phy = tables["log2phy"]  # [E, R_max]: an expert's slots (R_max = P - E + 1, padded with the first)

    def _tables(self, placement: ExpertPlacement) -> dict[str, torch.Tensor]:
        phy2log = placement.phy2log
        p = len(phy2log)
        holders = torch.zeros(p, self.groups.layout.world_size, dtype=torch.bool)
        for slot in range(p):
            holders[slot, placement.ranks_of_slot(slot)] = True
        local = torch.arange(p) % placement.slots_per_rank
        slot_at_rank = torch.where(holders, local[:, None], -1)
        replicas = [placement.replicas(e) for e in range(placement.num_experts)]
        widest = p - placement.num_experts + 1  # fixed for the run: a new placement is written in place
        return {"holders": holders, "slot_at_rank": slot_at_rank,
                "local_slot": slot_at_rank[:, self.groups.rank].clone(),
                "replica_count": torch.tensor([len(r) for r in replicas]),
                "log2phy": torch.tensor([r + r[:1] * (widest - len(r)) for r in replicas])}

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Switches to ``placement`` (the same slot count) by writing the routing tables in place: a captured CUDA
        graph reads the new ones on its next replay."""
        for name, table in self._tables(placement).items():
            getattr(self, name).copy_(table)
        self.placement = placement

    def physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids [T, k]`` logical experts → ``[T, k]`` physical slots: of an expert's replicas, row t's
        choice j takes replica ``(t * k + j) mod replicas`` (deterministic, spread over the replicas; vLLM's
        modulo choice). With one slot per expert it is the slot's renaming."""
        if self.log2phy.shape[1] == 1:
            return self.log2phy[topk_ids, 0]
        t, k = topk_ids.shape
        turn = torch.arange(t * k, device=topk_ids.device).view(t, k)
        return self.log2phy[topk_ids, turn % self.replica_count[topk_ids]]

    @property
    def pairwise(self) -> bool:
        """Whether combine is placement-invariant now (read per call: the model sets the ordered mode after the
        dispatcher is built)."""
        return self.world.mode.ordered and self.moe_ep > 1

    def to(self, device: torch.device | str) -> Dispatcher:
        """Moves the routing tables to ``device`` (the model's), so dispatch launches no host copies."""
        self.local_slot, self.holders = self.local_slot.to(device), self.holders.to(device)
        self.slot_at_rank = self.slot_at_rank.to(device)
        self.log2phy, self.replica_count = self.log2phy.to(device), self.replica_count.to(device)
        return self

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x ``[T, H]``, topk_ids ``[T, k]`` int64, topk_weights ``[T, k]`` → (ExpertInput, meta)."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, meta, shared: torch.Tensor | None) -> torch.Tensor:
        """Expert outputs ``[N, H]`` (``[N, k, H]`` when :attr:`pairwise`) + this rank's shared-expert partial
        ``[T, H]`` → MoE output ``[T, H]``."""
        raise NotImplementedError


class DeepEPUnavailable(RuntimeError):
    """The ``deepep`` dispatcher cannot run here; the message says why and names the fallback."""
