"""The prefix cache over gRPC, on a server with two attention-DP ranks (tiny DeepSeek-V3, DP2 × EP2):
``cached_tokens`` on every chunk and the final message, a pinned ``data_parallel_rank`` and prefix-aware placement,
``GetLoads`` per rank with the hit rate, ``FlushCache`` refused while a request runs and then done, and
``SubscribeKvEvents``: a subscriber's replayed events rebuild exactly the engine's index (a new subscriber gets it
as a snapshot), and a flush reaches it as ``KvCacheCleared``."""

import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from engine.api import index_digest
from rpc.client import generate_request
from tests.support.rpc_helpers import ServerProcess

CKPT = "tiny_deepseek"
DP2 = ["parallel.world_size=2", "parallel.attn_tp=1", "parallel.attn_dp=2", "parallel.moe_tp=1",
       "parallel.moe_ep=2", "engine.block_size=4"]
HISTORY = [5, 17, 3, 99, 150, 7, 64, 31, 2, 4, 6, 8, 10, 12, 14, 16, 18]
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_ckpts, tmp_path_factory):
    srv = ServerProcess(tiny_ckpts[CKPT], DP2, tmp_path_factory.mktemp("kv") / "server.log")
    try:
        client = srv.wait_ready()
        yield client
        client.close()
    finally:
        srv.close()


class Subscriber:
    """A SubscribeKvEvents stream in a thread, replayed into ``index`` {wire hash: token ids}."""

    def __init__(self, client):
        self.index, self.batches, self.cleared = {}, [], 0
        self.call = client.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=0, load_records_before_first_batch=True))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for batch in self.call:
                self.batches.append(batch)
                for e in batch.events:
                    kind = e.WhichOneof("data")
                    if kind == "stored":
                        self.index.update({b.block_hash: list(b.token_ids) for b in e.stored.blocks})
                    elif kind == "removed":
                        for h in e.removed.block_hashes:
                            self.index.pop(h, None)
                    else:
                        self.index.clear()
                        self.cleared += 1
        except grpc.RpcError:
            pass

    def settle(self, engine_info, seconds=10.0):
        """Waits until the replayed index matches the engine's (its count and digest); returns whether it did."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            kv = engine_info()["kv"]
            cached = sum(r["blocks_cached"] for r in kv["per_dp"])
            if cached == len(self.index) and index_digest(self.index) == kv["index_digest"]:
                return True
            time.sleep(0.1)
        return False


def _generate_stream(client, prompt, **kw):
    req = generate_request(prompt, True, **kw)
    return list(client.stub.Generate(req, timeout=60))


def test_cached_tokens_ride_every_chunk_and_the_final_message(server):
    first = server.generate(HISTORY, **GREEDY)
    second = HISTORY + first.token_ids + [77, 90, 91]
    msgs = _generate_stream(server, second, **GREEDY)
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    complete = msgs[-1].complete
    assert complete.cached_tokens >= 20 and all(c.cached_tokens == complete.cached_tokens for c in chunks)
    assert server.loads()["cache_hit_rate"] > 0
    info = server.server_info()
    assert info["data_parallel_size"] == 2 and len(server.loads()["per_rank"]) == 2


def test_a_pinned_rank_is_honoured_and_a_shared_prefix_follows_its_blocks(server):
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122]
    req = generate_request(prompt, False, **GREEDY)
    req.data_parallel_rank = 1
    before = [r["blocks_cached"] for r in server.engine_info()["kv"]["per_dp"]]
    list(server.stub.Generate(req, timeout=60))
    after = [r["blocks_cached"] for r in server.engine_info()["kv"]["per_dp"]]
    assert after[1] > before[1] and after[0] == before[0]
    again = server.generate(prompt + [5, 6, 7, 8, 9], **GREEDY)  # unpinned: placed where its prefix is cached
    assert again.finish_reason == "length"
    r = list(server.stub.Generate(generate_request(prompt + [1, 2], False, **GREEDY), timeout=60))[-1].complete
    assert r.cached_tokens >= 8
    bad = generate_request(prompt, False, **GREEDY)
    bad.data_parallel_rank = 5
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(bad, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data_parallel_rank" in err.value.details()


def test_kv_events_rebuild_the_index_and_follow_a_flush(server):
    late = None
    sub = Subscriber(server)
    try:
        for i in range(3):
            server.generate(HISTORY[i:] + [40 + i] * 9, **GREEDY)
        assert sub.settle(server.engine_info), (len(sub.index), server.engine_info()["kv"])
        assert sub.batches[0].sequence_number == 0 and sub.batches[0].load.load_only
        late = Subscriber(server)  # joins now: gets the index as one snapshot batch
        assert late.settle(server.engine_info) and late.index == sub.index
        long = server.stream(HISTORY, temperature=0.0, max_tokens=400, ignore_eos=True)
        it = iter(long)
        next(it)  # running now
        ok, why = server.flush_cache(timeout_s=0.2)
        assert not ok and "still hold KV blocks" in why
        long.cancel()
        deadline = time.monotonic() + 30
        while not (ok := server.flush_cache(timeout_s=1.0)[0]):
            assert time.monotonic() < deadline
        assert all(r["blocks_cached"] == 0 for r in server.engine_info()["kv"]["per_dp"])
        assert sub.settle(server.engine_info) and sub.cleared >= 1 and sub.index == {}
    finally:
        sub.call.cancel()
        if late is not None:
            late.call.cancel()


def test_a_resubscription_past_the_last_batch_is_out_of_range(server):
    call = server.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9))
    with pytest.raises(grpc.RpcError) as err:
        next(iter(call))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_a_bad_kv_hint_is_refused(server):
    req = generate_request(HISTORY, False, **GREEDY)
    req.kv_transfer_params_json = '{"remote_host": "x"}'
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "retain_kv" in err.value.details()
    req.kv_transfer_params_json = '{"retain_kv": true}'
    assert list(server.stub.Generate(req, timeout=30))[-1].complete.finish_reason == "length"
