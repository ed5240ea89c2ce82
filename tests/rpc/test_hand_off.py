"""A worker's prefill/decode face (``rpc/hand_off.py``) without a server: start-up refuses a role it does not know, a
connector smg rewrites and a lease of no time; GetServerInfo's pairing fields; a decode worker refuses KV made under
another layout, naming both, and a malformed hand-off; a prefill worker refuses to decode one."""

from __future__ import annotations

import pytest

from rpc.hand_off import HandOffError, HandOffRole

FACE = dict(connector="SwitchyardConnector", lease_s=30.0, protocol="tcp", address="127.0.0.1:50051",
            fingerprint="abc", layout="attn tp1, moe tp1 (allreduce)")
BLOB = {"switchyard_hand_off": 1, "lease": "r#1", "num_tokens": 20, "fingerprint": "abc", "protocol": "tcp",
        "layout": "attn tp1, moe tp1 (allreduce)",
        "shards": [{"session": "127.0.0.1:1234", "tensors": [[4096, 64]], "blocks": [3, 4], "digests": ["x", "y"]}]}


@pytest.mark.parametrize(("change", "error"), [({"role": "mixed"}, "server.kv_role must be one of"),
                                               ({"connector": "NixlConnector"}, "smg writes its own"),
                                               ({"lease_s": 0.0}, "server.kv_lease_s must be > 0"),
                                               ({"transfer_timeout_s": -1.0},
                                                "server.kv_transfer_timeout_s must be > 0")])
def test_start_up_refuses_what_cannot_work(change, error):
    with pytest.raises(ValueError, match=error):
        HandOffRole(**{"role": "decode", **FACE, **change})


def test_pairing_fields_and_the_lease_follow_the_role():
    prefill, decode, both = (HandOffRole(role, **FACE) for role in ("prefill", "decode", "both"))
    assert prefill.server_info() == dict(kv_connector="SwitchyardConnector", kv_role="kv_producer", kv_engine_id="abc")
    assert decode.server_info()["kv_role"] == "kv_consumer" and both.server_info() == {}
    assert prefill.lease().seconds == 30.0 and prefill.lease().host == "127.0.0.1"
    assert decode.lease() is None


def test_a_decode_worker_takes_kv_of_its_own_layout_only():
    decode = HandOffRole("decode", **FACE)
    source = decode.source(BLOB)
    assert source.num_tokens == 20 and source.shards[0].blocks == (3, 4) and source.shards[0].tensors == ((4096, 64),)
    assert source.namespace == "" and decode.source(dict(BLOB, namespace="n1")).namespace == "n1"  # the engine
    # compares it with its own (KVTransfers.origin)
    other = dict(BLOB, fingerprint="def", layout="attn dp2, moe ep2 (alltoall)")
    with pytest.raises(HandOffError, match=r"'attn dp2, moe ep2 \(alltoall\)'.*'attn tp1, moe tp1 \(allreduce\)'"):
        decode.source(other)
    with pytest.raises(HandOffError, match="malformed"):
        decode.source({k: v for k, v in BLOB.items() if k != "shards"})
    with pytest.raises(HandOffError, match="this worker prefills"):
        HandOffRole("prefill", **FACE).source(BLOB)
