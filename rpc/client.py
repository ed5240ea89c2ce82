"""A small synchronous client for the server (thread-safe; one channel).

    c = Client("127.0.0.1:50051"); c.wait_ready()
    c.generate([5, 17, 3], max_tokens=8, temperature=0).token_ids      # one Complete
    s = c.stream([5, 17, 3], max_tokens=8)                              # delta token ids per chunk
    for delta in s: ...
    s.result.finish_reason, c.loads()["kv_usage"], c.server_info()["engine"]["layout"]

Errors are ``grpc.RpcError`` with the server's status code and message.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pbg
from smg_grpc_proto.generated import common_pb2

from rpc import expert_admin, info
from rpc.convert import uint32_of_int32


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    matched_stop: int | str | None = None  # finish_reason "stop": the stop string, or the token id that matched
    cached_tokens: int = 0  # prompt tokens the worker took from its prefix cache


def matched_stop(complete: pb.GenerateComplete) -> int | str | None:
    which = complete.WhichOneof("matched_stop")
    return getattr(complete, which) if which else None


def sampling_params(**kw) -> pb.SamplingParams:
    """``pb.SamplingParams`` from keyword arguments (engine names; ``top_k=-1`` is sent as uint32 2**32-1)."""
    if "top_k" in kw:
        kw["top_k"] = uint32_of_int32(kw["top_k"])
    if kw.get("seed") is not None and not -2**31 <= kw["seed"] < 2**31:
        raise ValueError(f"seed={kw['seed']}: the SMG protocol carries seed as int32 (-2**31 <= seed < 2**31)")
    return pb.SamplingParams(**{k: v for k, v in kw.items() if v is not None})


def generate_request(prompt: list[int], stream: bool, request_id: str | None = None, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id or f"py-{uuid.uuid4().hex}", stream=stream,
                              tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=sampling_params(**sampling))


class Stream:
    """Iterates the delta token ids of a streaming Generate; ``result`` is filled by the final Complete."""

    def __init__(self, call, request_id: str):
        self.call, self.request_id = call, request_id
        self.result = Result()

    def __iter__(self) -> Iterator[list[int]]:
        for resp in self.call:
            if resp.HasField("chunk"):
                delta = list(resp.chunk.token_ids)
                self.result.token_ids += delta
                self.result.logprobs += list(resp.chunk.output_logprobs.token_logprobs)
                yield delta
            else:
                c = resp.complete
                self.result.finish_reason, self.result.matched_stop = c.finish_reason, matched_stop(c)
                self.result.cached_tokens = c.cached_tokens
                self.result.prompt_tokens, self.result.completion_tokens = c.prompt_tokens, c.completion_tokens

    def cancel(self) -> None:
        self.call.cancel()


class Client:
    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
        self.stub = pbg.VllmEngineStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._expert_balance = {m: self.channel.unary_unary(
            f"/{expert_admin.SERVICE_NAME}/{m}", request_serializer=expert_admin.ExpertBalanceRequest.SerializeToString,
            response_deserializer=expert_admin.ExpertBalanceResponse.FromString) for m in expert_admin.METHODS}
        self._engine_info = self.channel.unary_unary(
            info.METHOD, request_serializer=info.GetEngineInfoRequest.SerializeToString,
            response_deserializer=info.GetEngineInfoResponse.FromString)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- health ----------------------------------------------------------------------------------
    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """grpc.health.v1 status name (``SERVING``, ``NOT_SERVING``, ...)."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 120.0, poll_s: float = 0.2) -> None:
        """Blocks until grpc health says SERVING; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=2.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout}s")
            time.sleep(poll_s)

    def health_check(self, timeout: float = 5.0) -> tuple[bool, str]:
        """The VllmEngine HealthCheck: (healthy, message)."""
        resp = self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout)
        return resp.healthy, resp.message

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompt: list[int], request_id: str | None = None, timeout: float | None = None,
                 **sampling) -> Result:
        """Non-streaming Generate: one Complete with every output id."""
        req = generate_request(prompt, False, request_id, **sampling)
        result = Result()
        for resp in self.stub.Generate(req, timeout=timeout):
            if resp.HasField("complete"):
                c = resp.complete
                result = Result(list(c.output_ids), c.finish_reason, c.prompt_tokens, c.completion_tokens,
                                list(c.output_logprobs.token_logprobs), matched_stop(c), c.cached_tokens)
        return result

    def stream(self, prompt: list[int], request_id: str | None = None, timeout: float | None = None,
               retain_kv: bool = False, **sampling) -> Stream:
        """Streaming Generate; ``retain_kv``: ask the worker to keep this request's KV past plain LRU."""
        req = generate_request(prompt, True, request_id, **sampling)
        if retain_kv:
            req.kv_transfer_params_json = '{"retain_kv": true}'
        return Stream(self.stub.Generate(req, timeout=timeout), req.request_id)

    def abort(self, *request_ids: str, timeout: float = 10.0) -> None:
        self.stub.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=timeout)

    # ---- profiling -------------------------------------------------------------------------------
    def start_profile(self, timeout: float = 60.0, **fields) -> tuple[bool, str]:
        """StartProfile (``output_dir``, ``start_step``, ``num_steps``, ``activities``, ...): (success, message)."""
        resp = self.stub.StartProfile(common_pb2.StartProfileRequest(**fields), timeout=timeout)
        return resp.success, resp.message

    def stop_profile(self, timeout: float = 120.0) -> tuple[bool, str]:
        """StopProfile: (success, message naming the trace files)."""
        resp = self.stub.StopProfile(common_pb2.StopProfileRequest(), timeout=timeout)
        return resp.success, resp.message

    # ---- facts -----------------------------------------------------------------------------------
    def model_info(self, timeout: float = 10.0) -> dict:
        return MessageToDict(self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout),
                             preserving_proto_field_name=True)

    def engine_info(self, timeout: float = 30.0) -> dict:
        return json.loads(self._engine_info(info.GetEngineInfoRequest(), timeout=timeout).json)

    def expert_balance(self, rebalance: bool = False, timeout: float = 30.0) -> dict:
        """``switchyard.v1.ExpertBalance``: the expert load and placement (``rpc/expert_admin.py``); ``rebalance``
        asks for a rebalance at the next step boundary."""
        call = self._expert_balance["Rebalance" if rebalance else "GetExpertLoad"]
        return json.loads(call(expert_admin.ExpertBalanceRequest(), timeout=timeout).json)

    def server_info(self, timeout: float = 30.0) -> dict:
        """GetServerInfo's fields plus ``engine``: the switchyard.v1.EngineInfo document."""
        doc = MessageToDict(self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout),
                            preserving_proto_field_name=True)
        doc["engine"] = self.engine_info(timeout)
        return doc

    def loads(self, timeout: float = 10.0) -> dict:
        """Every attention-DP rank's SchedulerLoad summed (requests, tokens, running slots, generated tokens per
        second; ``kv_usage`` = used / total tokens), with the records themselves under ``per_rank``."""
        resp = self.stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=timeout)
        ranks = [MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                 for r in resp.loads]
        load = dict(ranks[0])
        load.update({k: sum(r[k] for r in ranks) for k in ("num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                                                          "num_used_tokens", "max_total_num_tokens",
                                                          "max_running_requests", "num_waiting_uncached_tokens",
                                                          "gen_throughput")})
        load.update(kv_usage=load["num_used_tokens"] / max(load["max_total_num_tokens"], 1), per_rank=ranks,
                    cache_hit_rate=sum(r["cache_hit_rate"] for r in ranks) / len(ranks))
        load["token_usage"] = load["kv_usage"]
        return load

    def flush_cache(self, timeout_s: float = 0.0, timeout: float = 30.0) -> tuple[bool, str]:
        """FlushCache: (success, message)."""
        resp = self.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=timeout_s), timeout=timeout)
        return resp.success, resp.message

    def tokenizer_files(self, timeout: float = 30.0) -> dict[str, bytes]:
        """GetTokenizer: the ZIP's files by name, after checking the sha256 on the last chunk."""
        chunks = list(self.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout))
        data = b"".join(c.data for c in chunks)
        if not chunks or chunks[-1].sha256 != hashlib.sha256(data).hexdigest():
            raise ValueError("GetTokenizer: sha256 on the last chunk does not match the data")
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            return {name: zf.read(name) for name in zf.namelist()}
