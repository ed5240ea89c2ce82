"""The ``VllmEngine`` RPCs this engine does not serve: one log line each, never a traceback.

The generated base servicer raises ``NotImplementedError``, which grpc.aio logs with a full traceback on every
call; these answer ``UNIMPLEMENTED`` with the reason instead.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger("rpc.requests")


async def _unimplemented(context: grpc.aio.ServicerContext, rpc: str, why: str) -> None:
    log.info("%s: UNIMPLEMENTED (%s)", rpc, why)
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc} is not supported by switchyard: {why}")


class UnsupportedRPCs:
    """Mixed into the servicer ahead of the generated base class."""

    async def Embed(self, request, context):
        await _unimplemented(context, "Embed", "generation models only")
