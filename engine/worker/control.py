"""The rank control plane: everything rank 0 tells the other ranks is a :class:`RankMessage` — a type with one method
that runs it on a rank and a declared reply — sent with one call (:meth:`ControlPlane.send`: broadcast, run here,
gather as declared) and run on the other ranks by one loop (:meth:`ControlPlane.serve`). Every message travels in an
:class:`Envelope` numbered in sending order: a rank that receives one out of order, or anything that is not a
message, raises :class:`RankProtocolError` at once, naming both, instead of waiting in a collective that will never
match. A new cross-rank action is a new message type, not a branch in two loops kept in step by hand.

KV moves: :class:`ReadKV` reads given blocks out of every layer group into host memory, :class:`LoadKV` starts
writing a source's blocks into given blocks off the step thread (the plan that first uses them waits for it:
``StepPlan.loads``), :class:`StoreKV` copies device blocks into the rank's host-tier slots before the next step,
:class:`PutKV` writes committed blocks to the shared store, :class:`LoadOutcomes` gathers which loads failed softly,
:class:`LeaseKV` gathers where a prefill's leased blocks are for a decode worker to read (a lease ends on rank 0
alone: the ranks never hold one). Expert moves: :class:`ReadExpertLoad` gathers the expert load counts,
:class:`MoveExperts` starts moving one MoE layer's experts in the background, :class:`SwapExperts` switches the
layer to them between two steps on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch

from engine.params import Constraint
from engine.profiling import ProfileControl, RankProfiler
from engine.step import RankReport, StepPlan
from engine.worker.kv_loads import KVSource
from engine.worker.kv_peer import PeerShard
from engine.worker.runner import Launched, ModelRunner
from engine.worker.telemetry import TelemetrySampler
from parallelism.comm import Comm


class RankProtocolError(RuntimeError):
    """A rank received a message out of order, or something that is not a rank message."""


class Reply(Enum):
    NONE = "none"  # nothing comes back
    GATHER = "gather"  # one object from every rank, gathered on rank 0 (rank order)
    REPORTS = "reports"  # one RankReport gather per step the message finished (zero, one or two)


@dataclass
class RankState:
    """What a message runs against on one rank: its runner, telemetry sampler and profiler, and the step it has in
    flight (``engine.overlap=on``: launched, not yet read back)."""

    runner: ModelRunner
    telemetry: TelemetrySampler | None = None
    profiler: RankProfiler | None = None
    in_flight: Launched | None = field(default=None)

    def report(self, step: Launched | None) -> RankReport:
        """This rank's share of a gather: ``step``'s results and coverage (read back now), its newest telemetry."""
        sample = self.telemetry.fresh() if self.telemetry is not None else None
        if step is None:
            return RankReport(None, {}, sample)
        out = self.runner.finish(step)
        return RankReport(out.results, out.coverage, sample)


class RankMessage:
    """A message from rank 0 to every rank: :meth:`run` does it on a rank and returns what :attr:`reply` declares."""

    reply: ClassVar[Reply] = Reply.NONE

    def run(self, rank: RankState) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Step(RankMessage):
    """Launch ``plan`` on this rank; read back the step in flight first finished, then this one unless it overlaps
    (overlap is the plan's property: ``StepPlan.overlap``). Replies a report per finished step, oldest first."""

    plan: StepPlan
    reply: ClassVar[Reply] = Reply.REPORTS

    def run(self, rank: RankState) -> list[RankReport]:
        launched = rank.runner.launch_plan(self.plan)
        done, rank.in_flight = [rank.in_flight], launched if self.plan.overlap else None
        if not self.plan.overlap:
            done.append(launched)
        return [rank.report(step) for step in done if step is not None]


@dataclass(frozen=True)
class Drain(RankMessage):
    """Nothing new to launch: read back the step in flight (overlap). Replies its report, if there was one."""

    reply: ClassVar[Reply] = Reply.REPORTS

    def run(self, rank: RankState) -> list[RankReport]:
        step, rank.in_flight = rank.in_flight, None
        return [rank.report(step)] if step is not None else []


@dataclass(frozen=True)
class Heartbeat(RankMessage):
    """An idle liveness round trip (no forward, no data collective): replies this rank's newest telemetry."""

    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> RankReport:
        return rank.report(None)


@dataclass(frozen=True)
class WarmUpShape(RankMessage):
    """Run (capture, on CUDA) static shape ``(batch, tree_size)`` once; replies ``(replayed, why not)``."""

    batch: int
    tree_size: int
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> tuple[bool, str]:
        return rank.runner.warm_up(self.batch, self.tree_size)


@dataclass(frozen=True)
class Precompile(RankMessage):
    """Start compiling ``constraint`` on this rank's grammar thread (a request under it is on its way)."""

    constraint: Constraint

    def run(self, rank: RankState) -> None:
        rank.runner.precompile(self.constraint)


@dataclass(frozen=True)
class Profile(RankMessage):
    """Start or stop ``torch.profiler`` on this rank; replies its answer (``RankProfiler.apply``)."""

    control: ProfileControl
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> str:
        return rank.profiler.apply(self.control)


@dataclass(frozen=True)
class ReadKV(RankMessage):
    """The bytes of ``blocks`` over every layer group, on the ranks of attention-DP group ``dp_rank``; replies
    ``[len(blocks), block_bytes]`` uint8 there (``PagedKVCache.read_blocks``), None elsewhere."""

    dp_rank: int
    blocks: tuple[int, ...]
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> torch.Tensor | None:
        runner = rank.runner
        return runner.cache.read_blocks(list(self.blocks)) if runner.requests.dp_rank == self.dp_rank else None


@dataclass(frozen=True)
class LoadKV(RankMessage):
    """Load ``load_id``: on the ranks of attention-DP group ``dp_rank``, start writing ``source``'s blocks
    ``source_blocks`` into ``blocks`` on the loader thread (``engine.worker.kv_loads.RankLoads``)."""

    load_id: int
    dp_rank: int
    blocks: tuple[int, ...]
    source_blocks: tuple[int, ...]
    source: KVSource

    def run(self, rank: RankState) -> None:
        if rank.runner.requests.dp_rank == self.dp_rank:
            rank.runner.loads.start(self.load_id, list(self.blocks), list(self.source_blocks), self.source)


@dataclass(frozen=True)
class StoreKV(RankMessage):
    """On the ranks of attention-DP group ``dp_rank``, queue copies of device ``blocks`` into host-tier ``slots`` on
    the copy thread (every later step waits for them: ``RankLoads.wait_stores``)."""

    dp_rank: int
    blocks: tuple[int, ...]
    slots: tuple[int, ...]

    def run(self, rank: RankState) -> None:
        if rank.runner.requests.dp_rank == self.dp_rank:
            rank.runner.loads.offload(list(self.blocks), list(self.slots))


@dataclass(frozen=True)
class PutKV(RankMessage):
    """On the ranks of attention-DP group ``dp_rank``, write committed device ``blocks`` to the shared KV store under
    ``hashes`` (each rank its shard; read before the next step, put in the background)."""

    dp_rank: int
    blocks: tuple[int, ...]
    hashes: tuple[int, ...]

    def run(self, rank: RankState) -> None:
        if rank.runner.requests.dp_rank == self.dp_rank:
            rank.runner.loads.put(list(self.blocks), list(self.hashes))


@dataclass(frozen=True)
class LeaseKV(RankMessage):
    """Blocks ``blocks`` of attention-DP group ``dp_rank`` are leased to a decode worker: each of its ranks replies
    its :class:`~engine.worker.kv_peer.PeerShard` (its transfer endpoint, started on ``host`` over ``protocol`` on
    first use), the others None."""

    dp_rank: int
    blocks: tuple[int, ...]
    host: str
    protocol: str
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> PeerShard | None:
        if rank.runner.requests.dp_rank != self.dp_rank:
            return None
        return rank.runner.loads.peer(self.host, self.protocol).shard(list(self.blocks))


@dataclass(frozen=True)
class LoadOutcomes(RankMessage):
    """Loads ``load_ids`` are done on rank 0 (or not its own): every rank waits for its share and replies those whose
    source failed there (id → why), so rank 0 has the requests recompute them."""

    load_ids: tuple[int, ...]
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> dict[int, str]:
        return rank.runner.loads.outcome(self.load_ids)


@dataclass(frozen=True)
class ReadExpertLoad(RankMessage):
    """This rank's expert load counts (``engine.expert_load``): ``[L, E]`` int64 tokens per logical expert per MoE
    layer since start or the last reset, on each attention-DP group's counting rank (attention-TP rank 0), None
    elsewhere; ``reset`` zeroes them after the read."""

    reset: bool = False
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> torch.Tensor | None:
        load = rank.runner.expert_load
        if load is None or not load.counting:
            return None
        return load.reset() if self.reset else load.counts.to("cpu", copy=True)


@dataclass(frozen=True)
class MoveExperts(RankMessage):
    """Start moving MoE layer ``layer`` to the expert placement ``slots`` (the logical expert of each physical slot),
    to be ``version``: the weights travel rank to rank on a thread while steps go on
    (:meth:`~engine.worker.expert_moves.ExpertMaps.start`). Replies the bytes this rank sends."""

    layer: int
    slots: tuple[int, ...]
    version: int
    reply: ClassVar[Reply] = Reply.GATHER

    def run(self, rank: RankState) -> int:
        return rank.runner.expert_maps.start(self.layer, self.slots, self.version)


@dataclass(frozen=True)
class SwapExperts(RankMessage):
    """Between two steps: wait for MoE layer ``layer``'s move, write its weights and switch its routing tables
    (:meth:`~engine.worker.expert_moves.ExpertMaps.swap`)."""

    layer: int

    def run(self, rank: RankState) -> None:
        rank.runner.expert_maps.swap(self.layer)


@dataclass(frozen=True)
class Shutdown(RankMessage):
    """The job ends: the ranks leave their loop (``worker_loop`` then closes what the rank holds)."""

    def run(self, rank: RankState) -> None:
        return None


@dataclass(frozen=True)
class Envelope:
    seq: int
    message: object


class ControlPlane:
    """One rank's end of the control plane over ``comm`` (the gloo control group): rank 0 sends, the others serve.
    Sequence numbers count every message from 1 on both sides."""

    def __init__(self, comm: Comm):
        self.comm, self.seq = comm, 0

    @property
    def size(self) -> int:
        return self.comm.size

    def send(self, message: RankMessage, rank: RankState | None = None) -> Any:
        """Rank 0: broadcasts ``message``, runs it on ``rank`` (rank 0's own state; None: rank 0 has no share) and,
        for a :attr:`Reply.GATHER` message, returns every rank's reply (rank order). A :attr:`Reply.REPORTS` message
        returns rank 0's reports, each to be passed to :meth:`gather` as rank 0 finishes that step."""
        self.seq += 1
        self.comm.broadcast_object(Envelope(self.seq, message))
        mine = message.run(rank) if rank is not None else None
        return self.comm.gather_objects(mine) if message.reply is Reply.GATHER else mine

    def gather(self, report: RankReport) -> list[RankReport]:
        """Rank 0: one finished step's gather (``Step`` / ``Drain``), rank 0's report given."""
        return self.comm.gather_objects(report)

    def serve(self, rank: RankState) -> bool:
        """Every rank but 0: runs the next message and replies as it declares; False after :class:`Shutdown`."""
        self.seq += 1
        envelope = self.comm.broadcast_object(None)
        where = f"rank {self.comm.rank} of the control plane"
        if not isinstance(envelope, Envelope):
            raise RankProtocolError(f"{where} expected message {self.seq}, got a {type(envelope).__name__} "
                                    f"({envelope!r:.80}) that is not an Envelope")
        if envelope.seq != self.seq:
            raise RankProtocolError(f"{where} expected message {self.seq}, got message {envelope.seq} "
                                    f"({type(envelope.message).__name__}): rank 0 and this rank are out of step")
        message = envelope.message
        if not isinstance(message, RankMessage):
            raise RankProtocolError(f"{where} cannot run message {envelope.seq}: a {type(message).__name__} is not "
                                    "a RankMessage")
        reply = message.run(rank)
        if message.reply is Reply.GATHER:
            self.comm.gather_objects(reply)
        elif message.reply is Reply.REPORTS:
            for report in reply:
                self.comm.gather_objects(report)
        return not isinstance(message, Shutdown)
