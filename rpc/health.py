"""``grpc.health.v1`` for the server and each of its services: SERVING once the model has loaded,
NOT_SERVING (for good) from the first drain or engine failure."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio


class Health:
    def __init__(self, services: tuple[str, ...]):
        self.servicer = aio.HealthServicer()
        self.services = ("", *services)

    def add_to_server(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def starting(self) -> None:
        for name in self.services:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def serving(self) -> None:
        for name in self.services:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        await self.servicer.enter_graceful_shutdown()
