"""``switchyard.v1.ExpertBalance``: the expert load balancer's operator door beside ``VllmEngine`` (what SGLang
serves as HTTP endpoints): ``GetExpertLoad`` dumps the load and placement, ``Rebalance`` asks for a rebalance at the
next step boundary and dumps the same. Both answer one JSON document (``engine.snapshot.expert_balance``; its
``load`` seeds ``eplb.placement_file``); a worker that does not count (or, for ``Rebalance``, does not balance)
answers FAILED_PRECONDITION naming the setting. The messages are built from a descriptor at import time, registered
in the default pool, so server reflection describes them::

    grpcurl -plaintext 127.0.0.1:50051 switchyard.v1.ExpertBalance/GetExpertLoad
    python scripts/expert_balance.py --address 127.0.0.1:50051 rebalance
"""

from __future__ import annotations

import json
import logging

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from engine.api import AsyncEngine, RequestError
from rpc.info import PACKAGE

log = logging.getLogger(__name__)

SERVICE_NAME = f"{PACKAGE}.ExpertBalance"
METHODS = ("GetExpertLoad", "Rebalance")


def _register():
    pool = descriptor_pool.Default()
    name = "switchyard/v1/expert_balance.proto"
    try:
        pool.FindFileByName(name)
    except KeyError:
        field = descriptor_pb2.FieldDescriptorProto
        fdp = descriptor_pb2.FileDescriptorProto(name=name, package=PACKAGE, syntax="proto3")
        fdp.message_type.add(name="ExpertBalanceRequest")
        resp = fdp.message_type.add(name="ExpertBalanceResponse")
        resp.field.add(name="json", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
        svc = fdp.service.add(name="ExpertBalance")
        for method in METHODS:
            svc.method.add(name=method, input_type=f".{PACKAGE}.ExpertBalanceRequest",
                           output_type=f".{PACKAGE}.ExpertBalanceResponse")
        pool.AddSerializedFile(fdp.SerializeToString())
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{m}"))
                 for m in ("ExpertBalanceRequest", "ExpertBalanceResponse"))


ExpertBalanceRequest, ExpertBalanceResponse = _register()


class ExpertAdmin:
    """The ``ExpertBalance`` service over ``engine``."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def _answer(self, method: str, rebalance: bool, context) -> ExpertBalanceResponse:
        try:
            doc = await self.engine.balance_experts(rebalance)
        except RequestError as err:
            log.info("%s: FAILED_PRECONDITION (%s)", method, err)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        log.info("%s: OK (placement versions %s)", method, doc["versions"])
        return ExpertBalanceResponse(json=json.dumps(doc))

    async def GetExpertLoad(self, request, context) -> ExpertBalanceResponse:  # noqa: N802 - the RPC's name
        return await self._answer("GetExpertLoad", False, context)

    async def Rebalance(self, request, context) -> ExpertBalanceResponse:  # noqa: N802 - the RPC's name
        return await self._answer("Rebalance", True, context)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            m: grpc.unary_unary_rpc_method_handler(
                getattr(self, m), request_deserializer=ExpertBalanceRequest.FromString,
                response_serializer=ExpertBalanceResponse.SerializeToString)
            for m in METHODS})
