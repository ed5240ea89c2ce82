"""A recording worker for what smg sends: a gRPC proxy on 127.0.0.1 that forwards every call to a real worker as
bytes — the ``VllmEngine`` service, health, reflection, anything — and keeps each ``GenerateRequest`` it forwarded,
so a test sees exactly what arrived at the worker while the client still gets the real worker's answer
(:attr:`RecordingWorker.on_generate` runs before each ``Generate`` is forwarded: a test's moment to act).

With :attr:`RecordingWorker.script` set, ``Generate`` is answered with those tokens instead (streamed one per chunk
when the request streams, else in the final message), the way the real worker answers: what smg's parsers make of a
given token sequence (``scripts/record_kimi_tool_parser.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["VllmEngine"]
STREAMING = {f"/{SERVICE.full_name}/{m.name}" for m in SERVICE.methods if m.server_streaming} | {
    "/grpc.health.v1.Health/Watch"}
GENERATE = f"/{SERVICE.full_name}/Generate"


class RecordingWorker(grpc.GenericRpcHandler):
    """Listens on :attr:`target`; :attr:`requests` holds every ``GenerateRequest`` forwarded, in order."""

    def __init__(self, worker_target: str):
        self.requests: list[pb.GenerateRequest] = []
        self.script: tuple[list[int], str] | None = None  # (tokens, finish reason) Generate answers with
        self.on_generate: Callable[[pb.GenerateRequest], None] | None = None  # called before one is forwarded
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(worker_target)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((self,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def last(self) -> pb.GenerateRequest:
        """The GenerateRequest forwarded last (callers send one request at a time)."""
        with self._lock:
            if not self.requests:
                raise AssertionError("no GenerateRequest reached the worker")
            return self.requests[-1]

    def service(self, details: grpc.HandlerCallDetails):
        path = details.method
        if path == GENERATE and self.script is not None:
            return grpc.unary_stream_rpc_method_handler(self._scripted)
        if path in STREAMING:
            call = self._channel.unary_stream(path)

            def stream(request: bytes, context: grpc.ServicerContext):
                self._record(path, request)
                try:
                    yield from call(request, metadata=_forwardable(context))
                except grpc.RpcError as err:
                    context.abort(err.code(), err.details())

            return grpc.unary_stream_rpc_method_handler(stream)
        call = self._channel.unary_unary(path)

        def unary(request: bytes, context: grpc.ServicerContext):
            self._record(path, request)
            try:
                return call(request, metadata=_forwardable(context))
            except grpc.RpcError as err:
                context.abort(err.code(), err.details())

        return grpc.unary_unary_rpc_method_handler(unary)

    def _scripted(self, request: bytes, context: grpc.ServicerContext):
        self._record(GENERATE, request)
        req = pb.GenerateRequest.FromString(request)
        tokens, reason = self.script
        prompt = len(req.tokenized.input_ids)
        if req.stream:
            for t in tokens:
                yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                    token_ids=[t], prompt_tokens=prompt, completion_tokens=1)).SerializeToString()
        done = pb.GenerateComplete(output_ids=[] if req.stream else tokens, finish_reason=reason,
                                   prompt_tokens=prompt, completion_tokens=len(tokens))
        if reason == "stop" and tokens:
            done.matched_token_id = tokens[-1]
        yield pb.GenerateResponse(complete=done).SerializeToString()

    def _record(self, path: str, request: bytes) -> None:
        if path == GENERATE:
            req = pb.GenerateRequest.FromString(request)
            with self._lock:
                self.requests.append(req)
            if self.on_generate is not None:
                self.on_generate(req)


def _forwardable(context: grpc.ServicerContext) -> list[tuple[str, str]]:
    """The caller's metadata a client may set again (not the transport's pseudo-headers)."""
    return [(k, v) for k, v in context.invocation_metadata() if not k.startswith(":") and k not in ("user-agent",)
            and not k.startswith("grpc-")]
