"""``switchyard.v1.EngineInfo``: the engine facts the SMG protocol has no field for, as one JSON document.

``GetEngineInfo`` returns layout, dispatcher, ranks, comm stats, step stats, CUDA-graph coverage and
spec-decode acceptance (see :func:`rpc.servicer.engine_info`). The messages are built from a descriptor at
import time (no generated code), registered in the default descriptor pool, so server reflection describes
them and ``grpcurl -plaintext HOST:PORT switchyard.v1.EngineInfo/GetEngineInfo`` works.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "switchyard.v1"
SERVICE_NAME = f"{PACKAGE}.EngineInfo"
METHOD = f"/{SERVICE_NAME}/GetEngineInfo"


def _register():
    pool = descriptor_pool.Default()
    name = "switchyard/v1/engine_info.proto"
    try:
        pool.FindFileByName(name)
    except KeyError:
        field = descriptor_pb2.FieldDescriptorProto
        fdp = descriptor_pb2.FileDescriptorProto(name=name, package=PACKAGE, syntax="proto3")
        fdp.message_type.add(name="GetEngineInfoRequest")
        resp = fdp.message_type.add(name="GetEngineInfoResponse")
        resp.field.add(name="json", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
        svc = fdp.service.add(name="EngineInfo")
        svc.method.add(name="GetEngineInfo", input_type=f".{PACKAGE}.GetEngineInfoRequest",
                       output_type=f".{PACKAGE}.GetEngineInfoResponse")
        pool.AddSerializedFile(fdp.SerializeToString())
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{m}"))
                 for m in ("GetEngineInfoRequest", "GetEngineInfoResponse"))


GetEngineInfoRequest, GetEngineInfoResponse = _register()
