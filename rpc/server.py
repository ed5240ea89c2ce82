"""The gRPC server on rank 0: services, start-up, SIGTERM drain, and the fatal path.

Lifecycle:

- start: health NOT_SERVING → bind → start the engine thread → SERVING.
- SIGTERM/SIGINT: health NOT_SERVING and new Generates UNAVAILABLE; in-flight streams run to their end for up to
  ``drain_timeout_s`` (then they end UNAVAILABLE); the engine broadcasts shutdown to the other ranks; the server
  stops; :func:`serve` returns (the process exits 0).
- engine failure (an exception in a step — a killed or crashed rank — or a step, heartbeat or shutdown stuck
  past ``step_timeout_s``): health NOT_SERVING, every open stream ends UNAVAILABLE, then after
  ``fatal_grace_s`` rank 0 SIGKILLs the other ranks on this host and ``os._exit(1)``. No thread is joined and no
  collective is attempted on the way out, so a hung peer cannot keep the process alive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2_grpc as pbg

from engine.api import AsyncEngine, Engine, ReasoningParser, engine_facts
from model.tokenizer import load_tokenizer
from rpc import expert_admin, info
from rpc.expert_admin import ExpertAdmin
from rpc.hand_off import HandOffRole
from rpc.health import Health
from rpc.kv_events import KvEventHub
from rpc.metrics import MetricsServer, exporter_for
from rpc.rank_liveness import gone_ranks
from rpc.servicer import SERVICE_NAME, ModelFacts, Servicer

log = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
DEFAULT_METRICS_PORT = 9401  # not 9400: NVIDIA's dcgm-exporter listens there on GPU boxes
STOP_REQUESTED = threading.Event()  # a SIGTERM that arrived before the event loop ran


@dataclass(frozen=True)
class ServerConfig:
    """``server.*`` of conf/server/default.yaml. Capacity = ``max_num_seqs`` running per attention-DP rank (the
    scheduler's limit) × attn_dp + ``max_queue`` waiting; one request more gets RESOURCE_EXHAUSTED."""

    host: str = "127.0.0.1"
    port: int = 50051
    max_num_seqs: int = 64
    max_queue: int = 256
    drain_timeout_s: float = 30.0
    step_timeout_s: float = 20.0
    heartbeat_s: float = 5.0
    fatal_grace_s: float = 1.0
    served_model_name: str | None = None
    metrics_port: int | None = DEFAULT_METRICS_PORT  # /metrics (Prometheus) on host; None: off
    telemetry_interval_s: float = 1.0  # each rank samples its device this often (with metrics on)
    profile_dir: str | None = None  # StartProfile writes traces under it; None: profiling off
    kv_role: str = "both"  # prefill/decode disaggregation: "prefill", "decode" or "both" (rpc/hand_off.py)
    kv_connector: str = "SwitchyardConnector"  # the connector name GetServerInfo reports to smg
    kv_lease_s: float = 30.0  # a prefill's KV waits this long for its decode worker to read it
    kv_transfer_protocol: str = "tcp"  # the Mooncake transfer engine's protocol ("rdma" where the cluster has it)
    kv_recompute_on_failure: bool = False  # a hand-off that cannot be read: recompute (True) or fail UNAVAILABLE
    kv_transfer_timeout_s: float = 30.0  # a decode worker's read of a hand-off fails when not done by then
    reasoning_parser: str | None = None  # "kimi": constraints wait for the thought's close (engine/reasoning.py)
    max_thinking_tokens: int = 128  # a constrained answer's thought is closed after this many tokens

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"server.{name} must be in [0, 65535], got {value}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"server.metrics_port={self.metrics_port} is server.port's too; give /metrics another "
                             "port (or null: off)")
        for name in ("max_num_seqs", "drain_timeout_s", "step_timeout_s", "heartbeat_s", "telemetry_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"server.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_queue", "fatal_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"server.{name} must be >= 0, got {getattr(self, name)}")


def reasoning_parser(cfg: ServerConfig, model_dir: str) -> ReasoningParser | None:
    """``server.reasoning_parser`` on the checkpoint's tokenizer (None: off); raises ValueError naming the setting
    when the checkpoint lacks its markers (``scripts/serve.py`` checks it before the ranks start)."""
    if cfg.reasoning_parser is None:
        return None
    return ReasoningParser.for_checkpoint(cfg.reasoning_parser, load_tokenizer(model_dir), cfg.max_thinking_tokens)


def request_stop_on_signals() -> None:
    """Until :func:`serve` runs its loop, SIGTERM/SIGINT only record that a stop was asked for."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: STOP_REQUESTED.set())


def serve(engine: Engine, model_dir: str, cfg: ServerConfig, ranks: list[dict]) -> None:
    """Serves ``engine`` until SIGTERM/SIGINT, then drains and returns. ``ranks``: ``{"rank", "pid", "host"}`` of
    every rank (rank 0 kills the local ones on the fatal path). Never returns after an engine failure."""
    asyncio.run(_serve(engine, model_dir, cfg, ranks))


def _fatal_exit(loop: asyncio.AbstractEventLoop, health: Health, grace_s: float, workers: list[int]):
    def die(reason: str) -> None:  # any thread
        log.error("engine failure: %s — failing open streams, health NOT_SERVING, exiting 1", reason)
        started = time.monotonic()
        coro = health.not_serving()
        try:
            flipped = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop is closed: nothing serves health any more
            coro.close()
        else:
            try:
                flipped.result(timeout=grace_s)
            except Exception:  # noqa: BLE001 - the loop is stuck: exit all the same
                log.error("health could not be set NOT_SERVING within %ss", grace_s)
        time.sleep(max(grace_s - (time.monotonic() - started), 0))  # let the loop send the UNAVAILABLE statuses
        log.error("exiting 1: %s", reason)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    return die


async def _serve(engine: Engine, model_dir: str, cfg: ServerConfig, ranks: list[dict]) -> None:
    loop = asyncio.get_running_loop()
    health = Health((SERVICE_NAME, info.SERVICE_NAME))
    host = socket.gethostname()
    workers = [r["pid"] for r in ranks if r["rank"] != 0 and r["host"] == host]
    ef = engine_facts(engine)
    capacity = ef.max_num_seqs * ef.dp_size + cfg.max_queue
    kv_events = KvEventHub(ef.kv_block_size, lambda: aengine.loads, max_running=ef.max_num_seqs)
    aengine = AsyncEngine(engine, capacity, cfg.step_timeout_s, cfg.heartbeat_s,
                          on_fatal=_fatal_exit(loop, health, cfg.fatal_grace_s, workers),
                          on_kv_events=kv_events.publish, diagnose=lambda: gone_ranks(ranks, host))
    facts = ModelFacts.read(model_dir, cfg.served_model_name, ef)
    hand_off = HandOffRole(cfg.kv_role, cfg.kv_connector, cfg.kv_lease_s, cfg.kv_transfer_protocol,
                           f"{cfg.host}:{cfg.port}", ef.kv_fingerprint, ef.layout, cfg.kv_recompute_on_failure,
                           cfg.kv_transfer_timeout_s)
    servicer = Servicer(aengine, facts, ranks, dict(asdict(cfg), capacity=capacity), kv_events, cfg.profile_dir,
                        hand_off, reasoning_parser(cfg, model_dir))

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pbg.add_VllmEngineServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((servicer.engine_info_handler(), ExpertAdmin(aengine).handler()))
    health.add_to_server(server)
    reflection.enable_server_reflection((SERVICE_NAME, info.SERVICE_NAME, expert_admin.SERVICE_NAME, HEALTH_SERVICE,
                                         reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    except RuntimeError:
        port = 0
    if not port:
        await aengine.stop()  # release the other ranks now rather than after the launcher's 30 s grace
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port} (server.host/server.port)")
    metrics = None
    if cfg.metrics_port is not None:
        exporter = exporter_for(ef, facts.served_model_name)
        try:
            metrics = MetricsServer(exporter, cfg.host, cfg.metrics_port)
        except RuntimeError:
            await aengine.stop()
            raise
        aengine.subscribe(exporter.observe)
        exporter.follow(lambda: aengine.loads)
        log.info("metrics: Prometheus text format on http://%s:%d/metrics (server.metrics_port; null turns it off)",
                 cfg.host, metrics.port)
    await health.starting()
    await server.start()
    aengine.start(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if STOP_REQUESTED.is_set():
        stop.set()
    await health.serving()
    log.info("serving %r on %s:%d — %s, capacity %d; grpc health SERVING", facts.served_model_name, cfg.host, port,
             ef.layout, capacity)

    await stop.wait()
    log.info("stop requested: draining %d in-flight request(s) for up to %ss", servicer.inflight,
             cfg.drain_timeout_s)
    servicer.draining = True
    aengine.set_draining()  # the engine counts the rest as draining (an idle reason)
    await health.not_serving()
    try:
        await asyncio.wait_for(servicer.idle.wait(), cfg.drain_timeout_s)
    except asyncio.TimeoutError:
        log.warning("drain timeout: ending %d stream(s) UNAVAILABLE", servicer.inflight)
        aengine.fail_streams(f"server shut down: server.drain_timeout_s={cfg.drain_timeout_s} passed first")
        try:
            await asyncio.wait_for(servicer.idle.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
    await aengine.stop()
    await server.stop(grace=1.0)
    if metrics is not None:
        metrics.close()
    log.info("drained and stopped")
