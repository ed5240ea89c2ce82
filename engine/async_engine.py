"""The rank-0 Engine driven by one thread, for an asyncio server.

Threads (all in the rank-0 process):

- the event loop (the gRPC server) calls :meth:`AsyncEngine.submit`, :meth:`~AsyncEngine.abort` and
  :meth:`~AsyncEngine.call`; they only enqueue commands and never touch the Engine;
- the engine thread owns the Engine: between steps it drains the command queue (adds, aborts, calls), then
  runs one step and hands its outputs to the loop with ``loop.call_soon_threadsafe``, into one asyncio queue
  per request. While idle it runs a heartbeat (a control-plane round trip with every rank) every
  ``heartbeat_s``, so idle ranks stay inside the collective timeout and a dead rank is noticed without traffic;
- the watchdog thread declares the engine dead when one step, heartbeat or shutdown runs longer than
  ``step_timeout_s`` (a gloo/NCCL collective on a dead or stopped peer may hang instead of raising).

Any exception in the engine thread or a watchdog timeout is fatal: every open stream receives an
:class:`EngineFailure`, pending calls fail with :class:`EngineDead`, and ``on_fatal(reason)`` runs (the server
exits the process from there). Nothing is retried: a half-done collective leaves the ranks out of step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import RequestError
from engine.core.kv_manager import KvEvent
from engine.core.step_record import RankLoad, StepRecord
from engine.engine import Engine
from engine.params import Constraint, SamplingParams
from engine.step import RequestOutput

log = logging.getLogger(__name__)

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
    def __init__(self, engine: Engine, capacity: int, step_timeout_s: float, heartbeat_s: float,
                 on_fatal: Callable[[str], None] | None = None, throughput_window_s: float = 10.0,
                 on_kv_events: Callable[[list[KvEvent]], None] | None = None):
        """``capacity``: most requests (running + waiting) in the engine; one more is :class:`Overloaded`.
        ``on_kv_events``: called on the event loop with each step's prefix-index changes (the KV event stream)."""
        self.engine, self.capacity = engine, capacity
        self.on_kv_events = on_kv_events
        engine.scheduler.kv.recording = on_kv_events is not None
        self.step_timeout_s, self.heartbeat_s = step_timeout_s, heartbeat_s
        self.on_fatal = on_fatal or (lambda reason: None)
        self.window_s = throughput_window_s
        self.loads = Loads()
        self.dead: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._pending: set[asyncio.Future] = set()  # loop thread only
        self._busy: tuple[str, float] | None = None  # (what, since): set by the engine thread
        self._fatal_lock = threading.Lock()
        self._stopped = threading.Event()
        self._emitted: deque[tuple[float, tuple[int, ...]]] = deque()  # (when, tokens per DP rank) of each step
        self._commands_at = 0.0  # when the engine thread last ran commands (they change the loads)
        engine.subscribe(self._on_record)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    # ---- event-loop side -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._publish_loads()
        self._threads = [threading.Thread(target=self._run, name="engine", daemon=True),
                         threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams, dp_rank: int | None = None,
                     retain_kv: bool = False) -> RequestStream:
        """Adds a request; raises RequestError/SamplingError (bad input), Overloaded or EngineDead. ``dp_rank``,
        ``retain_kv``: as :meth:`Engine.add_request`."""
        if request_id in self._streams:
            raise RequestError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id, params.n)
        self._streams[request_id] = stream
        try:
            await self._command("add", request_id, prompt, params, dp_rank, retain_kv, time.monotonic())
        except BaseException:  # bad input, overload, or the caller went away while the add was queued
            self._streams.pop(request_id, None)
            stream.finished = True
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Ends the request if it is still in the engine (its stream gets a finished "abort" output)."""
        self._commands.put(("abort", None, request_id))

    def precompile(self, constraint: Constraint) -> None:
        """The other ranks start compiling ``constraint`` now (``Engine.precompile``, between steps); no reply."""
        self._commands.put(("precompile", None, constraint))

    def close(self, stream: RequestStream) -> None:
        """Called when the consumer is done with a stream; aborts the request if it has not finished."""
        if not stream.finished:
            stream.finished = True
            self._streams.pop(stream.request_id, None)
            self.abort(stream.request_id)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs ``fn(engine)`` on the engine thread between steps; returns its result."""
        return await self._command("call", fn)

    async def stop(self) -> None:
        """Graceful stop: pending commands run, then ``engine.shutdown()`` releases the other ranks."""
        await self._command("stop")
        self._stopped.set()
        self.dead = self.dead or "engine stopped"

    def fail_streams(self, reason: str) -> None:
        """Ends every open stream with an EngineFailure (loop thread)."""
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineFailure(reason))
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(EngineDead(reason))

    def _command(self, kind: str, *args) -> asyncio.Future:
        if self.dead:
            raise EngineDead(self.dead)
        fut = self._loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self._commands.put((kind, fut, *args))
        return fut

    def _settle(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
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

    # ---- engine thread ---------------------------------------------------------------------------
    def _reply(self, fut: asyncio.Future | None, result: Any = None, error: BaseException | None = None) -> None:
        if fut is not None:
            self._loop.call_soon_threadsafe(self._settle, fut, result, error)

    def _on_record(self, record: StepRecord) -> None:
        if record.generated_by_dp:
            self._emitted.append((record.t_end, record.generated_by_dp))

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        events = self.engine.scheduler.kv.drain_events() if self.on_kv_events is not None else []
        if events:
            self._loop.call_soon_threadsafe(self.on_kv_events, events)

    def _timed(self, what: str, fn: Callable[[], Any]) -> Any:
        self._busy = (what, time.monotonic())
        try:
            return fn()
        finally:
            self._busy = None

    def _run_command(self, cmd: tuple) -> bool:
        """Runs one command; returns False for stop."""
        kind, fut, *args = cmd
        if kind == "stop":
            self._timed("shutdown", self.engine.shutdown)
            self._reply(fut)
            return False
        if kind == "abort":
            (request_id,) = args
            if self.engine.scheduler.knows(request_id):
                self._emit(self.engine.abort_all(request_id))
            return True
        if kind == "precompile":
            self.engine.precompile(*args)
            return True
        if kind == "call":
            try:
                self._reply(fut, args[0](self.engine))
            except Exception as err:  # noqa: BLE001 - a failed read-only call is the caller's error only
                self._reply(fut, error=err)
            self._emit([])  # a call may change the prefix index (FlushCache)
            return True
        sched = self.engine.scheduler
        try:
            s = sched.stats()
            if s.running + s.waiting >= self.capacity:
                raise Overloaded(f"server at capacity: {s.running} running + {s.waiting} "
                                 f"waiting (server.max_num_seqs * attn_dp + server.max_queue = {self.capacity})")
            self.engine.add_request(*args)
            self._reply(fut)
        except (ValueError, Overloaded) as err:  # RequestError, SamplingError: the caller's fault, not the engine's
            self._reply(fut, error=err)
        return True

    def _run(self) -> None:
        last_beat = time.monotonic()
        try:
            while True:
                busy = self.engine.has_work()
                wait = 0.0 if busy else max(0.0, self.heartbeat_s - (time.monotonic() - last_beat))
                try:
                    cmds = [self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()]
                except queue.Empty:
                    cmds = []
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if cmds:
                    self._commands_at = time.monotonic()
                for cmd in cmds:
                    if not self._run_command(cmd):
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

    def _publish_loads(self) -> None:
        """After a step its record's per-rank figures; after commands (adds, aborts) the scheduler's now."""
        engine, cutoff = self.engine, time.monotonic() - self.window_s
        while self._emitted and self._emitted[0][0] < cutoff:
            self._emitted.popleft()
        sched, record = engine.scheduler, engine.last_record
        per_dp = record.kv if record is not None and record.t_end >= self._commands_at else sched.stats().per_dp
        gen = [sum(n[dp] for _, n in self._emitted) / self.window_s for dp in range(sched.dp_size)]
        self.loads = Loads(per_dp=per_dp, kv_block_size=sched.cfg.block_size, gen_tokens_per_s=tuple(gen),
                           steps=engine.stats.steps)

    # ---- watchdog --------------------------------------------------------------------------------
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
            self.dead = reason
        self._stopped.set()
        log.error("engine dead: %s", reason)
        try:
            self._loop.call_soon_threadsafe(self.fail_streams, reason)
        except (AttributeError, RuntimeError):  # no loop yet, or it is closed
            pass
        self.on_fatal(reason)
