"""Expert-parallel load balancing: which logical expert each physical expert slot holds, per MoE layer.

An EP step lasts as long as its busiest rank, and real routing is skewed. Given each layer's load (tokens routed to
each logical expert over a window of steps), :func:`rebalance` chooses ``num_slots`` physical slots (``num_slots -
E`` of them redundant replicas) and which logical expert each holds, slot ``s`` on EP rank ``s // (num_slots //
num_ranks)``, so that the busiest rank's share is as small as it can find. A replicated expert's tokens are assumed
to split evenly over its replicas (the dispatcher picks a replica per (token, choice) deterministically).

The method follows the published description of DeepSeek's EPLB (github.com/deepseek-ai/EPLB; the same algorithm
ships in SGLang as ``sglang/srt/eplb/eplb_algorithms/deepseek.py``): replicas go one at a time to the expert with the
highest load per replica, then replicas are packed onto ranks heaviest first, each to the least-loaded rank with a
free slot; with ``num_nodes`` > 1 whole expert groups are first packed onto nodes, and each node's experts are
replicated and packed onto its own ranks (group-limited routing then crosses fewer nodes). Two changes, written here
from that description: a rank does not take a second replica of an expert while another rank with a free slot has
none of it, and after packing, swaps between the busiest rank and another that lower the busier of the two are made
until none is left (the published packing stops after the greedy pass). The published packing (refined the same way)
is computed too and kept when its busiest rank is lighter: spreading replicas is a heuristic that loses on some small
loads (two replicas of one expert on a rank can pack better than two experts). ``tests/parallelism/test_eplb.py``
checks the result against the published algorithm's balancedness on recorded loads, every layer within 0.01, and
against the optimum on small cases.
"""

from __future__ import annotations

import heapq

import torch

COUNT_ROUNDS = 8  # replica moves tried per layer (each one a full packing per candidate pair)
COUNT_CANDIDATES = 3  # givers and takers tried per round
COUNT_GOOD_ENOUGH = 0.005  # no replica moves once the busiest rank is within 0.5 % of an even share
MAX_SWAP_ROUNDS = 10_000  # a bound on the refinement: each swap strictly lowers the sum of squared bin totals


class EPLBError(ValueError):
    """A rebalance asked of shapes that cannot hold it (names the numbers)."""


def rebalance(load: torch.Tensor, num_slots: int, num_ranks: int, num_nodes: int = 1,
              num_groups: int = 1) -> torch.Tensor:
    """``load [L, E]`` (float tokens per logical expert) → ``phy2log [L, num_slots]`` int64: the logical expert held
    by each physical slot, slot ``s`` on EP rank ``s // (num_slots // num_ranks)``, every logical expert in at least
    one slot. With ``num_nodes`` > 1 and ``num_groups % num_nodes == 0`` each expert group (``E // num_groups``
    consecutive experts) keeps all its replicas on one node (ranks ``[n * R/N, (n+1) * R/N)``); otherwise one global
    policy."""
    if load.dim() != 2:
        raise EPLBError(f"load must be [layers, experts], got shape {tuple(load.shape)}")
    layers, experts = load.shape
    if num_slots < experts or num_slots % num_ranks:
        raise EPLBError(f"num_slots={num_slots} must be at least the {experts} experts and a multiple of "
                        f"num_ranks={num_ranks}")
    if num_ranks % num_nodes:
        raise EPLBError(f"num_ranks={num_ranks} is not a multiple of num_nodes={num_nodes}")
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    if hierarchical and experts % num_groups:
        raise EPLBError(f"{experts} experts do not split into num_groups={num_groups} groups")
    rows = load.double().clamp(min=0).tolist()
    phy2log = [(_hierarchical(row, num_slots, num_ranks, num_nodes, num_groups) if hierarchical
                else _flat(row, list(range(experts)), num_slots, num_ranks)) for row in rows]
    return torch.tensor(phy2log, dtype=torch.int64).view(layers, num_slots)


def rank_loads(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """``load [L, E]``, ``phy2log [L, S]`` → tokens per EP rank ``[L, num_ranks]``, a replicated expert's load split
    evenly over its replicas."""
    load = load.double()
    replicas = torch.zeros_like(load).scatter_add_(1, phy2log, torch.ones_like(phy2log, dtype=load.dtype))
    per_slot = load.gather(1, phy2log) / replicas.gather(1, phy2log)  # [L, S]
    return per_slot.view(load.shape[0], num_ranks, -1).sum(dim=2)


def balancedness(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Mean ÷ max tokens per EP rank, per layer ``[L]`` (1.0 = perfectly even; a layer with no load counts as 1)."""
    per_rank = rank_loads(load, phy2log, num_ranks)
    top = per_rank.max(dim=1).values
    return torch.where(top > 0, per_rank.mean(dim=1) / top.clamp(min=1e-30), torch.ones_like(top))


def _hierarchical(load: list[float], num_slots: int, num_ranks: int, num_nodes: int, num_groups: int) -> list[int]:
    """Groups onto nodes (equal group counts, by group load), then each node's experts over its own slots and ranks;
    node ``n``'s slots come ``n``-th."""
    size = len(load) // num_groups
    group_loads = [sum(load[g * size:(g + 1) * size]) for g in range(num_groups)]
    nodes = _pack(group_loads, list(range(num_groups)), num_nodes, num_groups // num_nodes)
    out = []
    for groups in nodes:
        experts = [g * size + i for g in sorted(groups) for i in range(size)]
        out += _flat(load, experts, num_slots // num_nodes, num_ranks // num_nodes)
    return out


def _flat(load: list[float], experts: list[int], num_slots: int, num_ranks: int) -> list[int]:
    """``experts`` (logical ids, their loads in ``load``) over ``num_slots`` slots on ``num_ranks`` ranks: replica
    counts (:func:`_replica_counts`, then :func:`_better_counts`), the replicas packed onto ranks; each rank's slots
    in expert-id order."""
    loads = [load[e] for e in experts]
    counts = _replica_counts(loads, num_slots)
    per_rank = num_slots // num_ranks
    spread = _better_counts(loads, counts, num_ranks, per_rank)
    plain = _packed(loads, counts, num_ranks, per_rank, spread=False)[:2]  # the published packing, refined
    bins, labels = min((spread, plain), key=lambda c: _busiest(loads, *c))
    return [experts[labels[i]] for items in bins for i in sorted(items, key=lambda i: labels[i])]


def _busiest(loads: list[float], bins: list[list[int]], labels: list[int]) -> float:
    """The busiest rank's total of a packing whose items are replicas of ``labels``' experts."""
    held = [labels.count(e) for e in range(len(loads))]
    return max(sum(loads[labels[i]] / held[labels[i]] for i in items) for items in bins)


def _packed(loads: list[float], counts: list[int], num_ranks: int, per_rank: int, spread: bool = True):
    """``counts`` replicas of each expert (index into ``loads``) packed onto ranks → (bins of item indices, each
    item's expert, the busiest rank's total); ``spread``: see :func:`_pack`."""
    labels = [e for e, n in enumerate(counts) for _ in range(n)]
    weights = [loads[e] / counts[e] for e in labels]
    bins = _pack(weights, labels, num_ranks, per_rank, spread)
    return bins, labels, max(sum(weights[i] for i in items) for items in bins)


def _better_counts(loads: list[float], counts: list[int], num_ranks: int, per_rank: int):
    """Replica counts that pack better: while it lowers the busiest rank's total, move one replica from an expert
    with the lightest replicas (after the move) to an expert on the busiest rank (a few of each tried per round,
    :data:`COUNT_CANDIDATES`). The greedy counts minimise the heaviest replica, which is what matters when a rank
    holds many replicas; with few slots per rank which replicas pair up matters too. Returns :func:`_packed`'s bins
    and labels."""
    bins, labels, top = _packed(loads, counts, num_ranks, per_rank)
    even = sum(loads) / num_ranks
    for _ in range(COUNT_ROUNDS):
        if top <= even * (1 + COUNT_GOOD_ENOUGH):
            break
        busiest = max(bins, key=lambda items: sum(loads[labels[i]] / counts[labels[i]] for i in items))
        takers = sorted({labels[i] for i in busiest}, key=lambda e: -loads[e] / counts[e])[:COUNT_CANDIDATES]
        givers = sorted((e for e in range(len(counts)) if counts[e] > 1),
                        key=lambda e: loads[e] / (counts[e] - 1))[:COUNT_CANDIDATES]
        best = None
        for give, take in ((g, t) for g in givers for t in takers if g != t):
            trial = list(counts)
            trial[give] -= 1
            trial[take] += 1
            packed = _packed(loads, trial, num_ranks, per_rank)
            if packed[2] < (best[1][2] if best else top) * (1 - 1e-12):
                best = (trial, packed)
        if best is None:
            break
        counts, (bins, labels, top) = best
    return bins, labels


def _replica_counts(loads: list[float], num_slots: int) -> list[int]:
    """One slot per expert, then each spare slot to the expert with the highest load per replica (ties: lower
    index): the largest per-replica load is then as small as ``num_slots`` allows."""
    counts = [1] * len(loads)
    heap = [(-w, e) for e, w in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(loads)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-loads[e] / counts[e], e))
    return counts


def _pack(weights: list[float], labels: list[int], num_bins: int, per_bin: int, spread: bool = True
          ) -> list[list[int]]:
    """Item indices per bin, ``per_bin`` items each: heaviest item first to the lightest bin with room (``spread``:
    a bin that already holds an item of the same label only when no other has room; without it, the published
    packing), then :func:`_refine`."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    totals = [0.0] * num_bins
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], labels[i])):
        room = [b for b in range(num_bins) if len(bins[b]) < per_bin]
        fresh = [b for b in room if all(labels[j] != labels[i] for j in bins[b])] if spread else room
        b = min(fresh or room, key=lambda b: (totals[b], b))
        bins[b].append(i)
        totals[b] += weights[i]
    _refine(bins, totals, weights, labels)
    return bins


def _refine(bins: list[list[int]], totals: list[float], weights: list[float], labels: list[int]) -> None:
    """Pairwise exchanges until none helps: for two bins with totals ``a > b``, swapping an item ``i`` of the first
    for a lighter ``j`` of the second with ``w_i - w_j < a - b`` brings both totals strictly inside ``[b, a]`` (the
    sum of squared totals falls, so this ends). The best such swap over all pairs each round, busiest bin's pairs
    first; a swap that would put a label twice in a bin is skipped."""
    for _ in range(MAX_SWAP_ROUNDS):
        best = None  # (squares saved, first bin, item position, second bin, item position)
        for a in sorted(range(len(bins)), key=lambda b: -totals[b]):
            for b in range(len(bins)):
                gap = totals[a] - totals[b]
                if gap <= 0:
                    continue
                for pi, i in enumerate(bins[a]):
                    for pj, j in enumerate(bins[b]):
                        delta = weights[i] - weights[j]
                        if not 0 < delta < gap or labels[i] == labels[j]:
                            continue
                        saved = 2 * delta * (gap - delta)  # a² + b² − (a − δ)² − (b + δ)²
                        if best is not None and saved <= best[0]:
                            continue
                        if _doubles(bins[b], j, labels[i], labels) or _doubles(bins[a], i, labels[j], labels):
                            continue
                        best = (saved, a, pi, b, pj)
            if best is not None:
                break  # the busiest bin that can improve goes first
        if best is None or best[0] <= 1e-12 * max(totals) ** 2:
            return
        _, a, pi, b, pj = best
        i, j = bins[a][pi], bins[b][pj]
        bins[a][pi], bins[b][pj] = j, i
        delta = weights[i] - weights[j]
        totals[a] -= delta
        totals[b] += delta


def _doubles(items: list[int], leaving: int, label: int, labels: list[int]) -> bool:
    """Whether a bin holding ``items`` would hold ``label`` twice once ``leaving`` is swapped out for it."""
    return any(labels[k] == label for k in items if k != leaving)
