"""A worker's face in prefill/decode disaggregation behind smg (``server.kv_role``; ``docs/disaggregation.md``).

- ``GetServerInfo`` reports ``kv_connector`` (``server.kv_connector``, a name smg does not know, so it relays the
  prefill's ``kv_transfer_params_json`` to the decode leg byte for byte), ``kv_role`` (``kv_producer``,
  ``kv_consumer``, ``kv_both``) and ``kv_engine_id`` (the KV fingerprint: workers whose KV fits each other share it).
- A prefill worker (``prefill``) leases every request's prompt KV when it finishes (``server.kv_lease_s``) and answers
  with ``GenerateComplete.kv_transfer_params_json``: the lease, where each rank's blocks are, their digests, the
  fingerprint, and where to release the lease (its own gRPC address: an ``Abort`` naming the lease key).
- A decode worker (``decode`` or ``both``) given such JSON loads the KV from the prefill's ranks (a ``PeerKV`` source)
  and computes only the prompt's last token; once the request's first output shows the KV arrived, it releases the
  lease. KV whose fingerprint (the KV's shape: model, drafter, dtype, block size, and attention-TP size unless every
  byte is replicated over TP ranks, as with MLA) differs from its own is refused (INVALID_ARGUMENT naming both
  layouts); KV of another numerics mode or attention layout is taken and kept out of its own prefix cache. A read that
  fails, or is not done within ``server.kv_transfer_timeout_s``, ends the request UNAVAILABLE naming the cause (smg
  retries it, re-running the prefill), or, with ``server.kv_recompute_on_failure``, the request computes the prompt
  itself (counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pbg

from engine.api import PeerKV, PeerLease, PeerShard, RequestOutput

log = logging.getLogger(__name__)

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
CONNECTORS_SMG_REWRITES = ("NixlConnector", "MooncakeConnector")  # smg builds its own JSON for these
RELEASE_TIMEOUT_S = 5.0


class HandOffError(ValueError):
    """A hand-off JSON this worker cannot use (INVALID_ARGUMENT, naming why)."""


@dataclass(frozen=True)
class HandOffRole:
    """``server.kv_role`` and what goes with it; ``address``: this server's gRPC ``host:port``; ``fingerprint`` and
    ``layout``: this engine's (``EngineFacts.kv_fingerprint``, ``EngineFacts.layout``)."""

    role: str
    connector: str
    lease_s: float
    protocol: str
    address: str
    fingerprint: str
    layout: str
    recompute_on_failure: bool = False
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"server.kv_role must be one of {sorted(ROLES)}, got {self.role!r}")
        if self.connector in CONNECTORS_SMG_REWRITES:
            raise ValueError(f"server.kv_connector={self.connector!r}: smg writes its own transfer parameters for "
                             "that connector and would replace this worker's; use another name (the default, "
                             "SwitchyardConnector)")
        for name in ("lease_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"server.kv_{name} must be > 0, got {getattr(self, name)}")

    def server_info(self) -> dict:
        """The ``GetServerInfoResponse`` fields smg pairs workers by (none for ``both``: a plain worker, which still
        takes a hand-off it is given)."""
        if self.role == "both":
            return {}
        return dict(kv_connector=self.connector, kv_role=ROLES[self.role], kv_engine_id=self.fingerprint)

    def kv_missing(self, blob: dict | None) -> bool:
        """A decode leg that came without a hand-off (smg relays none for ``n > 1``): its prompt is recomputed."""
        return self.role == "decode" and blob is None

    def lease(self) -> PeerLease | None:
        """What a request on this worker is leased under (a prefill worker's), or None."""
        host = self.address.rsplit(":", 1)[0]
        return PeerLease(self.lease_s, host, self.protocol) if self.role == "prefill" else None

    def source(self, blob: dict) -> PeerKV:
        """The KV source a decode leg's hand-off JSON names; raises :class:`HandOffError`."""
        if self.role == "prefill":
            raise HandOffError("kv_transfer_params_json: this worker prefills (server.kv_role=prefill); a hand-off "
                               "goes to a decode worker")
        if blob.get("fingerprint") != self.fingerprint:
            raise HandOffError(f"kv_transfer_params_json: KV made under layout {blob.get('layout')!r} (fingerprint "
                               f"{blob.get('fingerprint')}) does not fit this worker's layout {self.layout!r} "
                               f"(fingerprint {self.fingerprint}): pair workers of the same model, drafter, KV dtype, "
                               "block size and (for KV split over attention-TP ranks, as GQA's is) attention-TP size")
        try:
            shards = tuple(PeerShard(s["session"], tuple(tuple(t) for t in s["tensors"]), tuple(s["blocks"]),
                                     tuple(s["digests"])) for s in blob["shards"])
            return PeerKV(int(blob["num_tokens"]), shards, self.address.rsplit(":", 1)[0], str(blob["protocol"]),
                          self.recompute_on_failure, str(blob.get("namespace", "")), self.transfer_timeout_s)
        except (KeyError, TypeError, ValueError) as e:
            raise HandOffError(f"kv_transfer_params_json: a malformed hand-off ({e!r})") from None

    def params_json(self, out: RequestOutput) -> str | None:
        """A finished prefill's ``kv_transfer_params_json``: the engine's hand-off and where to release it."""
        if out.kv_transfer_params is None:
            return None
        return json.dumps(dict(out.kv_transfer_params, release_to=self.address), separators=(",", ":"))


async def release(blob: dict) -> None:
    """Tells the prefill worker that leased ``blob``'s KV that it may reuse the blocks (``Abort`` naming the lease
    key); a worker that is gone or slow is left to its lease's expiry."""
    try:
        async with grpc.aio.insecure_channel(blob["release_to"]) as channel:
            await pbg.VllmEngineStub(channel).Abort(pb.AbortRequest(request_ids=[blob["lease"]]),
                                                   timeout=RELEASE_TIMEOUT_S)
    except (grpc.RpcError, KeyError, asyncio.TimeoutError) as e:
        log.warning("releasing lease %s at %s failed (%s); it expires on its own", blob.get("lease"),
                    blob.get("release_to"), e)
