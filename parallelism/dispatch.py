"""MoE token dispatchers: move routed tokens to the ranks holding their experts and back.

One interface (:class:`parallelism.dispatch_base.Dispatcher`), backends chosen in one registry
(:func:`make_dispatcher`):

- ``allreduce``: tokens replicated on every rank (TP attention). Each rank runs its local experts (or
  expert shards) on all tokens; one all-reduce over the world sums routed + shared partials.
  Per MoE layer: 1 all_reduce.
- ``alltoall``: tokens partitioned (DP attention). Each token goes once to every rank holding at least
  one of its experts (expert-TP shards are "virtual experts": every shard's rank gets the token);
  uneven counts. Per MoE layer: 3 all_to_all in dispatch (counts, rows, routing) + 1 in combine. Combine
  sums a token's returned rows with ``index_add_`` (atomics on a GPU), or with :attr:`CommMode.ordered`
  (``engine.batch_invariant``) in the order of the ranks they come back from (:func:`add_in_rank_order`).
- ``allgather``: tokens partitioned; all-gather (padded to the largest rank), local compute,
  reduce-scatter. Fixed shapes. Per MoE layer: 1 all_gather of counts + 2 all_gather (rows, routing)
  + 1 reduce_scatter.
- ``deepep``: DeepEP kernels (``parallelism/deepep.py``): normal mode for prefill, low-latency mode for decode
  (CUDA-graph safe); needs ``deep_ep`` built from source, NCCL and NVLink GPUs on one node, no expert-TP.

Expert-side contract: :class:`~parallelism.dispatch_base.ExpertInput` rows with, per routing choice, the local
expert slot (``-1`` when that expert is not on this rank) and its weight. Experts return the *weighted* sum over
their valid slots per row, ``[N, H]``; combine only moves and sums rows. Under ``engine.batch_invariant`` with
``moe_ep`` > 1 (:attr:`~parallelism.dispatch_base.Dispatcher.pairwise`) they return each (row, choice)'s weighted
output ``[N, k, H]`` instead, and combine moves those and adds a token's k of them in top-k order on its own rank:
the same collectives, k× the combine bytes (allreduce: the shared experts' partials ride in the same all-reduce
as a (k+1)-th slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelism.comm import Comm, ParallelGroups, ordered_sum
from parallelism.deepep import FALLBACK, DeepEPDispatcher, deepep_unavailable
from parallelism.dispatch_base import DeepEPUnavailable, Dispatcher, ExpertInput, capturing
from parallelism.layout import ExpertPlacement


@dataclass(frozen=True)
class AllToAllMeta:
    """What combine needs to send expert outputs back to their owners."""

    num_tokens: int
    token_index: torch.Tensor  # [S] int64: local token of each sent row, grouped by destination
    send_counts: list[int]
    recv_counts: list[int]
    dtype: torch.dtype  # the tokens' (unsummed pairs may come back in fp32)


@dataclass(frozen=True)
class AllGatherMeta:
    num_tokens: int
    padded: int  # rows per rank after padding
    dtype: torch.dtype


def add_pairs(pairs: torch.Tensor, dtype: torch.dtype, shared: torch.Tensor | None) -> torch.Tensor:
    """The placement-invariant sum: ``pairs [T, k, H]`` (every (token, choice)'s weighted expert output, on the
    token's rank) added in top-k order, in ``dtype``, then this rank's shared experts ``[T, H]``."""
    out = ordered_sum(pairs, 1).to(dtype)
    return out if shared is None else out + shared


class AllReduceDispatcher(Dispatcher):
    name = "allreduce"
    graph_safe = True

    def dispatch(self, x, topk_ids, topk_weights):
        inp = ExpertInput(x, self.local_slot[self.physical(topk_ids)], topk_weights.float(), unsummed=self.pairwise)
        return inp, x.dtype  # meta: the dtype the pairs are summed back into

    def combine(self, y, meta, shared):
        if not self.pairwise:
            out = y if shared is None else y + shared
            return self.world.all_reduce(out)
        k = y.shape[1]  # a pair is non-zero on the ranks holding its expert only: the rank-order sum adds zeros
        if shared is not None:  # the shared experts' partials (attention TP = this group) as slot k
            y = torch.cat([y, shared.to(y.dtype)[:, None]], dim=1)
        y = self.world.all_reduce(y.contiguous())
        return add_pairs(y[:, :k], meta, None if shared is None else y[:, k].to(meta))


class AllToAllDispatcher(Dispatcher):
    name = "alltoall"
    needs_partitioned_tokens = True

    def dispatch(self, x, topk_ids, topk_weights):
        t, k = topk_ids.shape
        phys = self.physical(topk_ids)
        dest = self.holders[phys].any(dim=1)  # [T, W]: token t needs rank r
        dest_rank, token_index = dest.t().nonzero(as_tuple=True)  # grouped by destination rank
        send_counts_t = torch.bincount(dest_rank, minlength=self.world.size)
        recv_counts_t = self.world.exchange_counts(send_counts_t)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        slots = self.slot_at_rank[phys[token_index], dest_rank[:, None]]  # [S, k] slot at the destination
        routing = torch.cat([slots.float(), topk_weights[token_index].float()], dim=1)  # [S, 2k]
        hidden = self.world.all_to_all(x[token_index], send_counts, recv_counts)
        routing = self.world.all_to_all(routing, send_counts, recv_counts)
        meta = AllToAllMeta(t, token_index, send_counts, recv_counts, x.dtype)
        return ExpertInput(hidden, routing[:, :k].long(), routing[:, k:], unsummed=self.pairwise), meta

    def combine(self, y, meta, shared):
        back = self.world.all_to_all(y.flatten(1), meta.recv_counts, meta.send_counts)  # [S, k*H] or [S, H]
        out = torch.zeros(meta.num_tokens, back.shape[1], dtype=y.dtype, device=y.device)
        if self.world.mode.ordered:
            add_in_rank_order(out, back, meta)
        else:
            out.index_add_(0, meta.token_index, back)
        if y.dim() == 3:  # pairwise: [S, k, H] came back
            return add_pairs(out.view(meta.num_tokens, *y.shape[1:]), meta.dtype, shared)
        return out if shared is None else out + shared


def add_in_rank_order(out: torch.Tensor, back: torch.Tensor, meta: AllToAllMeta) -> torch.Tensor:
    """``out [T, H] += back [S, H]`` at rows ``meta.token_index``, one source rank at a time in rank order: a token
    appears at most once among one rank's rows, so each step is a plain gather-add-scatter (no atomics) and a
    token's sum is ``((0 + rank a's row) + rank b's row) + ...`` for the ranks a < b < ... that hold its experts,
    whatever else shares the batch. Returns ``out``."""
    start = 0
    for count in meta.send_counts:  # rows come back grouped by the rank they went to, in rank order
        rows = meta.token_index[start:start + count]
        out[rows] += back[start:start + count]
        start += count
    return out


class AllGatherDispatcher(Dispatcher):
    """Every rank's tokens padded to the busiest rank's count, all-gathered; combine reduce-scatters. Eager, the
    count is exchanged and read on the host; inside a CUDA-graph capture it is not: a captured (static) step
    has the same shape on every rank (the runner pads attention-DP ranks to one batch), so ``padded = t``."""

    name = "allgather"
    needs_partitioned_tokens = True
    graph_safe = True

    def dispatch(self, x, topk_ids, topk_weights):
        t = x.shape[0]
        padded = t if capturing() else int(self.world.all_gather(torch.tensor([t], device=x.device)).max())
        pad = padded - t
        x_pad = torch.nn.functional.pad(x, (0, 0, 0, pad))
        routing = torch.cat([self.physical(topk_ids).float(), topk_weights.float()], dim=1)
        routing = torch.nn.functional.pad(routing, (0, 0, 0, pad), value=0.0)
        routing[t:, : topk_ids.shape[1]] = -1  # padding rows route nowhere
        hidden = self.world.all_gather(x_pad)
        routing = self.world.all_gather(routing)
        k = topk_ids.shape[1]
        ids = routing[:, :k].long()
        slots = torch.where(ids >= 0, self.local_slot[ids.clamp(min=0)], -1)
        inp = ExpertInput(hidden, slots, routing[:, k:], unsummed=self.pairwise)
        return inp, AllGatherMeta(t, padded, x.dtype)

    def combine(self, y, meta, shared):
        out = self.world.reduce_scatter(y.flatten(1))[: meta.num_tokens]  # [T, k*H] or [T, H]
        if y.dim() == 3:
            return add_pairs(out.view(meta.num_tokens, *y.shape[1:]), meta.dtype, shared)
        return out if shared is None else out + shared


@dataclass(frozen=True)
class SplitMeta:
    num_tokens: int  # T: rows on every rank of the attention-TP group
    chunk: int  # rows of each TP rank's share, ceil(T / attn_tp), padding included
    inner: object  # the partitioned dispatcher's meta


class AttentionTPSplit(Dispatcher):
    """A partitioned-token dispatcher (``inner``) under attention TP, where every rank of an attention-TP group
    holds the same T tokens (``attn_tp`` > 1: mixed TP × DP attention, or TP attention with ``alltoall``).

    Each TP rank hands ``inner`` its share, rows ``[r*c, (r+1)*c)`` with ``c = ceil(T / attn_tp)``, padded to
    ``c`` rows so that every rank's share has one shape (padding rows copy row 0's expert ids, with zero
    weights, and are dropped at the end). Combine adds this rank's chunk of the shared experts — their partial
    sums over the TP group, reduce-scattered — and all-gathers the chunks, so every TP rank gets all T rows
    back. On top of ``inner``'s collectives, per MoE layer: 1 all_gather, and 1 reduce_scatter with shared
    experts, over the attention-TP group, counted as ``attn_tp_split`` (apart from attention's own ``attn_tp``
    traffic). The router runs on all T rows on every TP rank (row-wise, cheap)."""

    needs_partitioned_tokens = False  # it takes the TP group's replicated tokens

    def __init__(self, inner: Dispatcher, attn_tp: Comm):  # no routing tables of its own: inner has them
        self.inner, self.tp = inner, attn_tp.with_kind("attn_tp_split")
        self.groups, self.world, self.name = inner.groups, inner.world, inner.name
        self.needs_nvlink = inner.needs_nvlink

    @property
    def graph_safe(self) -> bool:
        return self.inner.graph_safe

    @property
    def graph_token_limit(self) -> int | None:
        """``inner``'s per-rank bound × ``attn_tp``: a TP group of T tokens hands each rank ceil(T / attn_tp)."""
        limit = self.inner.graph_token_limit
        return None if limit is None else limit * self.tp.size

    def to(self, device):
        self.inner.to(device)
        return self

    @property
    def placement(self):
        return self.inner.placement

    def set_placement(self, placement) -> None:
        self.inner.set_placement(placement)

    def dispatch(self, x, topk_ids, topk_weights):
        t, rank = x.shape[0], self.tp.rank
        chunk = -(-t // self.tp.size)
        lo, hi = min(rank * chunk, t), min((rank + 1) * chunk, t)
        pad = chunk - (hi - lo)
        x, ids, weights = x[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi]
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
            ids = torch.cat([ids, topk_ids[:1].expand(pad, -1)])
            weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
        inp, meta = self.inner.dispatch(x, ids, weights)
        return inp, SplitMeta(t, chunk, meta)

    def combine(self, y, meta, shared):
        out = self.inner.combine(y, meta.inner, None)  # [c, H]: this rank's share
        if shared is not None:  # [T, H] partial over the TP group → this rank's summed chunk
            pad = meta.chunk * self.tp.size - meta.num_tokens
            out = out + self.tp.reduce_scatter(torch.nn.functional.pad(shared, (0, 0, 0, pad)))
        return self.tp.all_gather(out)[:meta.num_tokens]


def _deepep_factory(groups: ParallelGroups, placement: ExpertPlacement) -> Dispatcher:
    """``deepep``: :class:`parallelism.deepep.DeepEPDispatcher` once its capability check passes."""
    reason = deepep_unavailable(groups)
    if reason:
        raise DeepEPUnavailable(f"dispatcher 'deepep' is unavailable: {reason}. Use {FALLBACK} (the "
                                "torch.distributed all-to-all, same semantics)")
    return DeepEPDispatcher(groups, placement)


_REGISTRY = {
    "allreduce": AllReduceDispatcher,
    "alltoall": AllToAllDispatcher,
    "allgather": AllGatherDispatcher,
    "deepep": _deepep_factory,
}


def make_dispatcher(groups: ParallelGroups, placement: ExpertPlacement) -> Dispatcher:
    """The one place a dispatcher backend is chosen: ``layout.resolved_dispatcher``; one that needs partitioned
    tokens gets each attention-TP rank's share of them (:class:`AttentionTPSplit`) when ``attn_tp`` > 1."""
    dispatcher = _REGISTRY[groups.layout.resolved_dispatcher](groups, placement)
    if dispatcher.needs_partitioned_tokens and groups.layout.attn_tp > 1:
        return AttentionTPSplit(dispatcher, groups.attn_tp)
    return dispatcher


def expected_forward_calls(layout, num_layers: int, num_moe_layers: int, logits: bool = True,
                           shared_experts: bool = True) -> dict[str, int]:
    """Collective calls of one forward per rank, by ``"group/op"`` — the formula the tests check.

    Attention TP (``attn_tp`` > 1): ``attn_tp/all_reduce = 1 (embedding) + L (o_proj) + L_dense (down_proj)``,
    ``attn_tp/gather = 1`` (LM head). MoE: allreduce ``world/all_reduce = L_moe`` (routed + shared experts share
    it); alltoall ``world/all_to_all = 4 L_moe``; allgather ``world/all_gather = 3 L_moe`` and
    ``world/reduce_scatter = L_moe``; a partitioned dispatcher under attention TP adds ``attn_tp_split/all_gather
    = L_moe`` and, with shared experts, ``attn_tp_split/reduce_scatter = L_moe`` (:class:`AttentionTPSplit`).
    """
    if layout.world_size == 1:
        return {}
    kind, moe = layout.resolved_dispatcher, num_moe_layers
    calls = {}
    if layout.attn_tp > 1:
        calls["attn_tp/all_reduce"] = 1 + num_layers + (num_layers - num_moe_layers)
        if logits:
            calls["attn_tp/gather"] = 1
    if kind == "allreduce":
        return {**calls, "world/all_reduce": moe}
    if kind == "alltoall":
        calls["world/all_to_all"] = 4 * moe
    elif kind == "allgather":
        calls.update({"world/all_gather": 3 * moe, "world/reduce_scatter": moe})
    else:
        raise ValueError(f"no call formula for dispatcher {kind!r}")
    if layout.attn_tp > 1:
        calls["attn_tp_split/all_gather"] = moe
        if shared_experts:
            calls["attn_tp_split/reduce_scatter"] = moe
    return calls
