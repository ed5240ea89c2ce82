"""The ``vllm.grpc.engine.VllmEngine`` servicer (the SMG worker protocol) and ``switchyard.v1.EngineInfo``.

Status codes: bad input → INVALID_ARGUMENT naming the field; over capacity → RESOURCE_EXHAUSTED; draining or a
dead engine → UNAVAILABLE; no tokenizer (``tokenizer.json``, ``tiktoken.model`` or ``*.tiktoken``) in the checkpoint →
FAILED_PRECONDITION (GetTokenizer).

Abort: an id this server has seen (running, finished, cancelled or rejected) answers OK — the SMG gateway
sends Abort after it cancels a stream, when the request may already be gone; an id never seen answers
INVALID_ARGUMENT naming it (the known ones in the same call are still aborted).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import math
import time
import uuid
import zipfile
from collections import OrderedDict
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pbg
from smg_grpc_proto.generated import common_pb2

from engine.api import (
    AsyncEngine,
    Constraint,
    EngineDead,
    EngineFacts,
    EngineFailure,
    Loads,
    Overloaded,
    PeerKV,
    PeerLease,
    ReasoningParser,
    RequestOutput,
)
from model.tokenizer import tiktoken_file
from rpc import convert, info
from rpc.convert import InvalidRequest
from rpc.hand_off import HandOffRole, release
from rpc.kv_events import KvEventHub
from rpc.profiling import ProfileRPCs
from rpc.request_log import RequestLog
from rpc.unsupported import UnsupportedRPCs

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "generation_config.json", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "tiktoken.model")
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja")  # smg takes at most 50 files
CHUNK_BYTES = 64 * 1024
SEEN_IDS = 100_000


@dataclass(frozen=True)
class ModelFacts:
    """What GetModelInfo / GetServerInfo report; fixed at start-up."""

    model_dir: str
    served_model_name: str
    vocab_size: int
    max_model_len: int
    model_type: str
    architectures: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    pad_token_id: int
    dtype: str
    attention: str
    kv_block_size: int  # tokens per KV-cache block (engine.block_size)
    max_num_seqs: int  # running slots over all attention-DP ranks
    dp_size: int  # attention-DP ranks

    @staticmethod
    def read(model_dir: str, served_model_name: str | None, engine: EngineFacts) -> ModelFacts:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        pad = raw.get("pad_token_id")
        return ModelFacts(
            model_dir=str(Path(model_dir).resolve()),
            served_model_name=served_model_name or Path(model_dir).resolve().name,
            vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
            model_type=raw.get("model_type", engine.model_type), architectures=tuple(raw.get("architectures") or ()),
            eos_token_ids=engine.eos_token_ids, bos_token_id=int(raw.get("bos_token_id") or 0),
            pad_token_id=int(pad if pad is not None else 0), dtype=engine.dtype, attention=engine.attention,
            kv_block_size=engine.kv_block_size, max_num_seqs=engine.max_num_seqs * engine.dp_size,
            dp_size=engine.dp_size)


def _snapshot(loads: Loads, dp: int, max_running: int) -> pb.SchedulerLoad:
    """DP rank ``dp``'s GetLoads record: cached unreferenced blocks count as free (vLLM's rule); throughput and
    prefix-cache hit rate are this rank's; ``utilization`` is SGLang's: the larger of the running share of
    ``max_running`` and the KV usage over 0.9."""
    r = loads.per_dp[dp]
    usage = r.blocks_used / r.blocks_total
    return pb.SchedulerLoad(
        dp_rank=dp, num_running_reqs=r.running, num_waiting_reqs=r.waiting, num_total_reqs=r.running + r.waiting,
        num_used_tokens=r.blocks_used * loads.kv_block_size, max_total_num_tokens=r.blocks_total * loads.kv_block_size,
        token_usage=usage, gen_throughput=loads.gen_tokens_per_s[dp], cache_hit_rate=r.cache_hit_rate,
        utilization=max(r.running / max_running, usage / 0.9), max_running_requests=max_running,
        num_waiting_uncached_tokens=r.waiting_uncached_tokens)


class Servicer(UnsupportedRPCs, ProfileRPCs, pbg.VllmEngineServicer):
    def __init__(self, engine: AsyncEngine, facts: ModelFacts, ranks: list[dict], server_facts: dict,
                 kv_events: KvEventHub, profile_dir: str | None = None, hand_off: HandOffRole | None = None,
                 reasoning: ReasoningParser | None = None):
        """``profile_dir``: where StartProfile may write traces (``server.profile_dir``; None: profiling off);
        ``hand_off``: the worker's prefill/decode role (None: ``both`` without a connector, as in tests);
        ``reasoning``: the reasoning parser constraints wait for (``server.reasoning_parser``; None: off)."""
        self.engine, self.facts, self.ranks, self.server_facts = engine, facts, ranks, server_facts
        self.kv_events, self.profile_dir, self.hand_off = kv_events, profile_dir, hand_off
        self.reasoning = reasoning
        self.limits = convert.Limits(facts.vocab_size, facts.max_model_len)
        self.draining = False
        self.started = time.time()
        self.last_receive = 0.0
        self.inflight = 0  # Generate calls between admission and their end
        self.idle = asyncio.Event()
        self.idle.set()
        self._seen: OrderedDict[str, None] = OrderedDict()

    # ---- state -----------------------------------------------------------------------------------
    @property
    def unavailable(self) -> str | None:
        if self.engine.dead:
            return f"engine is dead: {self.engine.dead}"
        return "server is draining (SIGTERM); not accepting new requests" if self.draining else None

    def _remember(self, request_id: str) -> None:
        self._seen[request_id] = None
        self._seen.move_to_end(request_id)
        while len(self._seen) > SEEN_IDS:
            self._seen.popitem(last=False)

    # ---- Generate --------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or f"sy-{uuid.uuid4().hex}"
        self.last_receive = time.time()
        self._remember(rid)
        req = RequestLog(rid)
        if self.unavailable:
            req.reject("UNAVAILABLE", self.unavailable)
            req.end()
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable)
        self.inflight += 1  # counted from here, so a drain that starts now waits for this request too
        self.idle.clear()
        stream = None
        try:
            try:
                req.prompt_tokens = len(request.tokenized.input_ids)
                prompt, params = convert.generate_request(request, self.limits)
                if self.reasoning is not None:
                    params = self.reasoning.gate(prompt, params, request.sampling_params.grammar_from_first_token)
                dp_rank, retain_kv, blob = convert.kv_hints(request)
                kv, lease = self._hand_off(blob)
                missing = self.hand_off is not None and self.hand_off.kv_missing(blob)
                await self._compile(params.constraint)
                stream = await self.engine.submit(rid, prompt, params, dp_rank, retain_kv, kv, lease, missing)
            except ValueError as err:  # InvalidRequest, SamplingError, RequestError
                req.reject("INVALID_ARGUMENT", str(err))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            except Overloaded as err:
                req.reject("RESOURCE_EXHAUSTED", str(err))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            except EngineDead as err:
                req.reject("UNAVAILABLE", f"engine is dead: {err}")
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine is dead: {err}")
            async for message in self._responses(request, stream, context, req, blob):
                yield message
        finally:  # normal end, client cancel, deadline, engine failure
            req.end()
            if stream is not None:
                self.engine.close(stream)
            self.inflight -= 1
            if not self.inflight:
                self.idle.set()

    def _hand_off(self, blob: dict | None) -> tuple[PeerKV | None, PeerLease | None]:
        """A decode leg's KV source (from the prefill's JSON), or a prefill leg's lease (on a prefill worker)."""
        if self.hand_off is None:
            if blob is not None:
                raise InvalidRequest("kv_transfer_params_json: a hand-off, but this worker has no KV connector")
            return None, None
        return (self.hand_off.source(blob) if blob is not None else None), self.hand_off.lease()

    async def _compile(self, constraint: Constraint | None) -> None:
        """Compiles a constraint off the engine thread (cached by its text, so the engine's own check finds it
        compiled), a new one announced to the other ranks first (``Engine.precompile``: they compile it on their
        grammar threads meanwhile); raises ConstraintError (INVALID_ARGUMENT) before anything is admitted."""
        if constraint is None:
            return
        log.debug("constraint %s: %s", constraint.kind, constraint.text[:4000])
        await self.engine.compile(constraint)

    async def _responses(self, request: pb.GenerateRequest, stream, context, req: RequestLog, blob: dict | None):
        """Streams the request's outputs: per sample (``index``, n > 1) its chunks and its one Complete; ends after
        the last sample's Complete. ``blob``: a decode leg's hand-off, whose lease is released at its first output
        (its KV has arrived by then)."""
        want_lp = request.sampling_params.HasField("logprobs")
        n = max(request.sampling_params.n, 1)
        tokens: dict[int, list[int]] = {i: [] for i in range(n)}
        logprobs = {i: pb.OutputLogProbs() if want_lp else None for i in range(n)}
        done: set[int] = set()
        while True:
            items = [await stream.queue.get()]
            while not stream.queue.empty():
                items.append(stream.queue.get_nowait())
            failure = next((i for i in items if isinstance(i, EngineFailure)), None)
            outs: list[RequestOutput] = [i for i in items if not isinstance(i, EngineFailure)]
            if blob is not None and outs:
                asyncio.get_running_loop().create_task(release(blob))
                blob = None
            if failure is not None:
                req.reject("UNAVAILABLE", f"lost: {failure.reason}")
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {stream.request_id} lost: "
                                                                 f"{failure.reason}")
            refused = next((o.error for o in outs if o.error is not None), None)
            if refused is not None:  # its handed-off KV could not be read; a retry re-runs the prefill
                req.reject("UNAVAILABLE", refused)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {stream.request_id}: {refused}")
            for index in sorted({o.index for o in outs}):
                mine = [o for o in outs if o.index == index]
                new = [t for o in mine for t in o.new_tokens]
                tokens[index] += new
                if logprobs[index] is not None and new:
                    top = [t for o in mine for t in o.new_top_logprobs]
                    logprobs[index].MergeFrom(convert.output_logprobs([lp for o in mine for lp in o.new_logprobs],
                                                                      new, top))
                if request.stream and new:
                    yield convert.chunk([o for o in mine if o.new_tokens], want_lp)
                if mine[-1].finished:
                    done.add(index)
                    kv_params = self.hand_off.params_json(mine[-1]) if self.hand_off is not None else None
                    yield convert.complete(mine[-1], tokens[index], request.stream, logprobs[index], kv_params)
            req.output_tokens = sum(len(t) for t in tokens.values())
            if len(done) == n:
                req.complete(outs[-1].finish_reason, req.output_tokens)
                return

    # ---- unary RPCs ------------------------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Ends requests; a request id or a lease key (``<request id>#<nonce>``, a decode worker's release) also ends
        the prefill leases it names."""
        known = [rid for rid in request.request_ids if rid in self._seen or rid.split("#")[0] in self._seen]
        unknown = [rid for rid in request.request_ids if rid not in known]
        for rid in known:
            try:
                await self.engine.abort(rid, reply=True)  # its KV is free and the gauges moved when Abort returns
            except EngineDead:
                pass
        if unknown:
            log.info("Abort: INVALID_ARGUMENT — unknown request id(s) %s", unknown[:5])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_ids: unknown request id(s) {unknown[:5]} (never seen by this server)")
        return pb.AbortResponse()

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        why = self.unavailable
        return pb.HealthCheckResponse(healthy=why is None, message=why or "ok")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        f = self.facts
        return pb.GetModelInfoResponse(
            model_path=f.model_dir, tokenizer_path=f.model_dir, served_model_name=f.served_model_name,
            is_generation=True, max_context_length=f.max_model_len, max_req_input_len=f.max_model_len - 1,
            vocab_size=f.vocab_size, supports_vision=False, model_type=f.model_type,
            architectures=list(f.architectures), eos_token_ids=list(f.eos_token_ids), pad_token_id=f.pad_token_id,
            bos_token_id=f.bos_token_id)

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        f = self.facts
        return pb.GetServerInfoResponse(
            active_requests=self.engine.num_streams, is_paused=self.draining, last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started, server_type="vllm-grpc", data_parallel_size=f.dp_size,
            kv_cache_dtype=f.dtype.removeprefix("torch."), block_size=f.kv_block_size,
            attention_backend=f"torch-paged-{f.attention}", model_dtype=f.dtype, max_num_seqs=f.max_num_seqs,
            engine_reasoning_parser=self.reasoning.name if self.reasoning is not None else "",
            constrained_decoding_start="after_reasoning" if self.reasoning is not None else "first_token",
            **(self.hand_off.server_info() if self.hand_off is not None else {}))

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        """One record per attention-DP rank (or the one ``dp_rank`` asks for)."""
        f, loads = self.facts, self.engine.loads
        ranks = [request.dp_rank] if request.HasField("dp_rank") else range(f.dp_size)
        records = [_snapshot(loads, dp, f.max_num_seqs // f.dp_size) for dp in ranks if 0 <= dp < f.dp_size]
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version="switchyard",
                                   dp_rank_count=f.dp_size, loads=records)

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        """Empties the prefix cache once the engine is idle, waiting up to ``timeout_s``; ``success=false`` with the
        reason while requests still hold KV blocks."""
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while True:
            try:
                result = await self.engine.flush_cache()
            except EngineDead as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine is dead: {err}")
            if result.flushed:
                log.info("FlushCache: OK (prefix cache emptied)")
                return common_pb2.FlushCacheResponse(success=True, message="prefix cache emptied")
            if time.monotonic() >= deadline:
                leased = f" and leases for decode workers hold {result.leased_blocks} block(s)" \
                    if result.leased_blocks else ""
                why = (f"{result.busy} request(s){leased} still hold KV blocks after {request.timeout_s:g} s; "
                       "nothing was flushed")
                log.info("FlushCache: not done (%s)", why)
                return common_pb2.FlushCacheResponse(success=False, message=why)
            await asyncio.sleep(0.05)

    async def SubscribeKvEvents(self, request, context):
        """The prefix index's changes, numbered (``rpc/kv_events.py``)."""
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def GetTokenizer(self, request, context):
        root = Path(self.facts.model_dir)
        if not (root / "tokenizer.json").exists() and tiktoken_file(root) is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"checkpoint {root} has no tokenizer.json, tiktoken.model or *.tiktoken; add one or "
                                "give smg --tokenizer-path")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in TOKENIZER_FILES:
                if (root / name).is_file():
                    zf.write(root / name, name)
            for pattern in TOKENIZER_GLOBS:
                for path in sorted(root.glob(pattern)):
                    zf.write(path, path.name)
        data = buf.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        n = math.ceil(len(data) / CHUNK_BYTES)
        for i in range(n):
            yield common_pb2.GetTokenizerChunk(data=data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES],
                                               sha256=digest if i == n - 1 else "")

    # ---- switchyard.v1.EngineInfo ----------------------------------------------------------------
    async def GetEngineInfo(self, request, context):
        try:
            doc = asdict(await self.engine.snapshot())
        except EngineDead as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine is dead: {err}")
        except Exception as err:  # noqa: BLE001 - reported to the caller; the engine is fine
            log.exception("GetEngineInfo failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"engine info failed: {type(err).__name__}: {err}")
        doc.update(ranks=self.ranks, server=dict(self.server_facts, draining=self.draining,
                                                 active_streams=self.engine.num_streams))
        return info.GetEngineInfoResponse(json=json.dumps(doc))

    def engine_info_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(info.SERVICE_NAME, {
            "GetEngineInfo": grpc.unary_unary_rpc_method_handler(
                self.GetEngineInfo, request_deserializer=info.GetEngineInfoRequest.FromString,
                response_serializer=info.GetEngineInfoResponse.SerializeToString)})
