"""The one module that calls ``torch.distributed``.

Every collective goes through a :class:`Comm` bound to one process group; each call is counted in a
shared :class:`CommCounter` by (group kind, op): calls and bytes. ``bytes`` is the size of the tensor
this rank contributes (all-reduce: the tensor; all-gather: the local part; all-to-all: the send
buffer; reduce-scatter: the full input), so per-token figures compare layouts on equal terms.
A group of size 1 does nothing and counts nothing.

Summation order: ``all_reduce`` and ``reduce_scatter`` leave it to the backend (NCCL picks ring or tree per call;
gloo's ring chunks the buffer by its total size, so an element's order depends on how many rows share the call).
With :attr:`CommMode.ordered` (``engine.batch_invariant``) both gather every rank's part and sum them in group-rank
order on every rank, so each element's sum depends on nothing but its own values: more bytes, one order.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallelism.layout import Layout


@dataclass
class CommCounter:
    """Calls and bytes per ``(group_kind, op)``."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, group: str, op: str, nbytes: int) -> None:
        self.calls[(group, op)] += 1
        self.bytes[(group, op)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"group/op": {"calls": n, "bytes": b}}``, JSON-ready."""
        return {
            f"{g}/{op}": {"calls": self.calls[(g, op)], "bytes": self.bytes[(g, op)]}
            for (g, op) in sorted(self.calls)
        }

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclass
class CommMode:
    """Shared by every :class:`Comm` of one rank (``build_groups``): ``ordered`` = reductions in rank order."""

    ordered: bool = False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Collectives over one process group, counted. ``size == 1`` is a no-op path."""

    def __init__(self, kind: str, group: dist.ProcessGroup | None, ranks: list[int], counter: CommCounter,
                 mode: CommMode | None = None):
        self.kind = kind
        self.mode = mode or CommMode()
        self.group = group
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(dist.get_rank()) if self.size > 1 else 0
        self.counter = counter

    def with_kind(self, kind: str) -> Comm:
        """This group's collectives counted under another ``kind`` (a second purpose of the same ranks)."""
        return Comm(kind, self.group, self.ranks, self.counter, self.mode)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place; returns ``x``."""
        if self.size == 1:
            return x
        self.counter.record(self.kind, "all_reduce", _nbytes(x))
        if self.mode.ordered:
            parts = x.new_empty(self.size * x.numel())
            dist.all_gather_into_tensor(parts, x.reshape(-1).contiguous(), group=self.group)
            return x.copy_(ordered_sum(parts.view(self.size, *x.shape), 0))
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, ...]`` per rank → ``[size*n, ...]`` in group-rank order (equal ``n`` on every rank)."""
        if self.size == 1:
            return x
        self.counter.record(self.kind, "all_gather", _nbytes(x))
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=self.group)  # all_gather_into_tensor is deprecated
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[size*n, ...]`` → the sum over ranks of this rank's ``[n, ...]`` chunk."""
        if self.size == 1:
            return x
        self.counter.record(self.kind, "reduce_scatter", _nbytes(x))
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        if self.mode.ordered:  # rank r's chunk c goes to rank c: parts[r] = rank r's copy of this rank's chunk
            parts = x.new_empty(x.shape)
            dist.all_to_all_single(parts, x.contiguous(), group=self.group)
            return out.copy_(ordered_sum(parts.view(self.size, *out.shape), 0))
        dist.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def gather(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """``[n, ...]`` per rank → ``[size*n, ...]`` on group rank ``dst``; None on the others."""
        if self.size == 1:
            return x
        self.counter.record(self.kind, "gather", _nbytes(x))
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else None
        dist.gather(x, parts, dst=self.ranks[dst], group=self.group)
        return torch.cat(parts) if parts is not None else None

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows ``x[sum(send_counts[:r]) : ...]`` go to group rank r; returns ``[sum(recv_counts), ...]``."""
        if self.size == 1:
            return x
        self.counter.record(self.kind, "all_to_all", _nbytes(x))
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """Each rank's ``[size]`` int64 row counts → the counts every rank sends to this one."""
        if self.size == 1:
            return send_counts
        self.counter.record(self.kind, "all_to_all", _nbytes(send_counts))
        out = torch.empty_like(send_counts)
        dist.all_to_all_single(out, send_counts.contiguous(), group=self.group)
        return out

    def send_recv(self, sends: list[tuple[int, int, torch.Tensor]], recvs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Point to point: each ``(group rank, tag, tensor)`` of ``sends`` goes to that rank, each of ``recvs`` is
        filled from it (tags pair them up); returns when all are done. Every rank passes its own lists (a rank with
        none passes two empty ones and returns at once)."""
        if self.size == 1 or not (sends or recvs):
            return
        for _, _, t in sends:
            self.counter.record(self.kind, "send", _nbytes(t))
        works = [dist.isend(t.contiguous(), self.ranks[r], group=self.group, tag=tag) for r, tag, t in sends]
        works += [dist.irecv(t, self.ranks[r], group=self.group, tag=tag) for r, tag, t in recvs]
        for w in works:
            w.wait()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``x`` in place from group rank ``src``."""
        if self.size == 1:
            return x
        self.counter.record(self.kind, "broadcast", _nbytes(x))
        dist.broadcast(x, self.ranks[src], group=self.group)
        return x

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Broadcast a picklable object (control plane: step plans, not activations)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, self.ranks[src], group=self.group)
        return box[0]

    def gather_objects(self, obj: object, dst: int = 0) -> list[object] | None:
        """Picklable objects of every rank, in group order, on ``dst``; None elsewhere."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.group)
        return out

    def all_gather_objects(self, obj: object) -> list[object]:
        """Picklable objects of every rank, in group order, on every rank (control plane)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` one slice at a time in index order, ``((x[0] + x[1]) + x[2]) + ...`` elementwise: one order
    for every element (the rank-order reductions, and the batch-invariant MoE combines: a token's k expert outputs
    in top-k order)."""
    parts = x.unbind(dim)
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc


@dataclass
class ParallelGroups:
    """The process groups of one rank, built once from a Layout and passed down to every layer."""

    layout: Layout
    rank: int
    counter: CommCounter
    world: Comm
    attn_tp: Comm
    attn_dp: Comm
    moe_tp: Comm
    moe_ep: Comm
    control: Comm | None = None  # every rank over gloo: host-side agreements that must not depend on NCCL

    @property
    def coords(self):
        return self.layout.coords(self.rank)

    @property
    def mode(self) -> CommMode:
        """How this rank's collectives reduce (shared by all its groups)."""
        return self.world.mode


def build_groups(layout: Layout, counter: CommCounter | None = None) -> ParallelGroups:
    """Creates every process group of ``layout`` (collective: all ranks must call it)."""
    counter, mode = counter or CommCounter(), CommMode()
    if layout.world_size == 1:
        rank = 0
        comms = {kind: Comm(kind, None, [0], counter, mode)
                 for kind in ("world", "attn_tp", "attn_dp", "moe_tp", "moe_ep", "control")}
        return ParallelGroups(layout=layout, rank=rank, counter=counter, **comms)
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"layout world_size {layout.world_size} != launched world {dist.get_world_size()}")
    comms = {}
    for kind, rank_lists in layout.groups().items():
        for ranks in rank_lists:
            group = dist.group.WORLD if kind == "world" else dist.new_group(ranks)
            if rank in ranks:
                comms[kind] = Comm(kind, group, ranks, counter, mode)
    world = list(range(layout.world_size))
    gloo = dist.get_backend() == "gloo"
    comms["control"] = Comm("control", dist.group.WORLD if gloo else dist.new_group(world, backend="gloo"), world,
                            counter, mode)
    return ParallelGroups(layout=layout, rank=rank, counter=counter, **comms)


def side_group(groups: ParallelGroups, kind: str) -> Comm:
    """A second group over the whole world, for traffic that runs on a thread beside the steps' collectives (expert
    moves): its own connections (the default backend's), its own counter. Collective: every rank calls it, in the
    same order relative to every other group it makes."""
    world = list(range(groups.layout.world_size))
    group = dist.new_group(world) if groups.layout.world_size > 1 else None
    return Comm(kind, group, world, CommCounter(), groups.mode)


def init_distributed(rank: int, world_size: int, master_port: int, backend: str | None = None,
                     timeout_s: float = 300.0) -> None:
    """Initialises the default process group (gloo on CPU, NCCL on GPUs), on loopback unless ``MASTER_ADDR`` names
    another host (torchrun across nodes). On loopback nothing listens beyond it: the rendezvous store serves a
    socket bound to 127.0.0.1 (torch's own binds every interface whatever the address), and gloo's and NCCL's
    sockets use the ``lo`` interface."""
    if world_size == 1 or dist.is_initialized():
        return
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(master_port)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_loopback(addr):
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = loopback_store(rank, world_size, master_port, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_store(rank: int, world_size: int, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store on 127.0.0.1:``port``: rank 0 serves it from a socket it bound to loopback itself
    (``master_listen_fd``), the others connect."""
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
