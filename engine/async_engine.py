"""The rank-0 Engine driven by one thread, for an asyncio server.

Threads (all in the rank-0 process):

- the event loop (the gRPC server) calls :meth:`AsyncEngine.submit`, :meth:`~AsyncEngine.abort`,
  :meth:`~AsyncEngine.snapshot` and the other verbs; each enqueues one typed request (``engine/messages.py``) and never
  touches the Engine;
- the engine thread owns the Engine (:class:`EngineThread`): between steps it runs the queued requests, each
  dispatched by its type to one handler (a type it has no handler for is refused when sent), then runs one step and
  hands its outputs to the loop with ``loop.call_soon_threadsafe``, into one asyncio queue per request. While idle it
  runs a heartbeat (a control-plane round trip with every rank) every ``heartbeat_s``, so idle ranks stay inside the
  collective timeout and a dead rank is noticed without traffic;
- the watchdog thread declares the engine dead when one step, heartbeat or shutdown runs longer than
  ``step_timeout_s`` (a gloo/NCCL collective on a dead or stopped peer may hang instead of raising).

Any exception in the engine thread or a watchdog timeout is fatal: every open stream receives an
:class:`EngineFailure`, pending replies fail with :class:`EngineDead`, and ``on_fatal(reason)`` runs (the server
exits the process from there). Nothing is retried: a half-done collective leaves the ranks out of step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import typing
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import RequestError
from engine.core.kv_manager import KvEvent
from engine.core.step_record import RankLoad, StepRecord
from engine.engine import Engine
from engine.kv_transfers import PeerLease
from engine.messages import (
    AbortRequest,
    AddRequest,
    BalanceExperts,
    EngineRequest,
    EngineSnapshot,
    FlushCache,
    FlushResult,
    HandOffs,
    KVTier,
    Precompile,
    SetDraining,
    StartProfile,
    Stop,
    StopProfile,
    TakeSnapshot,
)
from engine.params import Constraint, SamplingParams
from engine.profiling import ProfilePlan
from engine.snapshot import engine_facts, expert_balance, take_snapshot
from engine.step import RequestOutput
from engine.worker.kv_loads import KVSource

log = logging.getLogger(__name__)


LOAD_CHANGING = (AddRequest, AbortRequest, FlushCache)  # requests after which the loads are published at once


class Overloaded(RuntimeError):
    """Running + waiting requests are at the server's capacity."""


class EngineDead(RuntimeError):
    """The engine failed (or was stopped); no request can run."""


@dataclass(frozen=True)
class EngineFailure:
    """Put on a request's queue when the engine dies under it."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class Loads:
    """A snapshot published by the engine thread after every step and command batch. ``gen_tokens_per_s``: tokens
    given to requests per second over the last ``throughput_window_s``, per attention-DP rank."""

    per_dp: tuple[RankLoad, ...] = (RankLoad(),)
    kv_block_size: int = 1  # tokens per KV-cache block
    gen_tokens_per_s: tuple[float, ...] = (0.0,)
    steps: int = 0
    tiers: tuple[KVTier, ...] = ()  # the KV tiers since start (device, then host when on)
    hand_offs: HandOffs = HandOffs()  # prefill/decode hand-offs since start

    @property
    def running(self) -> int:
        return sum(r.running for r in self.per_dp)

    @property
    def waiting(self) -> int:
        return sum(r.waiting for r in self.per_dp)

    @property
    def kv_blocks_used(self) -> int:
        return sum(r.blocks_used for r in self.per_dp)

    @property
    def kv_blocks_total(self) -> int:
        return sum(r.blocks_total for r in self.per_dp)

    @property
    def kv_usage(self) -> float:
        """Referenced blocks over all blocks (vLLM's rule: cached unreferenced blocks are free)."""
        return self.kv_blocks_used / self.kv_blocks_total


class RequestStream:
    """One request's outputs, read on the event loop: ``RequestOutput`` items, then maybe an ``EngineFailure``."""

    def __init__(self, request_id: str, n: int = 1):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        self.finished = False
        self.remaining = n  # samples still running (n > 1: each ends with its own finished output)


class AsyncEngine:
    """The event loop's side: request streams and one verb per :data:`EngineRequest`. Everything the engine says
    comes back as request outputs (streams), replies to these verbs, step records (:meth:`subscribe`, before
    :meth:`start`) and :attr:`loads`."""

    def __init__(self, engine: Engine, capacity: int, step_timeout_s: float, heartbeat_s: float,
                 on_fatal: Callable[[str], None] | None = None, throughput_window_s: float = 10.0,
                 on_kv_events: Callable[[list[KvEvent]], None] | None = None,
                 diagnose: Callable[[], str] | None = None):
        """``capacity``: most requests (running + waiting) in the engine; one more is :class:`Overloaded`.
        ``on_kv_events``: called on the event loop with each step's prefix-index changes (the KV event stream).
        ``diagnose``: on an engine failure, what the caller knows of why (which rank's process is gone), appended to
        the reason every stream and the log get."""
        self.engine_facts = engine_facts(engine)
        self.capacity = capacity
        self._thread = EngineThread(engine, self, step_timeout_s, heartbeat_s, on_fatal or (lambda reason: None),
                                    throughput_window_s, on_kv_events, diagnose)
        self._grammar = engine.grammar  # compiles run on the loop's executor, never on the engine thread
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._pending: set[asyncio.Future] = set()  # loop thread only
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def dead(self) -> str | None:
        return self._thread.dead

    @property
    def loads(self) -> Loads:
        return self._thread.loads

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def subscribe(self, fn: Callable[[StepRecord], None]) -> None:
        """``fn(record)`` after every step and heartbeat, on the engine thread; only before :meth:`start`."""
        if self.loop is not None:
            raise RuntimeError("subscribe before start: the engine thread owns the subscribers once it runs")
        self._thread.engine.subscribe(fn)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine thread and its watchdog; the comm counters count from here."""
        self.loop = loop
        self._thread.start()

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams, dp_rank: int | None = None,
                     retain_kv: bool = False, kv: KVSource | None = None, lease: PeerLease | None = None,
                     kv_missing: bool = False) -> RequestStream:
        """Adds a request; raises RequestError/SamplingError (bad input), Overloaded or EngineDead. ``dp_rank``,
        ``retain_kv``, ``kv``, ``lease``, ``kv_missing``: as :meth:`Engine.add_request`."""
        if request_id in self._streams:
            raise RequestError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id, params.n)
        self._streams[request_id] = stream
        try:
            await self._call(AddRequest(request_id=request_id, prompt=tuple(prompt), params=params, dp_rank=dp_rank,
                                        retain_kv=retain_kv, arrival=time.monotonic(), kv=kv, lease=lease,
                                        kv_missing=kv_missing))
        except BaseException:  # bad input, overload, or the caller went away while the add was queued
            self._streams.pop(request_id, None)
            stream.finished = True
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str, reply: bool = False) -> asyncio.Future | None:
        """Ends the request if it is still in the engine (its stream gets a finished "abort" output). With
        ``reply``: a future done once the engine has ended it and published its loads (EngineDead if dead)."""
        return self._call(AbortRequest(request_id), reply=reply)

    def close(self, stream: RequestStream) -> None:
        """Called when the consumer is done with a stream; aborts the request if it has not finished."""
        if not stream.finished:
            stream.finished = True
            self._streams.pop(stream.request_id, None)
            self.abort(stream.request_id)

    async def compile(self, constraint: Constraint) -> None:
        """Compiles ``constraint`` off the engine thread (cached by its text, so the engine's own check finds it
        compiled); a new one is announced to the other ranks first, which compile it on their grammar threads
        meanwhile. Raises ConstraintError naming it, or RequestError without a tokenizer."""
        if self._grammar is None:
            raise RequestError(f"{constraint.field}: structured output needs the checkpoint's tokenizer "
                               "(tokenizer.json or tiktoken.model)")
        if not self._grammar.cached(constraint):
            self._call(Precompile(constraint), reply=False)
        await asyncio.get_running_loop().run_in_executor(None, self._grammar.compile, constraint)

    async def flush_cache(self) -> FlushResult:
        return await self._call(FlushCache())

    async def snapshot(self) -> EngineSnapshot:
        return await self._call(TakeSnapshot())

    def set_draining(self) -> None:
        """The server takes no more requests: the engine counts the rest of its idle time as draining."""
        self._call(SetDraining(), reply=False)

    async def profile(self, plan: ProfilePlan | None) -> list[str] | None:
        """``plan``: start ``torch.profiler`` on every rank for its steps (replies None); None: stop and write every
        rank's trace (replies the files). ProfileError when one runs / none runs."""
        return await self._call(StartProfile(plan) if plan is not None else StopProfile())

    async def balance_experts(self, rebalance: bool = False) -> dict:
        """The expert load and placement now (``engine.snapshot.expert_balance``); ``rebalance``: the balancer
        rebalances at the next step boundary. RequestError naming the setting that is off."""
        return await self._call(BalanceExperts(rebalance))

    async def stop(self) -> None:
        """Graceful stop: queued requests run, then ``engine.shutdown()`` releases the other ranks (at once when the
        engine thread never started: the server failed first, a port it could not bind)."""
        if self.loop is None:
            self._thread.engine.shutdown()
            return
        await self._call(Stop())
        self._thread.stopped()

    def fail_streams(self, reason: str) -> None:
        """Ends every open stream with an EngineFailure (loop thread)."""
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineFailure(reason))
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(EngineDead(reason))

    def _call(self, request: EngineRequest, reply: bool = True) -> asyncio.Future | None:
        """Sends a request; with ``reply`` the future gets its reply or the error it raised."""
        if not reply:
            self._thread.put(request, None)
            return None
        if self.dead:
            raise EngineDead(self.dead)
        fut = self.loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self._thread.put(request, fut)
        return fut

    # ---- called on the loop by the engine thread -----------------------------------------------------------
    def settle(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                stream.remaining -= 1
            if stream.remaining == 0:
                stream.finished = True
                del self._streams[out.request_id]


REQUEST_TYPES = typing.get_args(EngineRequest)
CALLER_ERRORS = (ValueError, Overloaded)  # a request's own fault (RequestError, SamplingError, ConstraintError)


class EngineThread:
    """The engine thread and its watchdog. Runs each :data:`EngineRequest` by its type (:attr:`handlers`), steps
    while there is work, heartbeats while idle, publishes :class:`Loads`; any failure of its own is fatal."""

    def __init__(self, engine: Engine, front: AsyncEngine, step_timeout_s: float, heartbeat_s: float,
                 on_fatal: Callable[[str], None], throughput_window_s: float,
                 on_kv_events: Callable[[list[KvEvent]], None] | None, diagnose: Callable[[], str] | None = None):
        self.engine, self.front = engine, front
        self.step_timeout_s, self.heartbeat_s, self.on_fatal = step_timeout_s, heartbeat_s, on_fatal
        self.on_kv_events, self.window_s, self.diagnose = on_kv_events, throughput_window_s, diagnose
        engine.kv_events(on_kv_events is not None)
        self.handlers: dict[type, Callable[[Any], Any]] = {
            AddRequest: self._add, AbortRequest: self._abort, Precompile: lambda r: engine.precompile(r.constraint),
            FlushCache: lambda r: engine.flush_cache(), TakeSnapshot: lambda r: take_snapshot(engine),
            SetDraining: self._set_draining, StartProfile: lambda r: engine.start_profile(r.plan),
            StopProfile: lambda r: engine.stop_profile(), BalanceExperts: lambda r: expert_balance(engine, r.rebalance),
            Stop: lambda r: self._timed("shutdown", engine.shutdown)}
        assert set(self.handlers) == set(REQUEST_TYPES), "every EngineRequest type has one handler"
        self.loads = Loads()
        self.dead: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._busy: tuple[str, float] | None = None  # (what, since)
        self._fatal_lock = threading.Lock()
        self._stopped = threading.Event()
        self._emitted: deque[tuple[float, tuple[int, ...]]] = deque()  # (when, tokens per DP rank) of each step
        self._commands_at = 0.0  # when the engine thread last ran requests (they change the loads)
        engine.subscribe(self._on_record)

    def put(self, request: EngineRequest, fut: asyncio.Future | None) -> None:
        """Queues ``request`` (any thread); a type without a handler is a TypeError here, in the sender."""
        if type(request) not in self.handlers:
            raise TypeError(f"{type(request).__name__} is not an engine request (engine.messages.EngineRequest)")
        self._queue.put((request, fut))

    def start(self) -> None:
        self.engine.reset_counters()
        self._publish_loads()
        for target, name in ((self._run, "engine"), (self._watch, "engine-watchdog")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def stopped(self) -> None:
        self._stopped.set()
        self.dead = self.dead or "engine stopped"

    # ---- handlers (engine thread) -------------------------------------------------------------------------
    def _add(self, r: AddRequest) -> None:
        s = self.engine.scheduler.stats()
        if s.running + s.waiting >= self.front.capacity:
            raise Overloaded(f"server at capacity: {s.running} running + {s.waiting} waiting (server.max_num_seqs * "
                             f"attn_dp + server.max_queue = {self.front.capacity})")
        self.engine.add_request(r.request_id, list(r.prompt), r.params, r.dp_rank, r.retain_kv, r.arrival, r.kv,
                                r.lease, r.kv_missing)

    def _abort(self, r: AbortRequest) -> None:
        """Ends the request if it runs; ends its leases (a prefill's, by request id or lease key) either way."""
        if self.engine.scheduler.knows(r.request_id):
            self._emit(self.engine.abort_all(r.request_id))
        self.engine.scheduler.leases.release(r.request_id)

    def _set_draining(self, r: SetDraining) -> None:
        self.engine.draining = True

    def _handle(self, request: EngineRequest, fut: asyncio.Future | None) -> None:
        """Runs one request by its type and replies: a caller's error goes back to the caller (any error of a
        request with a reply but an add: a failed snapshot or flush leaves the engine fine); other errors are
        fatal."""
        caller_errors = CALLER_ERRORS if fut is None or isinstance(request, AddRequest) else Exception
        try:
            result, error = self.handlers[type(request)](request), None
        except caller_errors as err:
            result, error = None, err
        if isinstance(request, LOAD_CHANGING):  # the loads move now, before the caller hears back
            self._commands_at = time.monotonic()
            self._publish_loads()
        if fut is not None:
            self.front.loop.call_soon_threadsafe(self.front.settle, fut, result, error)
        elif error is not None:
            raise error
        self._emit([])  # a request may change the prefix index (FlushCache)

    def _run(self) -> None:
        last_beat = time.monotonic()
        try:
            while True:
                busy = self.engine.has_work()
                wait = 0.0 if busy else max(0.0, self.heartbeat_s - (time.monotonic() - last_beat))
                try:
                    batch = [self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()]
                except queue.Empty:
                    batch = []
                while True:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if batch:
                    self._commands_at = time.monotonic()
                for request, fut in batch:
                    self._handle(request, fut)
                    if isinstance(request, Stop):
                        self._publish_loads()
                        return
                if self.engine.has_work():
                    self._emit(self._timed("step", self.engine.step))
                    last_beat = time.monotonic()
                elif time.monotonic() - last_beat >= self.heartbeat_s:
                    self._timed("heartbeat", self.engine.heartbeat)
                    last_beat = time.monotonic()
                self._publish_loads()
        except BaseException as err:  # noqa: BLE001 - any failure here is fatal for the whole job
            log.exception("engine thread failed")
            self._fatal(f"engine step failed ({type(err).__name__}: {err}); a rank is probably dead")

    def _on_record(self, record: StepRecord) -> None:
        if record.generated_by_dp:
            self._emitted.append((record.t_end, record.generated_by_dp))

    def _emit(self, outputs: list[RequestOutput]) -> None:
        loop = self.front.loop
        if outputs:
            loop.call_soon_threadsafe(self.front.deliver, outputs)
        events = self.engine.kv_events_since() if self.on_kv_events is not None else []
        if events:
            loop.call_soon_threadsafe(self.on_kv_events, events)

    def _timed(self, what: str, fn: Callable[[], Any]) -> Any:
        self._busy = (what, time.monotonic())
        try:
            return fn()
        finally:
            self._busy = None

    def _publish_loads(self) -> None:
        """After a step its record's per-rank figures; after requests (adds, aborts) the scheduler's now."""
        engine, cutoff = self.engine, time.monotonic() - self.window_s
        while self._emitted and self._emitted[0][0] < cutoff:
            self._emitted.popleft()
        record = engine.last_record
        per_dp = record.kv if record is not None and record.t_end >= self._commands_at else \
            engine.scheduler.stats().per_dp
        gen = [sum(n[dp] for _, n in self._emitted) / self.window_s for dp in range(len(per_dp))]
        self.loads = Loads(per_dp=per_dp, kv_block_size=self.front.engine_facts.kv_block_size,
                           gen_tokens_per_s=tuple(gen), steps=engine.stats.steps, tiers=engine.transfers.tiers(),
                           hand_offs=engine.transfers.hand_offs())

    # ---- watchdog ------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopped.wait(0.2):
            busy = self._busy
            if busy and time.monotonic() - busy[1] > self.step_timeout_s:
                self._fatal(f"engine {busy[0]} stuck for more than server.step_timeout_s={self.step_timeout_s}s "
                            "(a rank is dead or hung)")
                return

    def _fatal(self, reason: str) -> None:
        with self._fatal_lock:
            if self.dead:
                return
            why = self.diagnose() if self.diagnose is not None else ""
            reason = f"{why}; {reason}" if why else reason
            self.dead = reason
        self._stopped.set()
        log.error("engine dead: %s", reason)
        try:
            self.front.loop.call_soon_threadsafe(self.front.fail_streams, reason)
        except (AttributeError, RuntimeError):  # no loop yet, or it is closed
            pass
        self.on_fatal(reason)
